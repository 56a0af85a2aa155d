"""The rendezvous server against clients that misbehave after (or while) authenticating.

Each test starts its own ``RendezvousServer`` and talks to it over real sockets, with
hand-made frames where a well-behaved ``RendezvousClient`` would refuse to send them.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from hora.errors import AuthenticationError
from hora.transport import auth, tcp
from hora.transport import rendezvous as proto
from hora.transport.codec import Reader, Writer
from hora.transport.rendezvous import RendezvousClient
from hora.transport.rendezvous_server import RendezvousServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def secret() -> bytes:
    return auth.new_secret()


@pytest.fixture
def server(secret: bytes) -> Iterator[RendezvousServer]:
    server = RendezvousServer(secret, handshake_timeout=1.0, frame_timeout=0.5).start()
    try:
        yield server
    finally:
        server.stop()


def connect(server: RendezvousServer, secret: bytes | None = None) -> socket.socket:
    """An authenticated raw connection (unauthenticated when ``secret`` is None)."""
    sock = tcp.connect("127.0.0.1", server.port, 5)
    sock.settimeout(10)
    if secret is not None:
        auth.connect_handshake(sock, secret)
    return sock


def wait_request(timeout: float, keys: list[str]) -> bytes:
    request = Writer().f64(timeout)
    request.buffer += proto.encode_keys(keys).buffer
    return request.bytes()


def ask(sock: socket.socket, kind: int, payload: bytes) -> tuple[int, bytes]:
    tcp.send_frame_blocking(sock, kind, payload)
    return tcp.recv_frame_blocking(sock)


def closed_by_server(sock: socket.socket, within: float = 10.0) -> bool:
    """True when the server closes ``sock`` within ``within`` seconds (reading and dropping any bytes)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(1 << 16):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True
    return False


def wait_rejected(server: RendezvousServer, count: int, within: float = 10.0) -> int:
    deadline = time.monotonic() + within
    while server.rejected < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.rejected


@pytest.mark.parametrize("timeout", [math.inf, -math.inf, math.nan, -1.0])
def test_wait_timeout_out_of_range_is_answered_with_an_error(
    server: RendezvousServer, secret: bytes, timeout: float, caplog: pytest.LogCaptureFixture
) -> None:
    """Infinity once crashed the connection's thread (OverflowError); now every bad value is refused in words."""
    with caplog.at_level(logging.WARNING, logger="hora.transport"):
        sock = connect(server, secret)
        kind, payload = ask(sock, proto.WAIT, wait_request(timeout, ["never"]))
        assert kind == proto.ERROR
        message = Reader(payload).string()
        assert f"invalid wait timeout {timeout!r}" in message and "finite number of seconds >= 0" in message
        # The same connection, and the server, go on serving.
        assert ask(sock, proto.PUT, Writer().string("k").blob(b"v").bytes()) == (proto.OK, b"")
        with RendezvousClient("127.0.0.1", server.port, secret, 5) as client:
            assert client.wait(["k"], 1) == [b"v"]
        sock.close()
    assert server.rejected == 0
    assert any("refused a request" in record.getMessage() for record in caplog.records)


def test_huge_finite_wait_timeout_is_clamped_and_still_answered(server: RendezvousServer, secret: bytes) -> None:
    sock = connect(server, secret)
    sock.settimeout(30)
    tcp.send_frame_blocking(sock, proto.WAIT, wait_request(1e300, ["late"]))
    time.sleep(0.2)  # the server holds the WAIT (clamped to MAX_WAIT, not an overflow)
    server.put("late", b"here")
    kind, payload = tcp.recv_frame_blocking(sock)
    assert kind == proto.VALUES
    reader = Reader(payload)
    assert [reader.blob() for _ in range(reader.count())] == [b"here"]
    sock.close()


def test_client_clamps_infinite_waits_and_refuses_bad_ones(server: RendezvousServer, secret: bytes) -> None:
    with RendezvousClient("127.0.0.1", server.port, secret, 5) as client:
        client.put("k", b"v")
        assert client.wait(["k"], math.inf) == [b"v"]
        for bad in (math.nan, -1.0):
            with pytest.raises(ValueError, match="invalid rendezvous wait timeout"):
                client.wait(["k"], bad)
        with pytest.raises(ValueError, match="values to 1048576"):
            client.put("big", b"x" * ((1 << 20) + 1))
        with pytest.raises(ValueError, match="keys are limited to 4096 bytes"):
            client.put("k" * 4097, b"")
        assert client.wait(["k"], 0) == [b"v"]  # the connection is still good


