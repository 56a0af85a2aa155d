"""The rendezvous server: an authenticated key-value store that a job's ranks meet through.

``horarun`` runs one for its job; without ``horarun`` (under ``mpirun``, ``srun`` or
torchrun-style variables) rank 0 runs it inside its own process (``hora.core.runtime``). It
lives in the transport layer so that the runtime never imports the launcher.

One thread accepts connections; each connection gets a thread that runs the HMAC
challenge (``hora.transport.auth``) and then serves PUT and WAIT frames
(``hora.transport.rendezvous``). A connection that fails the challenge or sends a
malformed frame is logged and dropped; nothing it sent is parsed further, and the
store and the other connections are untouched. A well-formed request with a value out
of range (a WAIT timeout that is NaN, negative or infinite) is answered ``ERROR`` and
the connection goes on.

What a connection may cost the server, whoever is at the other end:

* The handshake must be complete ``handshake_timeout`` seconds after the connection was
  accepted, however slowly the peer drips its bytes: a watchdog thread shuts down a
  connection still in the handshake at its deadline.
* A frame's header is checked before its payload is read: an unknown kind, or a length
  above what that kind needs (``rendezvous.FRAME_LIMITS``), drops the connection. The
  payload buffer grows only with the bytes that arrived, never to the announced size.
* Once a frame has begun, every read must bring bytes within ``frame_timeout`` seconds,
  else the connection is dropped with what it had sent. Between frames a client may idle
  for as long as it likes (a rank keeps its connection until its mesh is formed), and
  while the server holds a WAIT it reads nothing, so a long WAIT is never timed out.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from hora.errors import AuthenticationError, ProtocolError
from hora.transport import auth, tcp
from hora.transport import rendezvous as proto
from hora.transport.codec import Reader, Writer

log = logging.getLogger(__name__)

FRAME_TIMEOUT = 30.0  # seconds a client that began a frame may send nothing
_CHUNK = 1 << 16  # bytes read at once: the most a payload buffer runs ahead of the data


class RendezvousServer:
    """Serves one job's rendezvous until ``stop``.

    Args:
        secret: the job secret every client must prove it holds.
        host: the address to listen on.
        port: the port, 0 for any free one.
        handshake_timeout: seconds a connection has to complete the HMAC challenge.
        frame_timeout: seconds a client in the middle of a frame may send nothing.
    """

    def __init__(
        self,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        handshake_timeout: float = auth.HANDSHAKE_TIMEOUT,
        frame_timeout: float = FRAME_TIMEOUT,
    ) -> None:
        self._secret = secret
        self._handshake_timeout = handshake_timeout
        self._frame_timeout = frame_timeout
        self._listener = tcp.listen(host, port)
        self._store: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._stopped = threading.Event()
        self._connections: set[socket.socket] = set()
        self._watchdog = _Watchdog()
        self._thread = threading.Thread(target=self._accept_loop, name="hora-rendezvous", daemon=True)
        self.rejected = 0  # connections dropped for failing authentication or the protocol

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def start(self) -> RendezvousServer:
        self._watchdog.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops accepting, closes every connection and wakes every waiter."""
        self._stopped.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._changed:
            for sock in self._connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._changed.notify_all()
        self._thread.join(timeout=5)
        self._watchdog.stop()

    def get(self, key: str) -> bytes | None:
        """Returns the value stored under ``key``, for the launcher's own use."""
        with self._changed:
            return self._store.get(key)

    def keys(self) -> list[str]:
        """The keys stored, for the launcher's own use."""
        with self._changed:
            return list(self._store)

    def put(self, key: str, value: bytes) -> None:
        """Stores a value, for the launcher's own use."""
        with self._changed:
            self._store[key] = value
            self._changed.notify_all()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                sock, address = self._listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(sock, address), name="hora-rendezvous-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, address: tuple[str, int]) -> None:
        with self._changed:
            self._connections.add(sock)
        try:
            tcp.configure(sock)
            self._authenticate(sock)
            while not self._stopped.is_set():
                request = self._read_request(sock)
                if request is None:
                    return
                reply_kind, reply = self._handle(*request, address)
                tcp.send_frame_blocking(sock, reply_kind, reply)
        except (AuthenticationError, ProtocolError) as exc:
            with self._changed:
                self.rejected += 1
            log.warning("rendezvous: rejected a connection from %s:%s: %s", address[0], address[1], exc)
        except OSError:
            pass  # the client went away (or the server is stopping); nothing to clean up but the socket
        finally:
            with self._changed:
                self._connections.discard(sock)
            sock.close()

    def _authenticate(self, sock: socket.socket) -> None:
        """Runs the challenge with a deadline for the whole of it, not for each read.

        Raises:
            AuthenticationError: the peer failed the challenge or ran out of time.
        """
        self._watchdog.arm(sock, self._handshake_timeout)
        try:
            auth.accept_handshake(sock, self._secret, self._handshake_timeout)
        except AuthenticationError:
            if not self._watchdog.disarm(sock):
                raise
        else:
            if not self._watchdog.disarm(sock):
                return
        # The watchdog shut the socket down: say why, not "the peer closed the connection".
        raise AuthenticationError(f"the peer did not complete the handshake within {self._handshake_timeout:g} s")

    def _read_request(self, sock: socket.socket) -> tuple[int, bytes] | None:
        """Reads one request frame, checking its header before reading its payload.

        Returns:
            (kind, payload), or None when the client closed the connection between frames.

        Raises:
            ProtocolError: an unknown kind, a frame larger than its kind allows, or a
                client silent for ``frame_timeout`` seconds in the middle of a frame.
            ConnectionError: the client closed the connection in the middle of a frame.
        """
        sock.settimeout(None)  # between frames a client may idle as long as it likes
        first = sock.recv(tcp.FRAME_HEADER.size)
        if not first:
            return None
        sock.settimeout(self._frame_timeout)
        header = first + self._receive(sock, tcp.FRAME_HEADER.size - len(first), len(first), None)
        length, kind = tcp.FRAME_HEADER.unpack(header)
        limit = proto.FRAME_LIMITS.get(kind)
        if limit is None:
            raise ProtocolError(f"unknown request kind {kind}")
        if length > limit:
            raise ProtocolError(
                f"a {proto.REQUEST_NAMES[kind]} request of {length} bytes exceeds the limit of {limit} bytes"
            )
        return kind, self._receive(sock, length, 0, length)

    def _receive(self, sock: socket.socket, count: int, before: int, total: int | None) -> bytes:
        """Reads exactly ``count`` bytes; the buffer grows only as bytes arrive.

        Args:
            sock: the connection, with ``frame_timeout`` set.
            count: the bytes to read.
            before: bytes of this part (header or payload) already read, for the message.
            total: the payload's announced size, or None while reading the header.

        Raises:
            ProtocolError: nothing arrived for ``frame_timeout`` seconds.
            ConnectionError: the client closed the connection.
        """
        data = bytearray()
        while len(data) < count:
            try:
                chunk = sock.recv(min(count - len(data), _CHUNK))
            except TimeoutError:
                part = "frame header" if total is None else f"{total}-byte payload"
                raise ProtocolError(
                    f"sent {before + len(data)} bytes of a {part}, then nothing for {self._frame_timeout:g} s"
                ) from None
            if not chunk:
                raise ConnectionError("the client closed the connection in the middle of a frame")
            data += chunk
        return bytes(data)

    def _handle(self, kind: int, payload: bytes, address: tuple[str, int]) -> tuple[int, bytes]:
        reader = Reader(payload)
        if kind == proto.PUT:
            key, value = reader.string(), reader.blob()
            reader.done()
            self.put(key, value)
            return proto.OK, b""
        # A WAIT: _read_request refused every other kind.
        timeout = reader.f64()
        keys = proto.decode_keys(reader)
        reader.done()
        try:
            seconds = proto.check_wait_timeout(timeout)
        except ValueError as exc:
            log.warning("rendezvous: refused a request from %s:%s: %s", address[0], address[1], exc)
            return proto.ERROR, Writer().string(str(exc)).bytes()
        return self._wait(keys, seconds)

    def _wait(self, keys: list[str], timeout: float) -> tuple[int, bytes]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                missing = [key for key in keys if key not in self._store]
                remaining = deadline - time.monotonic()
                if not missing:
                    reply = Writer().u32(len(keys))
                    for key in keys:
                        reply.blob(self._store[key])
                    return proto.VALUES, reply.bytes()
                if remaining <= 0 or self._stopped.is_set():
                    return proto.MISSING, proto.encode_keys(missing).bytes()
                self._changed.wait(remaining)


