"""Connecting every rank of a job to every other, through the rendezvous.

Each rank listens on a fresh port, publishes ``host, address, port`` under
``mesh/<generation>/<rank>``, and waits for every peer's record. It then connects to
every lower rank and accepts from every higher one, so each pair shares exactly one
data link; in addition every rank above 0 opens a control link to rank 0, which
coordinates the job. Every connection passes the HMAC challenge and then names its
kind, rank and generation; anything else is logged and dropped, and the job goes on.

Connections only go from higher to lower ranks, and a rank accepts only after it has
made its own connections, so set-up cannot deadlock. The listener closes once the
mesh is complete.

A rank handshakes every connection it accepts at once (``Acceptor``: one selector, a
small state machine per connection), so a silent or slow connection to its port (a port
scanner, a health check, a half-dead client) never holds a real rank back: it is dropped
at its own deadline, and only the start timeout bounds the whole set-up.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import logging
import selectors
import socket
import struct
import time

from hora.errors import AuthenticationError, HoraInternalError, ProtocolError
from hora.transport import auth, shm, tcp
from hora.transport.rendezvous import RendezvousClient, RendezvousTimeout

log = logging.getLogger(__name__)

DATA = 1
CONTROL = 2
_HELLO = struct.Struct("<BIIQ")  # kind, rank, size, generation
_HELLO_KIND = 1
SPARE_HANDSHAKES = 64  # connections an Acceptor lets wait for the handshake beyond the peers it expects


@dataclasses.dataclass
class Mesh:
    """The connections of one rank to the rest of the job.

    Attributes:
        rank: this rank.
        size: the number of ranks.
        hosts: the host name of every rank, by rank.
        machines: the machine (kernel instance) of every rank, by rank: ranks with the
            same host name and machine can share memory.
        data: peer rank -> the data link shared with it.
        control: on rank 0, worker rank -> its control link; on other ranks, {0: link}.
    """

    rank: int
    size: int
    hosts: list[str]
    machines: list[str]
    data: dict[int, tcp.Link]
    control: dict[int, tcp.Link]

    def close(self) -> None:
        for link in (*self.data.values(), *self.control.values()):
            link.close()

    def links(self) -> list[tcp.Link]:
        return [*self.data.values(), *self.control.values()]

    def size_buffers(self, nbytes: int) -> None:
        """Fixes every data link's send and receive buffer at ``nbytes`` (the kernel
        doubles what it is given, for its bookkeeping), turning its autotuning off.

        Raises:
            OSError: the kernel refused the option.
        """
        for link in self.data.values():
            link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
            link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)


def _peer_key(generation: int, rank: int) -> str:
    return f"mesh/{generation}/{rank}"


def build_mesh(
    rank: int,
    size: int,
    hostname: str,
    secret: bytes,
    rendezvous: RendezvousClient,
    generation: int,
    timeout: float,
    bind_host: str,
) -> Mesh:
    """Connects this rank to every other rank of the job.

    Args:
        rank: this rank.
        size: the number of ranks.
        hostname: this rank's host name, for peers' error messages.
        secret: the job secret.
        rendezvous: a connected rendezvous client.
        generation: counts the job's (re-)initializations, so keys never collide.
        timeout: seconds to wait for every peer.
        bind_host: the address to listen on and advertise.

    Returns:
        The mesh, with every link authenticated and non-blocking.

    Raises:
        HoraInternalError: a peer never arrived or never connected; names the ranks.
    """
    listener = tcp.listen(bind_host)
    data: dict[int, tcp.Link] = {}
    control: dict[int, tcp.Link] = {}
    try:
        port = listener.getsockname()[1]
        record = f"{hostname}\n{bind_host}\n{port}\n{shm.machine_id()}"
        rendezvous.put(_peer_key(generation, rank), record.encode())
        try:
            records = rendezvous.wait([_peer_key(generation, r) for r in range(size)], timeout)
        except RendezvousTimeout as exc:
            missing = sorted(int(key.rsplit("/", 1)[1]) for key in exc.missing)
            raise HoraInternalError(
                f"hora.init: rank(s) {', '.join(map(str, missing))} of {size} did not reach the rendezvous at "
                f"{rendezvous.host}:{rendezvous.port} within {timeout:g} s (raise --start-timeout or "
                "HORA_START_TIMEOUT if they start slowly)"
            ) from None
        parsed = [_parse_record(r, record) for r, record in enumerate(records)]
        peers = [(host, address, port) for host, address, port, _ in parsed]
        hosts = [host for host, _, _ in peers]
        machines = [machine for _, _, _, machine in parsed]
        deadline = time.monotonic() + timeout
        for peer in range(rank):
            data[peer] = _connect(peers, peer, DATA, rank, size, generation, secret, deadline)
        if rank > 0:
            control[0] = _connect(peers, 0, CONTROL, rank, size, generation, secret, deadline)
        expected = {(DATA, peer) for peer in range(rank + 1, size)}
        if rank == 0:
            expected |= {(CONTROL, peer) for peer in range(1, size)}
        for kind, peer, sock in Acceptor(listener, secret, size, generation, expected).run(deadline):
            (data if kind == DATA else control)[peer] = tcp.Link(sock, peer, hosts[peer])
    except BaseException:
        for link in (*data.values(), *control.values()):
            link.close()
        raise
    finally:
        listener.close()
    for link in (*data.values(), *control.values()):
        link.set_nonblocking()
    return Mesh(rank, size, hosts, machines, data, control)


def _parse_record(rank: int, record: bytes) -> tuple[str, str, int, str]:
    try:
        host, address, port, machine = record.decode().split("\n")
        return host, address, int(port), machine
    except ValueError:
        raise ProtocolError(f"rank {rank} published a malformed address record") from None


def _connect(
    peers: list[tuple[str, str, int]],
    peer: int,
    kind: int,
    rank: int,
    size: int,
    generation: int,
    secret: bytes,
    deadline: float,
) -> tcp.Link:
    host, address, port = peers[peer]
    try:
        sock = tcp.connect(address, port, max(0.1, deadline - time.monotonic()))
    except TimeoutError as exc:
        raise HoraInternalError(f"hora.init: rank {rank} could not connect to rank {peer} on {host}: {exc}") from None
    try:
        auth.connect_handshake(sock, secret)
        tcp.send_frame_blocking(sock, _HELLO_KIND, _HELLO.pack(kind, rank, size, generation))
    except (AuthenticationError, OSError) as exc:
        sock.close()
        raise HoraInternalError(f"hora.init: rank {rank} failed to set up its link to rank {peer} on {host}: {exc}") from None
    return tcp.Link(sock, peer, host)


class _Step(enum.Enum):
    """Where a pending connection stands; each step reads a fixed number of bytes."""

    CHALLENGE = 1  # our challenge goes out; we read the connector's answer
    HEADER = 2  # our proof goes out; we read the hello frame's header
    HELLO = 3  # we read the hello itself


@dataclasses.dataclass(eq=False)
class _Pending:
    """One accepted connection that has not finished the handshake yet."""

    sock: socket.socket
    address: tuple[str, int]
    deadline: float
    challenge: auth.Challenge
    step: _Step = _Step.CHALLENGE
    outbox: bytes = b""  # bytes still to send before reading on
    need: int = auth.REPLY_BYTES  # bytes this step reads, in all
    inbox: bytearray = dataclasses.field(default_factory=bytearray)
    events: int = 0  # what the selector watches for it


class Acceptor:
    """Accepts a rank's expected peers, handshaking every connection at once.

    One thread and one selector drive the listener and every pending connection, all
    non-blocking. Each pending connection moves through three steps whenever its socket
    is ready: send the challenge and read the connector's answer (``auth.Challenge``),
    send our proof and read the hello frame's header, read the hello. A valid hello names
    an expected (kind, rank), this job's size and this generation.

    Rules:

    - No connection waits for another: a silent or slow one holds only its own slot.
    - Each pending connection has its own deadline, ``handshake_timeout`` after it was
      accepted. Past it, or on any failure (wrong magic or MAC, a closed or reset socket, a
      frame that is not the expected hello), it is logged and dropped; nothing else changes.
    - At most ``len(expected) + spare`` connections are pending at once, so every real
      peer fits even when all of them arrive together. One more evicts the oldest
      connection that has not passed the challenge (a real peer passes it within a round
      trip), so a flood holds a bounded number of sockets and cannot keep real peers out
      for long.
    - A step reads exactly the bytes it needs, never more: a peer may send control frames
      right after its hello, and those belong to the link.
    - Invariant: a connection is registered with the selector exactly while it is in
      ``_pending``; it leaves both before its socket is closed or handed over.

    An acceptor runs once. Connections still pending when the mesh is complete are
    logged and dropped.

    Args:
        listener: the rank's listening socket (it is made non-blocking).
        secret: the job secret.
        size: the number of ranks of the job.
        generation: this initialization's generation.
        expected: the (kind, rank) pairs to accept.
        handshake_timeout: seconds each connection has to complete the handshake.
        spare: connections allowed to wait beyond the expected ones.

    Attributes:
        rejected: connections dropped so far.
        peak_pending: the most connections pending at once.
    """

    def __init__(
        self,
        listener: socket.socket,
        secret: bytes,
        size: int,
        generation: int,
        expected: set[tuple[int, int]],
        handshake_timeout: float = auth.HANDSHAKE_TIMEOUT,
        spare: int = SPARE_HANDSHAKES,
    ) -> None:
        self._listener = listener
        self._secret = secret
        self._size = size
        self._generation = generation
        self._wanted = set(expected)
        self._handshake_timeout = handshake_timeout
        self._limit = len(expected) + spare
        self._pending: dict[_Pending, None] = {}  # in order of arrival, oldest first
        self._selector = selectors.DefaultSelector()
        self._ran = False
        self.rejected = 0
        self.peak_pending = 0

    def run(self, deadline: float) -> list[tuple[int, int, socket.socket]]:
        """Accepts until every expected peer has completed the handshake.

        Args:
            deadline: the ``time.monotonic()`` by which every peer must have arrived.

        Returns:
            (kind, rank, socket) per expected peer, each socket blocking.

        Raises:
            HoraInternalError: the deadline passed first (names the ranks still missing),
                or the listener failed.
            RuntimeError: the acceptor ran before.
        """
        if self._ran:
            raise RuntimeError("an Acceptor runs once")
        self._ran = True
        accepted: list[tuple[int, int, socket.socket]] = []
        try:
            self._listener.setblocking(False)
            self._selector.register(self._listener, selectors.EVENT_READ, None)
            while self._wanted:
                now = time.monotonic()
                for conn in [c for c in self._pending if c.deadline <= now]:
                    self._drop(conn, f"the peer did not complete the handshake within {self._handshake_timeout:g} s")
                if now >= deadline:
                    ranks = sorted({peer for _, peer in self._wanted})
                    raise HoraInternalError(
                        f"hora.init: rank(s) {', '.join(map(str, ranks))} never connected within the start timeout"
                    )
                wake = min([deadline, *(conn.deadline for conn in self._pending)])
                for key, _ in self._selector.select(max(0.0, wake - now)):
                    if key.data is None:
                        self._accept()
                    elif key.data in self._pending:  # not dropped earlier in this round
                        hello = self._advance(key.data)
                        if hello is not None:
                            self._wanted.discard(hello)
                            accepted.append((*hello, key.data.sock))
                    if not self._wanted:
                        break
            for conn in list(self._pending):
                self._drop(conn, "the mesh was complete before it finished the handshake")
        except BaseException:
            for _, _, sock in accepted:
                sock.close()
            raise
        finally:
            for conn in list(self._pending):
                self._forget(conn)
                conn.sock.close()
            self._selector.close()
        return accepted

    def _accept(self) -> None:
        """Accepts one connection from the listener's queue, making room if needed."""
        try:
            sock, address = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return  # another wake-up, or the connection went away while queued
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE) and self._pending:
                self._drop(self._oldest(), f"dropped to free a file descriptor ({exc.strerror})")
                return
            raise HoraInternalError(f"hora.init: could not accept connections: {exc}") from None
        deadline = time.monotonic() + self._handshake_timeout
        conn = _Pending(sock, (str(address[0]), int(address[1])), deadline, auth.Challenge(self._secret))
        try:
            sock.setblocking(False)
            tcp.configure(sock)
        except OSError as exc:
            self._reject(conn, str(exc))
            sock.close()
            return
        if len(self._pending) >= self._limit:
            waiting = len(self._pending)
            self._drop(self._oldest(), f"dropped to make room: {waiting} connections were waiting for the handshake")
        conn.outbox = conn.challenge.greeting()
        conn.events = selectors.EVENT_WRITE
        self._selector.register(sock, conn.events, conn)
        self._pending[conn] = None
        self.peak_pending = max(self.peak_pending, len(self._pending))

    def _oldest(self) -> _Pending:
        """The oldest connection that has not passed the challenge, else the oldest of all."""
        return next((c for c in self._pending if c.step is _Step.CHALLENGE), next(iter(self._pending)))

    def _advance(self, conn: _Pending) -> tuple[int, int] | None:
        """Moves one connection on as far as its socket allows.

        Returns:
            (kind, rank) once its hello is valid (the connection is then handed over,
            blocking and out of ``_pending``); None while it is still pending or was dropped.
        """
        try:
            hello = self._progress(conn)
        except (AuthenticationError, ProtocolError) as exc:
            self._drop(conn, str(exc))
            return None
        except OSError as exc:
            if conn.step is _Step.CHALLENGE:
                self._drop(conn, f"the connection failed during the handshake: {exc}")
            else:
                self._drop(conn, str(exc))
            return None
        if hello is None:
            events = selectors.EVENT_WRITE if conn.outbox else selectors.EVENT_READ
            if events != conn.events:
                conn.events = events
                self._selector.modify(conn.sock, events, conn)
            return None
        self._forget(conn)
        conn.sock.setblocking(True)
        return hello

    def _progress(self, conn: _Pending) -> tuple[int, int] | None:
        """Sends and reads what the connection's steps call for until its socket would block.

        Returns:
            (kind, rank) from a valid hello, or None when the socket would block.

        Raises:
            AuthenticationError: the peer failed the challenge or closed during it.
            ProtocolError: the peer's first frame is not a valid hello for this mesh.
            OSError: the connection failed.
        """
        while True:
            try:
                if conn.outbox:
                    sent = conn.sock.send(conn.outbox)
                    conn.outbox = conn.outbox[sent:]
                    continue
                chunk = conn.sock.recv(conn.need - len(conn.inbox))
            except (BlockingIOError, InterruptedError):
                return None
            if not chunk:
                if conn.step is _Step.CHALLENGE:
                    raise AuthenticationError(
                        "the peer closed the connection during the handshake (a wrong job secret?)"
                    )
                raise ConnectionError("the peer closed the connection")
            conn.inbox += chunk
            if len(conn.inbox) < conn.need:
                continue
            received = bytes(conn.inbox)
            conn.inbox.clear()
            if conn.step is _Step.CHALLENGE:
                conn.outbox = conn.challenge.answer(received)
                conn.step, conn.need = _Step.HEADER, tcp.FRAME_HEADER.size
            elif conn.step is _Step.HEADER:
                length, frame_kind = tcp.FRAME_HEADER.unpack(received)
                if length > _HELLO.size:
                    raise ProtocolError(f"frame of {length} bytes exceeds the limit of {_HELLO.size}")
                if frame_kind != _HELLO_KIND or length != _HELLO.size:
                    raise ProtocolError("the first message was not a hello")
                conn.step, conn.need = _Step.HELLO, _HELLO.size
            else:
                return self._check_hello(received)

    def _check_hello(self, payload: bytes) -> tuple[int, int]:
        """Returns the (kind, rank) a hello names, if this mesh still expects it.

        Raises:
            ProtocolError: a kind or rank not expected (or already connected), another
                job size or another generation.
        """
        kind, peer, peer_size, peer_generation = _HELLO.unpack(payload)
        if (kind, peer) not in self._wanted or peer_size != self._size or peer_generation != self._generation:
            raise ProtocolError(
                f"unexpected hello (kind {kind}, rank {peer}, size {peer_size}, generation {peer_generation})"
            )
        return kind, peer

    def _drop(self, conn: _Pending, reason: str) -> None:
        """Logs and closes a pending connection."""
        self._forget(conn)
        self._reject(conn, reason)
        conn.sock.close()

    def _reject(self, conn: _Pending, reason: str) -> None:
        self.rejected += 1
        log.warning("rejected a connection from %s:%s: %s", conn.address[0], conn.address[1], reason)

    def _forget(self, conn: _Pending) -> None:
        """Takes a connection out of ``_pending`` and the selector (the invariant's two halves)."""
        del self._pending[conn]
        self._selector.unregister(conn.sock)