@pytest.mark.parametrize(
    ("kind", "length", "reason"),
    [
        (proto.PUT, 16 * 1024 * 1024, "a PUT request of 16777216 bytes exceeds the limit"),
        (proto.WAIT, (4 << 20) + 1, f"a WAIT request of {(4 << 20) + 1} bytes exceeds the limit"),
        (99, 10, "unknown request kind 99"),
    ],
)
def test_a_frame_too_large_for_its_kind_is_refused_before_its_payload(
    server: RendezvousServer, secret: bytes, kind: int, length: int, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="hora.transport"):
        sock = connect(server, secret)
        sock.sendall(tcp.FRAME_HEADER.pack(length, kind) + b"\x00" * 100)
        assert closed_by_server(sock)  # at once, not after a timeout: the header decides
        assert wait_rejected(server, 1) == 1
        sock.close()
    assert any(reason in record.getMessage() for record in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("sent", [2, tcp.FRAME_HEADER.size + 10])
def test_a_client_idle_in_the_middle_of_a_frame_is_dropped(
    server: RendezvousServer, secret: bytes, sent: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Half a header, or a header and part of the payload, then silence: dropped after frame_timeout (0.5 s)."""
    frame = tcp.encode_frame(proto.PUT, Writer().string("k").blob(b"v" * 100).bytes())
    with caplog.at_level(logging.WARNING, logger="hora.transport"):
        sock = connect(server, secret)
        sock.sendall(frame[:sent])
        started = time.monotonic()
        assert closed_by_server(sock, within=20)
        assert time.monotonic() - started >= 0.4
        assert wait_rejected(server, 1) == 1
        sock.close()
    assert any("then nothing for 0.5 s" in record.getMessage() for record in caplog.records)
    assert server.get("k") is None


def test_idle_between_frames_and_long_waits_are_never_timed_out(server: RendezvousServer, secret: bytes) -> None:
    """frame_timeout is 0.5 s; a client idle between requests, and a WAIT held 1.5 s, are served."""
    with RendezvousClient("127.0.0.1", server.port, secret, 5) as client:
        client.put("a", b"1")
        time.sleep(1.5)
        client.put("b", b"2")
        timer = threading.Timer(1.5, server.put, args=("c", b"3"))
        timer.start()
        try:
            assert client.wait(["a", "b", "c"], 30) == [b"1", b"2", b"3"]
        finally:
            timer.cancel()
    assert server.rejected == 0


def test_the_handshake_has_one_deadline_however_slowly_the_peer_drips(
    server: RendezvousServer, secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """One byte every 0.2 s keeps every read under the per-read timeout; the whole still ends at 1 s."""
    with caplog.at_level(logging.WARNING, logger="hora.transport"):
        sock = connect(server)
        sock.recv(len(auth.MAGIC) + auth.NONCE_BYTES)
        started = time.monotonic()
        dropped = False
        for _ in range(100):  # 72 bytes would complete it; the deadline comes first
            try:
                sock.sendall(b"H")
            except OSError:
                dropped = True
                break
            time.sleep(0.2)
            if closed_by_server(sock, within=0.01):
                dropped = True
                break
        assert dropped
        assert time.monotonic() - started < 5
        assert wait_rejected(server, 1) == 1
        sock.close()
    assert any("did not complete the handshake within 1 s" in r.getMessage() for r in caplog.records)
    with RendezvousClient("127.0.0.1", server.port, secret, 5) as client:  # others still get in
        client.put("k", b"v")


def test_a_silent_peer_is_dropped_at_the_handshake_deadline(server: RendezvousServer) -> None:
    sock = connect(server)
    assert closed_by_server(sock, within=20)
    assert wait_rejected(server, 1) == 1
    sock.close()
    with pytest.raises(AuthenticationError):
        RendezvousClient("127.0.0.1", server.port, auth.new_secret(), 5)


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident set size from /proc")
def test_announced_but_unsent_payloads_cost_no_memory(secret: bytes) -> None:
    """40 clients announce a ~1 MiB PUT (within the limit), send 100 bytes and idle: the
    server must not hold 40 MiB of buffers for bytes that never came."""
    server = RendezvousServer(secret).start()
    socks: list[socket.socket] = []
    try:
        with RendezvousClient("127.0.0.1", server.port, secret, 5) as warm:
            warm.put("warm", b"up")
        before = _rss_bytes()
        announce = 1_000_000
        for _ in range(40):
            sock = connect(server, secret)
            sock.sendall(struct.pack("<IB", announce, proto.PUT) + b"\x00" * 100)
            socks.append(sock)
        time.sleep(1.0)  # the old server had allocated every buffer within milliseconds
        growth = _rss_bytes() - before
        assert growth < 16 * 1024 * 1024, f"the server's process grew by {growth / 2**20:.1f} MiB"
        assert server.rejected == 0
    finally:
        for sock in socks:
            sock.close()
        server.stop()
