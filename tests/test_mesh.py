"""Idle, slow or lying connections to a rank's mesh port never delay the job's start.

A rank handshakes every accepted connection at once (``hora.transport.mesh.Acceptor``),
so a port scanner or a half-dead client that opens a connection and says nothing costs
the real ranks nothing; it is dropped at its own deadline. Before, the listener served one
connection at a time with a 10 s deadline, and a single silent connection failed
``init()`` or held the real ranks back behind it.

The job-level tests hold the last rank's mesh address back in the rendezvous server until
the test has opened its connections; no rank connects to another before it has every
address, so the test's connections always reach the listeners before any real rank's does.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harness import run_ranks
from hora.errors import AuthenticationError, HoraInternalError
from hora.transport import auth, tcp
from hora.transport.mesh import _HELLO, _HELLO_KIND, CONTROL, DATA, Acceptor, build_mesh
from hora.transport.rendezvous import RendezvousClient
from hora.transport.rendezvous_server import RendezvousServer

_GO = "test/go"
# "Well under the old 10 s": a start on a loaded machine takes a fraction of this.
_PROMPT = 5.0


def _job() -> tuple[float, float]:
    """Runs init and one allreduce.

    Returns:
        (the allreduce's sum, the wall-clock time when it completed).
    """
    import time

    import numpy as np

    import hora.numpy as hvd

    hvd.init()
    total = float(hvd.allreduce(np.ones(4), op=hvd.Sum, name="x")[0])
    done = time.time()
    hvd.shutdown()
    return total, done


def _hold_mesh_key(monkeypatch: pytest.MonkeyPatch, key: str) -> threading.Event:
    """Holds the rank that publishes ``key`` in the rendezvous server until the event is set.

    Every rank waits for every mesh address before it connects, so while the key is held
    no rank has connected to any other yet, and the listeners of the ranks that published
    already are open.
    """
    gate = threading.Event()
    put = RendezvousServer.put

    def held_put(self: RendezvousServer, name: str, value: bytes) -> None:
        if name == key:
            gate.wait(60)
        put(self, name, value)

    monkeypatch.setattr(RendezvousServer, "put", held_put)
    return gate


def _mesh_ports(server: RendezvousServer, ranks: range, timeout: float = 30.0) -> dict[int, tuple[str, int]]:
    """Polls the store for the mesh addresses the ranks publish (generation 0)."""
    deadline = time.monotonic() + timeout
    found: dict[int, tuple[str, int]] = {}
    while len(found) < len(ranks):
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks {sorted(set(ranks) - set(found))} never published a mesh address")
        for rank in ranks:
            record = server.get(f"mesh/0/{rank}")
            if record is not None and rank not in found:
                _, address, port, _ = record.decode().split("\n")
                found[rank] = (address, int(port))
        time.sleep(0.01)
    return found


def _half_answer(address: str, port: int) -> socket.socket:
    """A client that sends the first half of an answer to the challenge and stalls.

    It does not wait for the challenge, so it can be opened before the rank accepts.
    """
    sock = socket.create_connection((address, port), timeout=10)
    sock.sendall(auth.MAGIC + os.urandom(auth.NONCE_BYTES // 2))
    return sock


def _lying_hello(address: str, port: int, secret: bytes, hello: bytes) -> socket.socket:
    """A client that holds the secret, passes the challenge, then sends ``hello``."""
    sock = socket.create_connection((address, port), timeout=10)
    _challenge_then_hello(sock, secret, hello)
    return sock


def _challenge_then_hello(sock: socket.socket, secret: bytes, hello: bytes) -> None:
    try:
        auth.connect_handshake(sock, secret)
        tcp.send_frame_blocking(sock, _HELLO_KIND, hello)
    except OSError:
        pass  # the test checks what the acceptor did, not what this client saw


@pytest.fixture
def opened() -> Iterator[list[socket.socket]]:
    """Sockets a test opens; closed when it ends, whatever happens."""
    socks: list[socket.socket] = []
    yield socks
    for sock in socks:
        sock.close()


def _run_attacked(
    monkeypatch: pytest.MonkeyPatch, attack: Callable[[str, int], None], secret: bytes | None = None
) -> float:
    """Runs ``_job`` on 3 ranks; ``attack(address, port)`` runs on ranks 0 and 1's mesh ports
    before any rank connects to another.

    Returns:
        Seconds from the end of the attack until every rank had finished its allreduce.
    """
    gate = _hold_mesh_key(monkeypatch, "mesh/0/2")
    released: list[float] = []

    def during(server: RendezvousServer) -> None:
        try:
            for address, port in _mesh_ports(server, range(2)).values():
                attack(address, port)
        finally:
            released.append(time.time())
            gate.set()

    results = run_ranks(3, _job, during=during, secret=secret)
    assert [total for total, _ in results] == [3.0, 3.0, 3.0]
    return max(done for _, done in results) - released[0]


@pytest.mark.ranks
@pytest.mark.timeout(120)
@pytest.mark.parametrize("idle", [1, 20])
def test_idle_connections_during_start_do_not_delay_the_job(
    idle: int, opened: list[socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Silent connections to ranks 0 and 1 while the job forms: it starts at once."""

    def open_idle(address: str, port: int) -> None:
        for _ in range(idle):
            opened.append(socket.create_connection((address, port), timeout=10))

    elapsed = _run_attacked(monkeypatch, open_idle)
    assert elapsed < _PROMPT, f"the start with {idle} idle connection(s) per rank took {elapsed:.2f} s"


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_stalled_and_lying_peers_during_start_do_not_delay_the_job(
    opened: list[socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half a challenge answer, garbage, and peers with the secret that name the wrong
    generation, kind or rank: all dropped, and the job starts at once."""
    secret = auth.new_secret()

    def attack(address: str, port: int) -> None:
        opened.append(socket.create_connection((address, port), timeout=10))
        opened.append(_half_answer(address, port))
        garbage = socket.create_connection((address, port), timeout=10)
        garbage.sendall(b"\x00" * 10)  # too short to fail the magic check: it stalls too
        opened.append(garbage)
        for hello in (_HELLO.pack(DATA, 2, 3, 7), _HELLO.pack(9, 2, 3, 0), _HELLO.pack(DATA, 99, 3, 0)):
            # Connected now, in the listener's queue before any real rank; the rank answers
            # the challenge only once it accepts, so the rest runs in a thread.
            liar = socket.create_connection((address, port), timeout=10)
            opened.append(liar)
            threading.Thread(target=_challenge_then_hello, args=(liar, secret, hello), daemon=True).start()

    elapsed = _run_attacked(monkeypatch, attack, secret)
    assert elapsed < _PROMPT, f"the start took {elapsed:.2f} s"


@pytest.mark.timeout(60)
def test_mesh_forms_around_a_silent_connection_in_process(caplog: pytest.LogCaptureFixture) -> None:
    """Two ranks in threads; a silent connection and a stalled answer reach rank 0 first."""
    secret = auth.new_secret()
    server = RendezvousServer(secret).start()
    meshes: dict[int, object] = {}
    errors: list[BaseException] = []
    socks: list[socket.socket] = []
    times: dict[int, float] = {}

    def rank(r: int) -> None:
        try:
            with RendezvousClient("127.0.0.1", server.port, secret, 5) as client:
                if r == 1:
                    client.wait([_GO], 20)
                start = time.monotonic()
                meshes[r] = build_mesh(r, 2, "host", secret, client, 0, 20, "127.0.0.1")
                times[r] = time.monotonic() - start
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    try:
        with caplog.at_level(logging.WARNING, logger="hora.transport"):
            for t in threads:
                t.start()
            address, port = _mesh_ports(server, range(1))[0]
            socks.append(socket.create_connection((address, port), timeout=10))
            socks.append(_half_answer(address, port))
            server.put(_GO, b"1")
            for t in threads:
                t.join(40)
    finally:
        for sock in socks:
            sock.close()
        server.stop()
    assert not errors, errors
    assert sorted(meshes) == [0, 1]
    assert times[1] < _PROMPT, f"rank 1's mesh took {times[1]:.2f} s"
    for mesh in meshes.values():
        mesh.close()  # type: ignore[attr-defined]


class _Listener:
    """A listener and an ``Acceptor`` running on it in a thread, for the unit tests."""

    def __init__(self, expected: set[tuple[int, int]], timeout: float = 30.0, **options: Any) -> None:
        self.secret = auth.new_secret()
        self.sock = tcp.listen("127.0.0.1")
        self.address, self.port = self.sock.getsockname()[:2]
        self.acceptor = Acceptor(self.sock, self.secret, size=3, generation=0, expected=expected, **options)
        self.result: list[tuple[int, int, socket.socket]] | BaseException | None = None
        self._timeout = timeout
        self._thread = threading.Thread(target=self._run)

    def start(self) -> _Listener:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.result = self.acceptor.run(time.monotonic() + self._timeout)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            self.result = exc

    def join(self) -> list[tuple[int, int, socket.socket]] | BaseException | None:
        self._thread.join(self._timeout + 10)
        assert not self._thread.is_alive()
        self.sock.close()
        return self.result

    def connect(self, kind: int, rank: int) -> socket.socket:
        """A real peer: the challenge, then its hello."""
        return _lying_hello(self.address, self.port, self.secret, _HELLO.pack(kind, rank, 3, 0))


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Waits up to ``timeout`` for the other end to close ``sock``."""
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except (BlockingIOError, TimeoutError, socket.timeout):
        return False
    except ConnectionError:
        return True


@pytest.mark.timeout(60)
def test_acceptor_drops_a_stalled_connection_at_its_deadline_while_others_complete(
    caplog: pytest.LogCaptureFixture,
) -> None:
    listener = _Listener({(DATA, 1), (CONTROL, 1)}, handshake_timeout=3.0)
    socks: list[socket.socket] = []
    with caplog.at_level(logging.WARNING, logger="hora.transport"):
        listener.start()
        try:
            stalled = _half_answer(listener.address, listener.port)
            socks.append(stalled)
            # While the stalled one waits for its deadline, a real peer gets through.
            socks.append(listener.connect(DATA, 1))
            assert not _closed_by_peer(stalled, 0.0), "dropped before its deadline"
            assert _closed_by_peer(stalled, 20), "never dropped"
            socks.append(listener.connect(CONTROL, 1))
            result = listener.join()
        finally:
            for sock in socks:
                sock.close()
    assert isinstance(result, list), result
    assert sorted((kind, peer) for kind, peer, _ in result) == [(DATA, 1), (CONTROL, 1)]
    for _, _, sock in result:
        assert sock.getblocking()
        sock.close()
    assert listener.acceptor.rejected == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("rejected a connection" in m and "within 3 s" in m for m in messages), messages


@pytest.mark.timeout(60)
def test_acceptor_drops_wrong_hellos_without_touching_the_others(caplog: pytest.LogCaptureFixture) -> None:
    listener = _Listener({(DATA, 2)})
    socks: list[socket.socket] = []
    with caplog.at_level(logging.WARNING, logger="hora.transport"):
        listener.start()
        try:
            socks.append(socket.create_connection((listener.address, listener.port)))  # silent
            socks.append(_half_answer(listener.address, listener.port))
            lies = [
                _HELLO.pack(DATA, 2, 3, 1),  # another generation
                _HELLO.pack(DATA, 2, 4, 0),  # another job size
                _HELLO.pack(CONTROL, 2, 3, 0),  # a kind not expected here
                _HELLO.pack(DATA, 1, 3, 0),  # a rank not expected here
            ]
            for hello in lies:
                lie = _lying_hello(listener.address, listener.port, listener.secret, hello)
                socks.append(lie)
                assert _closed_by_peer(lie, 20)
            wrong_frame = socket.create_connection((listener.address, listener.port))
            auth.connect_handshake(wrong_frame, listener.secret)
            tcp.send_frame_blocking(wrong_frame, _HELLO_KIND, b"x" * 1000)
            socks.append(wrong_frame)
            assert _closed_by_peer(wrong_frame, 20)
            socks.append(listener.connect(DATA, 2))
            result = listener.join()
        finally:
            for sock in socks:
                sock.close()
    assert isinstance(result, list), result
    assert [(kind, peer) for kind, peer, _ in result] == [(DATA, 2)]
    result[0][2].close()
    messages = [r.getMessage() for r in caplog.records if "rejected a connection" in r.getMessage()]
    assert sum("unexpected hello" in m for m in messages) == 4, messages
    assert sum("exceeds the limit" in m for m in messages) == 1, messages
    # The silent and the stalled connections are dropped, and logged, when the mesh is complete.
    assert listener.acceptor.rejected == 7, messages


@pytest.mark.timeout(60)
def test_acceptor_bounds_pending_connections_under_a_flood(caplog: pytest.LogCaptureFixture) -> None:
    """More silent connections than the bound: the oldest are dropped, the real peer gets in."""
    listener = _Listener({(DATA, 1)}, spare=4)
    socks: list[socket.socket] = []
    with caplog.at_level(logging.WARNING, logger="hora.transport"):
        listener.start()
        try:
            for _ in range(30):
                socks.append(socket.create_connection((listener.address, listener.port)))
            socks.append(listener.connect(DATA, 1))
            result = listener.join()
        finally:
            for sock in socks:
                sock.close()
    assert isinstance(result, list), result
    assert [(kind, peer) for kind, peer, _ in result] == [(DATA, 1)]
    result[0][2].close()
    assert listener.acceptor.peak_pending <= 1 + 4
    messages = [r.getMessage() for r in caplog.records if "rejected a connection" in r.getMessage()]
    assert sum("waiting for the handshake" in m for m in messages) >= 30 - 5, messages


@pytest.mark.timeout(60)
def test_acceptor_start_timeout_names_the_missing_ranks() -> None:
    listener = _Listener({(DATA, 1), (DATA, 2), (CONTROL, 2)}, timeout=1.0)
    listener.start()
    idle = socket.create_connection((listener.address, listener.port))
    try:
        real = listener.connect(DATA, 1)
        result = listener.join()
    finally:
        idle.close()
    real.close()
    assert isinstance(result, HoraInternalError), result
    assert "rank(s) 2 never connected within the start timeout" in str(result)


def test_challenge_without_io_matches_the_blocking_handshake() -> None:
    """``auth.Challenge`` is the acceptor's side that ``accept_handshake`` runs."""
    secret = auth.new_secret()
    a, b = socket.socketpair()
    client = threading.Thread(target=auth.connect_handshake, args=(b, secret))
    client.start()
    challenge = auth.Challenge(secret)
    a.sendall(challenge.greeting())
    reply = b""
    while len(reply) < auth.REPLY_BYTES:
        reply += a.recv(auth.REPLY_BYTES - len(reply))
    a.sendall(challenge.answer(reply))
    client.join(10)
    assert not client.is_alive()
    with pytest.raises(AuthenticationError, match="does not hold this job's secret"):
        auth.Challenge(auth.new_secret()).answer(reply)
    with pytest.raises(AuthenticationError, match="bad magic"):
        challenge.answer(b"x" * auth.REPLY_BYTES)
    a.close()
    b.close()
