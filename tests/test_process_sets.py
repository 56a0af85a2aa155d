"""Process sets: given at init, overlapping, added and removed at runtime."""

from __future__ import annotations

import numpy as np
import pytest

from harness import run_ranks

pytestmark = pytest.mark.ranks


def overlapping_job() -> dict:
    import hora.numpy as hvd

    sets = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 2]), hvd.ProcessSet([2, 0])]
    hvd.init(process_sets=sets)
    me = hvd.rank()
    out: dict = {"ids": [s.process_set_id for s in sets], "sizes": [s.size() for s in sets]}
    out["ranks"] = [s.rank() for s in sets]
    out["included"] = [s.included() for s in sets]
    # Every set this rank belongs to runs collectives at once, submitted in a rank-specific order.
    mine = [s for s in sets if s.included()]
    if me % 2:
        mine.reverse()
    handles = [
        (s, hvd.allreduce_async(np.full(3, float(me + 1)), name="x", op=hvd.Sum, process_set=s)) for s in mine
    ]
    out["sums"] = {s.process_set_id: hvd.synchronize(h).tolist() for s, h in handles}
    gathered = {}
    for s in sets:
        if s.included():
            gathered[s.process_set_id] = hvd.allgather(np.array([me]), name="who", process_set=s).tolist()
            root = s.ranks[1]  # a global rank, as in Horovod
            gathered[(s.process_set_id, "b")] = hvd.broadcast(np.array([me]), root_rank=root, process_set=s).tolist()
    out["gathered"] = gathered
    outsider = next(s for s in sets if not s.included())
    try:
        hvd.allreduce(np.ones(1), process_set=outsider)
        out["outsider"] = "no error"
    except ValueError as exc:
        out["outsider"] = str(exc)
    hvd.shutdown()
    return out


@pytest.mark.timeout(90)
def test_overlapping_sets_given_at_init():
    results = run_ranks(3, overlapping_job)
    members = {1: [0, 1], 2: [1, 2], 3: [0, 2]}
    for me, out in enumerate(results):
        assert out["ids"] == [1, 2, 3] and out["sizes"] == [2, 2, 2]
        assert out["included"] == [me in members[i] for i in (1, 2, 3)]
        assert out["ranks"] == [members[i].index(me) if me in members[i] else None for i in (1, 2, 3)]
        for set_id, total in out["sums"].items():
            assert total == [float(sum(r + 1 for r in members[set_id]))] * 3
        for set_id in (1, 2, 3):
            if me in members[set_id]:
                assert out["gathered"][set_id] == members[set_id]
                assert out["gathered"][(set_id, "b")] == [members[set_id][1]]
        assert "is not a member of process set" in out["outsider"]


def dynamic_job() -> dict:
    import hora.numpy as hvd

    hvd.init(process_sets="dynamic")
    me, n = hvd.rank(), hvd.size()
    out: dict = {}
    evens = hvd.add_process_set([r for r in range(n) if r % 2 == 0])
    odds = hvd.add_process_set(hvd.ProcessSet([r for r in range(n) if r % 2 == 1]))
    out["ids"] = (evens.process_set_id, odds.process_set_id)
    out["str"] = str(odds)
    mine = evens if me % 2 == 0 else odds
    out["sum"] = hvd.allreduce(np.array([me]), op=hvd.Sum, process_set=mine).tolist()
    out["rs"] = hvd.reducescatter(np.ones((4, 1)), op=hvd.Sum, process_set=mine).tolist()
    try:
        hvd.add_process_set([r for r in range(n) if r % 2 == 0])
        out["dup"] = "no error"
    except ValueError as exc:
        out["dup"] = str(exc)
    out["removed"] = hvd.remove_process_set(evens)
    out["after_remove"] = (evens.process_set_id, evens.size())
    try:
        hvd.allreduce(np.ones(1), process_set=evens)
        out["use_removed"] = "no error"
    except ValueError as exc:
        out["use_removed"] = str(exc)
    again = hvd.add_process_set([r for r in range(n) if r % 2 == 0])
    out["again"] = again.process_set_id
    out["global"] = hvd.allreduce(np.array([1]), op=hvd.Sum).tolist()
    hvd.shutdown()
    return out


@pytest.mark.timeout(90)
def test_dynamic_add_and_remove():
    results = run_ranks(4, dynamic_job)
    for me, out in enumerate(results):
        assert out["ids"] == (1, 2)
        assert out["str"] == "ProcessSet(process_set_id=2, ranks=[1, 3], mpi_comm=None)"  # Horovod's
        assert out["sum"] == ([0 + 2] if me % 2 == 0 else [1 + 3])
        assert out["rs"] == [[2.0], [2.0]]
        assert "Attempted to add a duplicate process set" in out["dup"]
        assert out["removed"] is True and out["after_remove"] == (None, None)
        assert "is not registered with the running job" in out["use_removed"]
        assert out["again"] == 3
        assert out["global"] == [4]


def shutdown_during_add_job() -> dict:
    import threading
    import time

    import hora.numpy as hvd

    hvd.init(process_sets="dynamic")
    if hvd.rank() == 0:
        time.sleep(8.0)  # never adds the set: rank 1's add waits (its engine serves rank 1 meanwhile)
        hvd.shutdown()
        return {}
    outcome: list[str] = []

    def add() -> None:
        try:
            hvd.add_process_set([0, 1])
            outcome.append("added")
        except Exception as exc:  # noqa: BLE001 - the kind is what the test checks
            outcome.append(type(exc).__name__)

    thread = threading.Thread(target=add)
    thread.start()
    time.sleep(0.5)
    start = time.monotonic()
    hvd.shutdown()  # must not wait behind the add, which holds no lock while it waits
    took = time.monotonic() - start
    thread.join(10)
    return {"took": took, "outcome": outcome, "alive": thread.is_alive()}


@pytest.mark.timeout(60)
def test_shutdown_from_another_thread_does_not_wait_behind_a_process_set_change():
    result = run_ranks(2, shutdown_during_add_job, timeout=40)[1]
    assert result["took"] < 5.0, result
    assert result["outcome"] == ["HoraInternalError"] and not result["alive"], result


def global_root_job() -> dict:
    import hora.numpy as hvd

    n = int(__import__("os").environ["HORA_SIZE"])
    evens, odds = hvd.ProcessSet(range(0, n, 2)), hvd.ProcessSet(range(1, n, 2))
    hvd.init(process_sets=[evens, odds])
    me = hvd.rank()
    mine = evens if me % 2 == 0 else odds
    root = mine.ranks[-1]  # each set's last member, named by its global rank
    out = {
        "tensor": hvd.broadcast(np.array([me]), root_rank=root, process_set=mine).tolist(),
        "object": hvd.broadcast_object({"from": me}, root_rank=root, process_set=mine),
    }
    outsider = (me + 1) % n  # a rank of the other set
    try:
        hvd.broadcast(np.array([me]), root_rank=outsider, process_set=mine, name="bad")
        out["outsider"] = "no error"
    except ValueError as exc:
        out["outsider"] = str(exc)
    hvd.shutdown()
    return out


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.timeout(60)
def test_root_rank_is_a_global_rank_inside_process_sets(size):
    for me, out in enumerate(run_ranks(size, global_root_job)):
        members = [r for r in range(size) if r % 2 == me % 2]
        assert out["tensor"] == [members[-1]] and out["object"] == {"from": members[-1]}, out
        assert f"root_rank {(me + 1) % size} is not a rank of the process set" in out["outsider"], out
