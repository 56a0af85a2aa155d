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
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import struct
import time

from hora.errors import AuthenticationError, HoraInternalError, ProtocolError
from hora.transport import auth, shm, tcp
from hora.transport.rendezvous import RendezvousClient, RendezvousTimeout

log = logging.getLogger("hora.transport")

DATA = 1
CONTROL = 2
_HELLO = struct.Struct("<BIIQ")  # kind, rank, size, generation
_HELLO_KIND = 1


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
        for kind, peer, sock in _accept(listener, expected, size, generation, secret, deadline):
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


def _accept(
    listener: socket.socket,
    expected: set[tuple[int, int]],
    size: int,
    generation: int,
    secret: bytes,
    deadline: float,
) -> list[tuple[int, int, socket.socket]]:
    """Accepts the expected connections, dropping any that fail authentication or hello."""
    accepted: list[tuple[int, int, socket.socket]] = []
    try:
        while expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ranks = sorted({peer for _, peer in expected})
                raise HoraInternalError(
                    f"hora.init: rank(s) {', '.join(map(str, ranks))} never connected within the start timeout"
                )
            listener.settimeout(remaining)
            try:
                sock, address = listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            tcp.configure(sock)
            try:
                auth.accept_handshake(sock, secret, timeout=min(auth.HANDSHAKE_TIMEOUT, max(remaining, 0.1)))
                sock.settimeout(max(0.1, min(auth.HANDSHAKE_TIMEOUT, remaining)))
                frame_kind, payload = tcp.recv_frame_blocking(sock, max_size=_HELLO.size)
                sock.settimeout(None)
                if frame_kind != _HELLO_KIND or len(payload) != _HELLO.size:
                    raise ProtocolError("the first message was not a hello")
                kind, peer, peer_size, peer_generation = _HELLO.unpack(payload)
                if (kind, peer) not in expected or peer_size != size or peer_generation != generation:
                    raise ProtocolError(
                        f"unexpected hello (kind {kind}, rank {peer}, size {peer_size}, generation {peer_generation})"
                    )
            except (AuthenticationError, ProtocolError, OSError) as exc:
                log.warning("hora: rejected a connection from %s:%s: %s", address[0], address[1], exc)
                sock.close()
                continue
            expected.discard((kind, peer))
            accepted.append((kind, peer, sock))
    except BaseException:
        for _, _, sock in accepted:
            sock.close()
        raise
    return accepted