class _Watchdog:
    """Shuts down sockets that outlive their deadline; one thread serves the whole server.

    ``arm`` gives a socket a deadline; ``disarm`` takes it back and says whether the
    deadline had passed. Invariant: a socket is in ``_deadlines`` from ``arm`` until the
    first of ``disarm`` and its deadline; the thread shuts a socket down only while it is
    there, so a disarmed socket (which its owner may close and whose descriptor the
    system may reuse) is never touched.
    """

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._deadlines: dict[socket.socket, float] = {}
        self._expired: set[socket.socket] = set()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="hora-rendezvous-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def arm(self, sock: socket.socket, seconds: float) -> None:
        with self._wake:
            self._deadlines[sock] = time.monotonic() + seconds
            self._wake.notify()

    def disarm(self, sock: socket.socket) -> bool:
        """Takes ``sock`` back; True when its deadline had passed and it was shut down."""
        with self._wake:
            self._deadlines.pop(sock, None)
            if sock in self._expired:
                self._expired.discard(sock)
                return True
            return False

    def _run(self) -> None:
        with self._wake:
            while not self._stopped:
                now = time.monotonic()
                for sock, deadline in list(self._deadlines.items()):
                    if deadline <= now:
                        del self._deadlines[sock]
                        self._expired.add(sock)
                        try:
                            sock.shutdown(socket.SHUT_RDWR)  # wakes the reader blocked in recv
                        except OSError:
                            pass
                earliest = min(self._deadlines.values(), default=None)
                self._wake.wait(None if earliest is None else max(0.0, earliest - now))
