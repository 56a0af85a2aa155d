"""The rendezvous server: an authenticated key-value store that a job's ranks meet through.

``horarun`` runs one for its job; without ``horarun`` (under ``mpirun``, ``srun`` or
torchrun-style variables) rank 0 runs it inside its own process (``hora.runtime``). It
lives in the transport layer so that the runtime never imports the launcher.

One thread accepts connections; each connection gets a thread that runs the HMAC
challenge (``hora.transport.auth``) and then serves PUT and WAIT frames
(``hora.transport.rendezvous``). A connection that fails the challenge or sends a
malformed frame is logged and dropped; nothing it sent is parsed further, and the
store and the other connections are untouched.
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

log = logging.getLogger("hora.transport")

_MAX_REQUEST = 16 * 1024 * 1024


class RendezvousServer:
    """Serves one job's rendezvous until ``stop``.

    Args:
        secret: the job secret every client must prove it holds.
        host: the address to listen on.
        port: the port, 0 for any free one.
    """

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0) -> None:
        self._secret = secret
        self._listener = tcp.listen(host, port)
        self._store: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._stopped = threading.Event()
        self._connections: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, name="hora-rendezvous", daemon=True)
        self.rejected = 0  # connections dropped for failing authentication or the protocol

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def start(self) -> RendezvousServer:
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

    def get(self, key: str) -> bytes | None:
        """Returns the value stored under ``key``, for the launcher's own use."""
        with self._changed:
            return self._store.get(key)

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
            auth.accept_handshake(sock, self._secret)
            while not self._stopped.is_set():
                try:
                    kind, payload = tcp.recv_frame_blocking(sock, max_size=_MAX_REQUEST)
                except ConnectionError:
                    return
                reply_kind, reply = self._handle(kind, payload)
                tcp.send_frame_blocking(sock, reply_kind, reply)
        except (AuthenticationError, ProtocolError) as exc:
            self.rejected += 1
            log.warning("hora rendezvous: rejected a connection from %s:%s: %s", address[0], address[1], exc)
        except OSError:
            pass  # the client went away; nothing to clean up but the socket
        finally:
            with self._changed:
                self._connections.discard(sock)
            sock.close()

    def _handle(self, kind: int, payload: bytes) -> tuple[int, bytes]:
        reader = Reader(payload)
        if kind == proto.PUT:
            key, value = reader.string(), reader.blob()
            reader.done()
            self.put(key, value)
            return proto.OK, b""
        if kind == proto.WAIT:
            timeout = reader.f64()
            keys = proto.decode_keys(reader)
            reader.done()
            if not timeout >= 0:
                raise ProtocolError(f"invalid wait timeout {timeout}")
            return self._wait(keys, timeout)
        raise ProtocolError(f"unknown request kind {kind}")

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
