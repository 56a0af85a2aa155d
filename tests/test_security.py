"""Every connection must prove it holds the job secret; anything else is dropped and the job goes on."""

from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
import pytest

from harness import run_ranks
from hora.errors import AuthenticationError
from hora.runner.rendezvous import RendezvousServer
from hora.transport import auth
from hora.transport.mesh import build_mesh
from hora.transport.rendezvous import RendezvousClient


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    return a, b


def test_handshake_accepts_the_secret_and_rejects_others():
    secret = auth.new_secret()
    a, b = _pair()
    t = threading.Thread(target=auth.connect_handshake, args=(b, secret))
    t.start()
    auth.accept_handshake(a, secret)
    t.join()
    a, b = _pair()
    errors: list[Exception] = []

    def client() -> None:
        try:
            auth.connect_handshake(b, auth.new_secret())
        except AuthenticationError as exc:
            errors.append(exc)
        b.close()

    t = threading.Thread(target=client)
    t.start()
    with pytest.raises(AuthenticationError, match="does not hold this job's secret"):
        auth.accept_handshake(a, secret)
    a.close()
    t.join()
    assert errors  # the client learns it failed too


def test_handshake_times_out_on_a_silent_peer():
    a, b = _pair()
    with pytest.raises(AuthenticationError, match="within 0.2 s"):
        auth.accept_handshake(a, auth.new_secret(), timeout=0.2)


def test_rendezvous_drops_bad_clients_and_keeps_serving():
    secret = auth.new_secret()
    server = RendezvousServer(secret).start()
    try:
        with pytest.raises(AuthenticationError):
            RendezvousClient("127.0.0.1", server.port, auth.new_secret(), 2)
        rogue = socket.create_connection(("127.0.0.1", server.port))
        rogue.sendall(b"PUT /mesh/0/0 HTTP/1.1\r\n\r\n" * 20)
        rogue.close()
        good = RendezvousClient("127.0.0.1", server.port, secret, 2)
        good.put("k", b"v")
        assert good.wait(["k"], 1) == [b"v"]
        good.close()
        deadline = time.monotonic() + 5
        while server.rejected < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.rejected == 2
        assert server.get("k") == b"v"
    finally:
        server.stop()


def test_mesh_drops_rogue_connections_while_forming(caplog):
    """A garbage stream and a wrong secret reach rank 0's listener before rank 2 arrives."""
    secret = auth.new_secret()
    server = RendezvousServer(secret).start()
    meshes: dict[int, object] = {}

    def rank(r: int) -> None:
        with RendezvousClient("127.0.0.1", server.port, secret, 5) as client:
            meshes[r] = build_mesh(r, 3, "host", secret, client, 0, 20, "127.0.0.1")

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    with caplog.at_level(logging.WARNING, logger="hora.transport"):
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while server.get("mesh/0/0") is None and time.monotonic() < deadline:
            time.sleep(0.01)
        _, address, port, _ = server.get("mesh/0/0").decode().split("\n")
        garbage = socket.create_connection((address, int(port)))
        garbage.sendall(b"\x00" * 200)  # queued before any real rank connects
        impostor_errors: list[Exception] = []

        def impostor() -> None:
            sock = socket.create_connection((address, int(port)))
            try:
                auth.connect_handshake(sock, auth.new_secret())
            except AuthenticationError as exc:
                impostor_errors.append(exc)
            sock.close()

        threads.append(threading.Thread(target=impostor))
        threads[-1].start()
        time.sleep(0.2)
        threads.append(threading.Thread(target=rank, args=(2,)))
        threads[-1].start()
        for t in threads:
            t.join(30)
        garbage.close()
    server.stop()
    assert sorted(meshes) == [0, 1, 2]
    assert sorted(meshes[0].data) == [1, 2] and sorted(meshes[0].control) == [1, 2]
    rejected = [r.getMessage() for r in caplog.records if "rejected a connection" in r.getMessage()]
    assert len(rejected) == 2, rejected
    assert impostor_errors
    for mesh in meshes.values():
        mesh.close()


def steady_job() -> float:
    import time

    import hora.numpy as hvd

    hvd.init()
    total = 0.0
    for i in range(40):
        total += float(hvd.allreduce(np.ones(4), op=hvd.Sum, name=f"s{i}")[0])
        time.sleep(0.02)
    hvd.shutdown()
    return total


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_attacks_on_the_rendezvous_during_a_job_change_nothing():
    def attack(server: RendezvousServer) -> None:
        for _ in range(5):
            try:
                RendezvousClient("127.0.0.1", server.port, auth.new_secret(), 1).close()
            except AuthenticationError:
                pass
            rogue = socket.create_connection(("127.0.0.1", server.port))
            rogue.sendall(bytes(range(256)) * 4)
            rogue.close()
            time.sleep(0.05)

    results = run_ranks(3, steady_job, during=attack)
    assert results == [120.0, 120.0, 120.0]


def test_a_rank_without_the_secret_cannot_join():
    """A rank started with the wrong secret fails at the rendezvous; it never sees the job."""
    from hora.errors import HoraInternalError
    import os

    secret = auth.new_secret()
    server = RendezvousServer(secret).start()
    try:
        env = {
            "HORA_RANK": "1", "HORA_SIZE": "2", "HORA_RENDEZVOUS_ADDR": "127.0.0.1",
            "HORA_RENDEZVOUS_PORT": str(server.port), "HORA_SECRET": auth.new_secret().hex(),
            "HORA_START_TIMEOUT": "2",
        }
        from hora.config import Config
        from hora.core.runtime import Runtime

        with pytest.raises(HoraInternalError, match="could not reach the rendezvous server"):
            Runtime(Config.from_env(env), 0)
        assert server.rejected == 1
    finally:
        server.stop()
