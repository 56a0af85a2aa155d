"""A rank killed while the others move data: every survivor raises, naming it, and nobody hangs.

The ranks start the way torchrun or an operator starts them (no horarun, so nothing
stops a survivor but hora itself). The victim arms a SIGKILL at a precise point of
the data plane (the k-th shared-memory barrier, TCP exchange or ring send of a large
collective, right after a fast-lane proposal, right after announcing a tensor), so
each case lands in the phase it names rather than wherever a timer happens to fall.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from typing import Any

import numpy as np
import pytest

from harness import freeze, run_ranks

pytestmark = pytest.mark.ranks

MiB = 1 << 20


def arm_kill(owner: Any, attribute: str, after: int, when: str = "before", then: Any = None) -> None:
    """Makes this process SIGKILL itself at the ``after``-th call of ``owner.attribute``
    (``when="after"``: once that call has returned); ``then``, when given, runs instead
    of the kill."""
    original = getattr(owner, attribute)
    calls = itertools.count(1)
    act = then or (lambda: os.kill(os.getpid(), signal.SIGKILL))

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when == "before" and next(calls) == after:
            act()
        result = original(*args, **kwargs)
        if when == "after" and result is not False and next(calls) == after:
            act()
        return result

    setattr(owner, attribute, wrapper)


def _point(name: str) -> tuple[Any, str, str]:
    from hora.engine.control import ControlPlane
    from hora.engine.fast_lane import FastLane
    from hora.transport import shm, tcp

    return {
        "shm barrier": (shm.Domain, "barrier", "before"),
        "tcp exchange": (tcp, "exchange", "before"),
        "ring send": (tcp.RingLinks, "send", "before"),
        "lane proposal": (FastLane, "propose", "after"),
        "announce": (ControlPlane, "announce", "after"),
    }[name]


def data_phase_job(op: str, nbytes: int, victim: int, point: str, after: int, frozen: float | None = None) -> str:
    import hora.numpy as hvd

    hvd.init()
    size = hvd.size()
    count = max(1, nbytes // 4)
    data = np.ones(count - count % size if op in ("alltoall", "reducescatter") else count, np.float32)
    group = [np.ones(count // 16, np.float32) for _ in range(16)]

    def step() -> None:
        if op == "allreduce":
            hvd.allreduce_(data, name="x")
        elif op == "allgather":
            hvd.allgather(data, name="x")
        elif op == "broadcast":
            hvd.broadcast_(data, root_rank=size - 1, name="x")
        elif op == "alltoall":
            hvd.alltoall(data, name="x")
        elif op == "reducescatter":
            hvd.reducescatter(data, name="x")
        elif op == "grouped":
            hvd.grouped_allreduce_(group, name="x")
        else:
            raise AssertionError(op)

    start = time.monotonic()
    try:
        for _ in range(3):  # warm up: connections, segments, the response cache
            step()
        # Armed once its own warm-up is done: a survivor may still be finishing its last
        # warm-up step then (a fast-lane step ends on each rank once it has read the
        # others' entries), so it may meet the loss there.
        if hvd.rank() == victim:
            owner, attribute, when = _point(point)
            arm_kill(owner, attribute, after, when, None if frozen is None else lambda: freeze(frozen))
        for _ in range(20 if frozen is None else 3):
            step()
    except hvd.HoraInternalError as exc:
        return f"{time.monotonic() - start:.3f}\n{exc}"
    if op == "allreduce":  # the last of six in-place Average allreduces of ones
        assert np.all(data == 1.0), data[:4]
    return "no error"


CASES = [
    # op, bytes, transport, ranks, victim, kill point, at the k-th call
    ("allreduce", 64 * MiB, "shm", 3, 1, "shm barrier", 7),
    ("allreduce", 64 * MiB, "tcp", 3, 2, "ring send", 20),
    ("allreduce", 512 << 10, "shm", 2, 1, "shm barrier", 1),  # past the fast lane's data limit
    ("allreduce", 256 << 10, "tcp", 4, 0, "tcp exchange", 2),
    ("allreduce", 16 << 10, "tcp", 3, 1, "tcp exchange", 2),  # recursive doubling, rank 1 folded into 0
    ("allreduce", 16 << 10, "tcp", 4, 2, "tcp exchange", 3),  # recursive doubling, a power of two
    ("allgather", 16 * MiB, "shm", 3, 0, "shm barrier", 4),
    ("allgather", 16 * MiB, "tcp", 3, 1, "ring send", 20),  # the pipelined ring
    ("allgather", 1 * MiB, "tcp", 3, 1, "tcp exchange", 1),  # the ring, segment by segment
    ("broadcast", 64 * MiB, "shm", 3, 2, "shm barrier", 5),
    ("broadcast", 64 * MiB, "tcp", 2, 0, "tcp exchange", 1),
    ("broadcast", 16 * MiB, "tcp", 3, 0, "ring send", 10),  # the chain along the ring: rank 0 forwards
    ("broadcast", 256 << 10, "tcp", 4, 1, "ring send", 2),  # the chain from 256 KiB: root 3, then 0, 1 (forwards), 2
    ("broadcast", 64 << 10, "tcp", 4, 0, "tcp exchange", 2),  # the binomial tree: rank 0 forwarding to rank 2
    ("alltoall", 16 * MiB, "shm", 4, 3, "shm barrier", 2),
    ("alltoall", 16 * MiB, "tcp", 3, 1, "tcp exchange", 1),
    ("reducescatter", 16 * MiB, "shm", 3, 1, "shm barrier", 3),
    ("reducescatter", 16 * MiB, "tcp", 3, 0, "ring send", 10),  # the pipelined ring
    ("reducescatter", 2 * MiB, "tcp", 3, 2, "tcp exchange", 2),  # the ring, segment by segment
    ("grouped", 16 * MiB, "shm", 3, 2, "shm barrier", 3),
    ("grouped", 16 * MiB, "tcp", 2, 1, "ring send", 5),
    ("allreduce", 4, "shm", 3, 1, "lane proposal", 1),
    ("grouped", 1 * MiB, "shm", 3, 1, "lane proposal", 1),  # agreed by id: the others run its data phase
    ("allreduce", 1 * MiB, "shm", 2, 0, "lane proposal", 2),
    ("allreduce", 4, "shm", 3, 0, "announce", 1),
    ("allgather", 1 * MiB, "tcp", 3, 2, "announce", 1),
]


@pytest.mark.parametrize(
    "op, nbytes, transport, size, victim, point, after",
    CASES,
    ids=[f"{c[0]}-{c[1]}-{c[2]}-np{c[3]}-{c[5].replace(' ', '_')}" for c in CASES],
)
@pytest.mark.timeout(120)
def test_a_rank_killed_mid_collective_fails_every_survivor(op, nbytes, transport, size, victim, point, after):
    env = {"HORA_SHARED_MEMORY": "1" if transport == "shm" else "0"}
    results = run_ranks(
        size, data_phase_job, op, nbytes, victim, point, after, env=env, check=False, launcher="torchrun", timeout=90
    )
    check_survivors(results, victim)


def check_survivors(results: list, victim: int) -> None:
    """The victim was killed; every other rank raised soon, naming it, its host and its loss."""
    for result in results:
        if result.rank == victim:
            assert result.returncode == -signal.SIGKILL, result.output + (result.error or "")
            continue
        assert result.returncode == 0, result.output + (result.error or "")
        seconds, message = result.value.split("\n", 1)
        assert f"rank {victim}" in message and "was lost" in message and "on host" in message, message
        assert float(seconds) < 10.0, result.value


def hierarchical_job(victim: int, point: str, after: int) -> str:
    return data_phase_job("allreduce", 16 * MiB, victim, point, after)


@pytest.mark.parametrize("victim, point, after", [(1, "shm barrier", 3), (2, "ring send", 4)])
@pytest.mark.timeout(120)
def test_a_rank_killed_mid_hierarchical_allreduce_fails_every_survivor(victim, point, after):
    # Two emulated hosts of two ranks: shared memory within each, the TCP ring across.
    results = run_ranks(4, hierarchical_job, victim, point, after, hosts=["a", "a", "b", "b"], check=False, timeout=90)
    check_survivors(results, victim)


FREEZES = [
    ("allreduce", 64 * MiB, "shm", 3, 1, "shm barrier", 5),
    ("allgather", 16 * MiB, "tcp", 3, 2, "ring send", 5),
    # Mid-chain: the root and the last rank wait for it. 64 MiB, so that what the root still
    # has to send cannot all fit in the sockets' buffers (at 16 MiB it sometimes did: the root
    # then finished, went on to negotiate the next broadcast and waited on the frozen coordinator).
    ("broadcast", 64 * MiB, "tcp", 3, 0, "ring send", 5),
    # Mid-ring at 4 ranks: every rank downstream of the frozen one stops too, and would blame
    # its own neighbour; rank 0 pings every worker and names the one that does not answer.
    ("allreduce", 64 * MiB, "tcp", 4, 2, "ring send", 5),
    ("allreduce", 256 << 10, "tcp", 4, 1, "tcp exchange", 3),
    # Rank 0 frozen mid-ring: each worker asks rank 0 itself, and names it.
    ("allreduce", 64 * MiB, "tcp", 4, 0, "ring send", 5),
    # Frozen right after proposing a group by id on the fast lane: the others run its data phase.
    ("grouped", 1 * MiB, "shm", 3, 1, "lane proposal", 1),
]


@pytest.mark.parametrize(
    "op, nbytes, transport, size, victim, point, after",
    FREEZES,
    ids=["shm", "tcp", "chain", "ring", "ring-256K", "ring-rank-0", "lane-by-id"],
)
@pytest.mark.timeout(120)
def test_a_rank_frozen_mid_collective_is_reported_then_ends_the_job(op, nbytes, transport, size, victim, point, after):
    env = {
        "HORA_SHARED_MEMORY": "1" if transport == "shm" else "0",
        "HORA_STALL_CHECK_TIME_SECONDS": "1",
        "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3",
    }
    # Frozen for good (a helper kills it once the others are done).
    results = run_ranks(
        size, data_phase_job, op, nbytes, victim, point, after, -12.0, env=env, check=False, launcher="torchrun", timeout=90
    )
    for result in results:
        if result.rank == victim:
            continue
        assert result.returncode == 0, result.output + (result.error or "")
        seconds, message = result.value.split("\n", 1)
        # Named by the rank that waits for it, or by rank 0's probe.
        assert re.search(rf"rank\(s\) {victim}(, which stopped| stopped) making progress", message), message
        assert "shutting the job down after 3 s" in message, message
        assert 2.5 < float(seconds) < 15.0, result.value
    warnings = "".join(r.output for r in results if r.rank != victim)
    assert f"has waited 1 s in its data phase for rank(s) {victim}" in warnings, warnings


@pytest.mark.timeout(120)
def test_a_rank_frozen_for_less_than_the_check_time_completes_normally():
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "3", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "6"}
    results = run_ranks(
        3, data_phase_job, "allreduce", 16 * MiB, 1, "shm barrier", 3, 1.0, env=env, check=False, launcher="torchrun", timeout=90
    )
    for result in results:
        assert result.returncode == 0, result.output + (result.error or "")
        assert result.value == "no error", result.value
        assert "stopped making progress" not in result.output
