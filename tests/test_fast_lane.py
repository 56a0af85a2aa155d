"""The fast lane: cached small allreduces agreed through shared memory.

The protocol is driven by hand first (several ranks' lanes in one process, over real
shared segments), then used for real by ranks: results, falling back, mixed orders,
invalidation, join, shutdown, a killed rank, and a wait nobody drives.
"""

from __future__ import annotations

import os
import re
import secrets
import select
import signal
from collections.abc import Callable

import numpy as np
import pytest

from harness import run_ranks
from hora.collectives.reduce import DataType
from hora.config import Config
from hora.engine.fast_lane import MAX_IDS, FastLane
from hora.engine.handles import Handle
from hora.engine.messages import Request, RequestType
from hora.engine.queue import Entry
from hora.transport import shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared memory needs an x86-64 Linux machine")

@pytest.fixture
def lanes():
    """Makes the lanes of an n-rank job on this machine, all in this process."""
    made: list[shm.Domain] = []
    made_lanes: list[FastLane] = []

    def make(n: int) -> list[FastLane]:
        key = shm.job_key(secrets.token_bytes(16))
        domains = [shm.Domain(key, 0, range(n), rank, 4096) for rank in range(n)]
        made.extend(domains)
        for domain in domains:
            domain.attach()
        for domain in domains:
            domain.unlink()
        made_lanes.extend(FastLane(domain, Config()) for domain in domains)
        return made_lanes[-n:]

    yield make
    for lane in made_lanes:
        lane.close()
    for domain in made:
        domain.close()


def entry(values, name: str = "x", op: int = 1) -> Entry:
    """An allreduce entry of float32 ``values`` (op 1: Sum)."""
    data = np.asarray(values, dtype=np.float32)
    request = Request(0, RequestType.ALLREDUCE, f"allreduce.{name}", 0, int(DataType.FLOAT32), data.shape, op)
    return Entry(request, DataType.FLOAT32, data, np.empty_like(data), Handle(name))


def outcome(lane: FastLane) -> tuple[Entry, bool] | None:
    """``lane.settle()``'s result as (the proposal's first entry, whether it succeeded)."""
    settled = lane.settle()
    return None if settled is None else (settled[0].entry, settled[1])


def test_matching_proposals_give_every_rank_the_same_sum(lanes):
    a, b, c = lanes(3)
    entries = [entry([1.5, 2.0]), entry([10.0, 20.0]), entry([100.0, 200.0])]
    assert a.propose([entries[0]], [7], False)
    assert not a.settled() and a.settle() is None  # the others have not answered
    assert b.propose([entries[1]], [7], False)
    assert c.propose([entries[2]], [7], False)
    for lane, e in zip((a, b, c), entries):
        assert outcome(lane) == (e, True)
        assert e.output.tolist() == [111.5, 222.0]
        assert lane.pending is None


def test_rounds_reuse_the_two_slots_without_mixing_them(lanes):
    a, b = lanes(2)
    for step in range(7):
        x, y = entry([step]), entry([10.0 * step])
        assert a.propose([x], [3], False) and b.propose([y], [3], False)
        assert outcome(a) == (x, True) and outcome(b) == (y, True)
        assert x.output.tolist() == y.output.tolist() == [11.0 * step]


def test_different_tensors_fail_on_every_rank(lanes):
    a, b = lanes(2)
    x, y = entry([1.0]), entry([2.0])
    assert a.propose([x], [1], False) and b.propose([y], [2], False)
    assert outcome(a) == (x, False) and outcome(b) == (y, False)
    # The next entry is open to both again.
    x, y = entry([1.0]), entry([2.0])
    assert a.propose([x], [1], False) and b.propose([y], [1], False)
    assert outcome(a) == (x, True) and outcome(b) == (y, True)


def test_a_busy_rank_refuses_and_one_that_became_idle_answers(lanes):
    a, b = lanes(2)
    x = entry([1.0])
    assert a.propose([x], [1], False)
    b.serve(busy=True)  # b has a collective on the coordinator's path: it refuses
    assert outcome(a) == (x, False)
    x = entry([1.0])
    assert a.propose([x], [1], False)  # b is still flagged busy: a proposes all the same
    b.serve(busy=False)  # b's last collective finished before it looked: no refusal
    assert a.settle() is None
    y = entry([2.0])
    assert b.propose([y], [1], False)
    assert outcome(a) == (x, True) and outcome(b) == (y, True)
    assert x.output.tolist() == [3.0]


def test_a_rank_behind_catches_up_before_proposing(lanes):
    a, b, c = lanes(3)
    x = entry([1.0])
    assert a.propose([x], [1], False)
    b.serve(busy=True)
    b.serve(busy=False)
    assert outcome(a) == (x, False)
    # c wrote nothing yet: a cannot propose entry 2 until c has answered entry 1.
    assert not a.propose([entry([1.0])], [1], False)
    z = entry([4.0])
    assert c.propose([z], [1], False)  # refuses the doomed entry 1, proposes entry 2
    x, y = entry([1.0]), entry([2.0])
    assert a.propose([x], [1], False) and b.propose([y], [1], False)
    for lane, e in ((a, x), (b, y), (c, z)):
        assert outcome(lane) == (e, True) and e.output.tolist() == [7.0]


def test_a_rank_that_left_fails_what_waits_for_it(lanes):
    a, b = lanes(2)
    x = entry([1.0])
    assert a.propose([x], [1], False)
    b.leave()
    assert outcome(a) == (x, False)
    assert not a.propose([entry([1.0])], [1], False)


def test_a_waiting_rank_is_woken_by_the_entry_it_waits_for(lanes):
    a, b = lanes(2)
    x = entry([1.0])
    assert a.propose([x], [1], False)
    a.watch(caller=True, on=True)
    assert b.propose([entry([2.0])], [1], False)
    a.watch(caller=True, on=False)
    poller = select.poll()
    poller.register(a._domain.wake_fileno(), select.POLLIN)
    assert poller.poll(1000), "the writer did not wake the watching rank"
    assert outcome(a) == (x, True)


def test_only_lone_small_global_allreduces_ride_the_lane(lanes):
    lane = lanes(2)[0]
    assert lane.data_limit == 256 << 10 and lanes(8)[0].data_limit == 128 << 10  # reads <= 1 MiB
    assert lane.carries(entry([1.0] * 65536))
    assert not lane.carries(entry([1.0] * 65537))  # over 256 KiB
    grouped = entry([1.0])
    grouped.request.group = "g"
    assert not lane.carries(grouped)
    other_set = entry([1.0])
    other_set.request.process_set_id = 1
    assert not lane.carries(other_set)
    gather = entry([1.0])
    gather.request.type = RequestType.ALLGATHER
    assert not lane.carries(gather)


def grouped(sizes: list[int], name: str = "g") -> list[Entry]:
    """The entries of a grouped allreduce (Sum) of float32 tensors of these sizes."""
    entries = [entry([1.0] * n, f"{name}_{i}") for i, n in enumerate(sizes)]
    for e in entries:
        e.request.group, e.request.group_size = name, len(sizes)
    return entries


def test_by_id_proposals_that_name_the_same_ids_succeed_and_leave_the_data_to_the_executor(lanes):
    a, b, c = lanes(3)
    groups = [grouped([3, 5000, 1]) for _ in range(3)]
    for lane, entries in zip((a, b, c), groups):
        assert lane.propose(entries, [4, 9, 2], True)
    for lane, entries in zip((a, b, c), groups):
        proposal, succeeded = lane.settle()
        assert succeeded and proposal.entries == entries and proposal.count == 3
        assert [e.output.tolist() for e in entries] != [[3.0] * 3, [3.0] * 5000, [3.0]]  # not reduced here
        response = FastLane.response(proposal)
        assert response.names == ["allreduce.g_0", "allreduce.g_1", "allreduce.g_2"]
        assert response.sizes == [3, 5000, 1] and response.cache_ids == [4, 9, 2]
        assert response.process_set_id == 0 and response.reduce_op == entries[0].request.reduce_op
    assert a.succeeded == b.succeeded == c.succeeded == 1


@pytest.mark.parametrize(
    "theirs",
    [[4, 9, 3], [4, 9], [4, 9, 2, 5]],
    ids=["a later id differs", "fewer tensors", "more tensors"],
)
def test_by_id_proposals_that_differ_fail_on_every_rank(lanes, theirs):
    a, b = lanes(2)
    x, y = grouped([3, 5000, 1]), grouped([3, 5000, 1] + [1] * (len(theirs) - 3))[: len(theirs)]
    assert a.propose(x, [4, 9, 2], True) and b.propose(y, theirs, True)
    assert a.settle()[1] is False and b.settle()[1] is False


def test_a_by_id_proposal_never_matches_a_data_proposal(lanes):
    a, b = lanes(2)
    small = entry([1.0])
    assert a.propose([small], [6], False) and b.propose([entry([1.0] * 5000)], [6], True)
    assert outcome(a) == (small, False)
    assert b.settle()[1] is False


def test_a_busy_rank_refuses_by_id_proposals_before_a_response_and_leaves_data_proposals(lanes):
    a, b = lanes(2)
    x = entry([1.0])
    assert a.propose([x], [1], False)
    b.refuse_by_id()  # a data proposal: b may still answer it once idle
    assert a.settle() is None
    y = entry([2.0])
    assert b.propose([y], [1], False)
    assert outcome(a) == (x, True) and outcome(b) == (y, True)
    big = entry([1.0] * 5000)
    assert a.propose([big], [2], True)
    b.refuse_by_id()
    assert outcome(a) == (big, False)


def test_what_rides_the_lane_by_id(lanes):
    lane = lanes(2)[0]
    assert not lane.carries_by_id([entry([1.0] * 65536)])  # fits a slot: goes with its data
    assert lane.carries_by_id([entry([1.0] * 65537)])
    assert lane.carries_by_id(grouped([1, 1]))  # a whole group, however small
    assert not lane.carries_by_id(grouped([1, 1, 1])[:2])  # part of one
    assert not lane.carries_by_id([*grouped([1]), *grouped([1], "h")])
    mixed = grouped([1, 1])
    mixed[1].request.dtype = int(DataType.FLOAT64)
    assert not lane.carries_by_id(mixed)
    scaled = grouped([1, 1])
    scaled[0].request.postscale = 0.5
    assert not lane.carries_by_id(scaled)
    other_set = [entry([1.0] * 65537)]
    other_set[0].request.process_set_id = 1
    assert not lane.carries_by_id(other_set)
    gather = [entry([1.0] * 65537)]
    gather[0].request.type = RequestType.ALLGATHER
    assert not lane.carries_by_id(gather)
    assert not lane.carries_by_id(grouped([1] * (MAX_IDS + 1)))
    # Lone allreduces announced together (a burst of async calls) run fused, as the
    # coordinator would fuse them: alike, and no more than the fusion threshold.
    assert lane.carries_by_id([entry([1.0], "a"), entry([1.0] * 9, "b")])
    assert not lane.carries_by_id([entry([1.0], "a"), *grouped([1, 1])])
    averaged = [entry([1.0], "a"), entry([1.0], "b", op=0)]
    assert not lane.carries_by_id(averaged)


def test_a_batch_by_id_stays_within_the_fusion_threshold():
    key = shm.job_key(secrets.token_bytes(16))
    domain = shm.Domain(key, 0, range(1), 0, 4096)
    domain.attach()
    domain.unlink()
    lane = FastLane(domain, Config(fusion_threshold=64))
    try:
        assert lane.carries_by_id([entry([1.0] * 8, "a"), entry([1.0] * 8, "b")])  # 64 bytes
        assert not lane.carries_by_id([entry([1.0] * 8, "a"), entry([1.0] * 9, "b")])
    finally:
        lane.close()
        domain.close()


# ----- ranks -----


def _wait_until(condition: Callable[[], bool], seconds: float = 30.0) -> None:
    """Polls ``condition`` until it holds, or ``seconds`` pass (then the rank goes on, and
    the test's checks say what went wrong): a signal from another rank, or a fact of this
    rank's engine, which a busy machine may be slow to give."""
    import time

    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.002)


def _idle_barrier(flags: str, name: str) -> None:
    """Returns once every rank's engine is idle (``EngineStats.idle``): each waits for its
    own, says so in a flag file ``<name>-<rank>`` under ``flags``, and waits for every rank's."""
    import pathlib

    import hora.numpy as hvd
    from hora.core.api import current

    engine = current().engine
    _wait_until(lambda: engine.stats().idle)
    folder = pathlib.Path(flags)
    (folder / f"{name}-{hvd.rank()}").touch()
    _wait_until(lambda: all((folder / f"{name}-{rank}").exists() for rank in range(hvd.size())))


def lane_results_job(rounds: int, flags: str) -> list:
    import hora.numpy as hvd

    hvd.init()
    me, n = hvd.rank(), hvd.size()
    out = []
    cases = [
        (np.float32, hvd.Sum, (3,)),
        (np.float64, hvd.Average, (2, 2)),
        (np.int32, hvd.Max, (5,)),
        (np.int64, hvd.Min, ()),
        (np.float16, hvd.Sum, (4,)),
        (np.float32, hvd.Product, (2,)),
    ]
    for step in range(rounds):
        for index, (dtype, op, shape) in enumerate(cases):
            value = np.full(shape, me + 1 + step, dtype=dtype)
            out.append(hvd.allreduce(value, op=op, name=f"case{index}", prescale_factor=1.0).tolist())
        big = hvd.allreduce(np.full(8192, me, dtype=np.float32), op=hvd.Sum, name="big")  # 32 KiB: coordinator's path
        out.append(float(big[0]))
        # Quiet moments: every rank is idle (not busy on the lane) when the next step
        # starts, so its first allreduce rides the lane on every rank alike.
        _idle_barrier(flags, f"step{step}")
    from hora.core.api import current

    succeeded = current().engine.stats().lane_succeeded
    hvd.shutdown()
    return [out, succeeded]


@pytest.mark.ranks
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.timeout(120)
def test_results_are_exact_whichever_path_a_step_takes(size, tmp_path):
    rounds = 6
    results = run_ranks(size, lane_results_job, rounds, str(tmp_path), timeout=100)
    outs = [r[0] for r in results]
    assert all(out == outs[0] for out in outs)  # every rank got the same bits
    total = lambda step: sum(r + 1 + step for r in range(size))  # noqa: E731
    for step in range(rounds):
        row = outs[0][step * 7 : step * 7 + 7]
        assert row[0] == [total(step)] * 3
        assert row[1] == [[total(step) / size] * 2] * 2
        assert row[2] == [size + step] * 5
        assert row[3] == 1 + step
        assert row[4] == [total(step)] * 4
        product = float(np.prod([np.float32(r + 1 + step) for r in range(size)]))
        assert row[5] == [product] * 2
        assert row[6] == sum(range(size))
    if size > 1:
        # Cached, small, quiet: the lane carried some of these (the first of every step but
        # the first; how many more depends on timing).
        assert all(r[1] > 0 for r in results), [r[1] for r in results]


def by_id_job(rounds: int, flags: str) -> list:
    import hora.numpy as hvd
    from hora.core.api import current

    hvd.init()
    me = hvd.rank()
    out = []
    for step in range(rounds):
        # A group of small and large tensors (Average), then a lone 1.2 MB one (Sum):
        # after the first step both are cached, and each step starts with every rank idle.
        group = [np.full(n, me + step, dtype=np.float64) for n in (3, 5000, 1)]
        out.append([g.tolist() for g in hvd.grouped_allreduce(group, op=hvd.Average, name="g")])
        lone = hvd.allreduce(np.full(300000, me * step, dtype=np.float32), op=hvd.Sum, name="lone")
        out.append([float(lone.min()), float(lone.max())])
        _idle_barrier(flags, f"step{step}")
    succeeded = current().engine.stats().lane_succeeded
    hvd.shutdown()
    return [out, succeeded]


@pytest.mark.ranks
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.timeout(120)
def test_groups_and_large_tensors_agreed_by_id_run_the_data_phase_alike_everywhere(size, tmp_path):
    rounds = 6
    results = run_ranks(size, by_id_job, rounds, str(tmp_path), timeout=100)
    for step in range(rounds):
        mean = sum(r + step for r in range(size)) / size
        group, lone = results[0][0][2 * step : 2 * step + 2]
        assert group == [[mean] * 3, [mean] * 5000, [mean]]
        assert lone == [float(step * sum(range(size)))] * 2
    assert all(r[0] == results[0][0] for r in results)
    assert all(r[1] > 0 for r in results), [r[1] for r in results]


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_with_fusion_off_groups_go_the_coordinators_way_and_lone_tensors_still_by_id(tmp_path):
    # Unfused, a group's tensors run one by one at the coordinator; on the lane they would run fused.
    results = run_ranks(2, by_id_job, 4, str(tmp_path), env={"HORA_FUSION_THRESHOLD": "0"}, timeout=100)
    assert results[0][0] == results[1][0]
    assert results[0][0][-2:] == [[[3.5] * 3, [3.5] * 5000, [3.5]], [3.0, 3.0]]
    # The lone 1.2 MB tensors of steps 1-3 at most (step 0 negotiates them), never the groups.
    # Possibly none: a rank still running its group's last response (a small tensor computed
    # by the coordinator, no data phase to keep the ranks together) refuses the other's proposal.
    assert all(r[1] <= 3 for r in results), [r[1] for r in results]


def batch_job(steps: int, flags: str) -> list:
    import time

    import hora.numpy as hvd
    from hora.core.api import current

    hvd.init()
    me = hvd.rank()

    def tensor(step: int, i: int) -> np.ndarray:
        return np.full(i + 1, me + step + i, np.float32)

    out, lane = [], []
    for step in range(steps):
        # Twelve lone allreduces announced in one batch by a quiet rank: after the first
        # step they are cached, and every rank proposes the same ids.
        before = current().engine.stats().lane_succeeded
        with current().batch():
            handles = [hvd.allreduce_async(tensor(step, i), op=hvd.Sum, name=f"b{i}") for i in range(12)]
        out.append([hvd.synchronize(h).tolist() for h in handles])
        lane.append(current().engine.stats().lane_succeeded - before)
        _idle_barrier(flags, f"batch{step}")
    for step in range(steps):
        # The same as a burst of calls, odd ranks pausing halfway on odd steps: the ranks'
        # batches differ, and a proposal that names other ids fails everywhere alike.
        handles = []
        for i in range(12):
            handles.append(hvd.allreduce_async(tensor(step, i), op=hvd.Sum, name=f"b{i}"))
            if step % 2 and me % 2 and i == 5:
                time.sleep(0.02)
        out.append([hvd.synchronize(h).tolist() for h in handles])
        _idle_barrier(flags, f"burst{step}")
    hvd.shutdown()
    return [out, lane]


@pytest.mark.ranks
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.timeout(120)
def test_a_batch_of_lone_allreduces_is_agreed_by_id_and_differing_batches_fall_back(size, tmp_path):
    steps = 6
    results = run_ranks(size, batch_job, steps, str(tmp_path), timeout=100)
    for step in range(steps):
        expected = [[float(sum(r + step + i for r in range(size)))] * (i + 1) for i in range(12)]
        for out, _ in results:
            assert out[step] == out[steps + step] == expected
    # Once cached, each batch went on the lane as one proposal, with nobody busy.
    for _, lane in results:
        assert lane[0] == 0 and lane[1:] == [1] * (steps - 1), lane


def process_set_job(flags: str) -> list:
    import hora.numpy as hvd
    from hora.core.api import current

    pair = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[pair])
    me = hvd.rank()
    out = []
    for step in range(4):
        # Ranks 0 and 1 start a global group, then an allreduce of their own set; rank 2
        # comes to the group late. With a process set known no rank proposes by id: a
        # member could otherwise run the pair's allreduce while the late rank's proposal
        # completes the group's on the other member, who would run that first.
        handle = hvd.grouped_allreduce_async([np.full(5000, me + 1.0)], op=hvd.Sum, name="g")
        if me in (0, 1):
            out.append(float(hvd.allreduce(np.full(5000, 1.0), op=hvd.Sum, name="pair", process_set=pair)[0]))
        else:
            import time

            time.sleep(0.05)
        out.append(float(hvd.synchronize(handle)[0][0]))
        _idle_barrier(flags, f"step{step}")
    before = current().engine.stats().lane_succeeded
    for _ in range(4):  # quiet, cached, whole groups: the lane would take them with no set known
        hvd.grouped_allreduce([np.full(5000, 1.0)], op=hvd.Sum, name="quiet")
        _idle_barrier(flags, f"quiet{_}")
    out.append(current().engine.stats().lane_succeeded - before)
    hvd.shutdown()
    return out


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_with_a_process_set_known_groups_go_the_coordinators_way(tmp_path):
    results = run_ranks(3, process_set_job, str(tmp_path), timeout=100)
    for rank, out in enumerate(results):
        per_step = [2.0, 6.0] if rank < 2 else [6.0]
        assert out[:-1] == per_step * 4
        assert out[-1] == 0


def mixed_order_job(steps: int) -> list:
    import hora.numpy as hvd

    hvd.init()
    me = hvd.rank()
    out = []
    for step in range(steps):
        # Odd ranks submit in the opposite order; small and large, named and grouped.
        calls = [
            lambda: hvd.allreduce_async(np.full(2, me + step, dtype=np.float32), op=hvd.Sum, name="a"),
            lambda: hvd.allreduce_async(np.full(3, me * step, dtype=np.float64), op=hvd.Sum, name="b"),
            lambda: hvd.allreduce_async(np.full(6000, 1.0, dtype=np.float32), op=hvd.Sum, name="large"),
            lambda: hvd.grouped_allreduce_async([np.ones(2), np.ones(1)], op=hvd.Sum, name="g"),
        ]
        if me % 2:
            calls.reverse()
        handles = [call() for call in calls]
        if me % 2:
            handles.reverse()
        results = [hvd.synchronize(h) for h in handles]
        out.append([results[0].tolist(), results[1].tolist(), float(results[2][0]), [r.tolist() for r in results[3]]])
    hvd.shutdown()
    return out


@pytest.mark.ranks
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.timeout(120)
def test_ranks_submitting_in_different_orders_finish_with_exact_results(size):
    steps = 8
    for out in run_ranks(size, mixed_order_job, steps, timeout=100):
        for step, row in enumerate(out):
            assert row[0] == [sum(r + step for r in range(size))] * 2
            assert row[1] == [sum(r * step for r in range(size))] * 3
            assert row[2] == size
            assert row[3] == [[size] * 2, [size]]


def threads_job(steps: int) -> list:
    import threading

    import hora.numpy as hvd

    hvd.init()
    me = hvd.rank()
    out: dict[int, list] = {}

    def work(thread: int) -> None:
        out[thread] = [
            hvd.allreduce(np.full(3, me + thread + step, dtype=np.float32), op=hvd.Sum, name=f"t{thread}").tolist()
            for step in range(steps)
        ]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hvd.shutdown()
    return [out[t] for t in range(3)]


@pytest.mark.ranks
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.timeout(120)
def test_threads_of_a_rank_share_the_lane(size):
    steps = 40
    for out in run_ranks(size, threads_job, steps, timeout=100):
        for thread in range(3):
            assert out[thread] == [[float(sum(r + thread + step for r in range(size)))] * 3 for step in range(steps)]


def invalidation_job() -> list:
    import hora.numpy as hvd

    hvd.init()
    me = hvd.rank()
    out = []
    for _ in range(3):
        out.append(hvd.allreduce(np.ones(3), op=hvd.Sum, name="x").tolist())
    try:  # one rank changes the shape of a cached tensor
        hvd.allreduce(np.ones(4 if me == 1 else 3), op=hvd.Sum, name="x")
        out.append("no error")
    except hvd.CollectiveMismatchError as exc:
        out.append(str(exc))
    try:  # and its dtype
        hvd.allreduce(np.ones(3, dtype=np.float32 if me == 1 else np.float64), op=hvd.Sum, name="x")
        out.append("no error")
    except hvd.CollectiveMismatchError as exc:
        out.append(str(exc))
    for _ in range(3):
        out.append(hvd.allreduce(np.ones(3), op=hvd.Sum, name="x").tolist())
    hvd.shutdown()
    return out


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_a_changed_tensor_leaves_the_lane_and_gets_the_coordinators_error():
    for out in run_ranks(2, invalidation_job):
        assert out[:3] == [[2.0] * 3] * 3
        assert "allreduce 'x': shapes differ across ranks: rank 0: (3,), rank 1: (4,)" in out[3]
        assert "allreduce 'x': data types differ across ranks: rank 0: float64, rank 1: float32" in out[4]
        assert out[5:] == [[2.0] * 3] * 3


def join_job() -> list:
    import hora.numpy as hvd

    hvd.init()
    me = hvd.rank()
    out = []
    steps = 3 if me == 1 else 8  # rank 1 runs out of data first and joins
    for step in range(steps):
        out.append(hvd.allreduce(np.full(2, 1.0 + me, dtype=np.float32), op=hvd.Sum, name="loss").tolist())
    out.append(hvd.join())
    hvd.shutdown()
    return out


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_a_joined_rank_contributes_zeros_to_cached_tensors():
    rank0, rank1 = run_ranks(2, join_job)
    assert rank0[:3] == rank1[:3] == [[3.0, 3.0]] * 3
    assert rank0[3:8] == [[1.0, 1.0]] * 5  # rank 1 has joined: zeros
    assert rank0[8] == rank1[3] == 0  # the last rank to join was rank 0


def poll_only_job() -> list:
    import time

    import hora.numpy as hvd

    hvd.init()
    me = hvd.rank()
    out = []
    for step in range(6):
        handle = hvd.allreduce_async(np.full(2, me + step, dtype=np.float32), op=hvd.Sum, name="polled")
        deadline = time.monotonic() + 30
        while not hvd.poll(handle):  # nobody waits: the engine thread must finish it
            assert time.monotonic() < deadline, "an allreduce nobody waits for never finished"
            time.sleep(0.002)
        out.append(hvd.synchronize(handle).tolist())
        if me == 0:
            # Shapes the scenario only: rank 1 most likely proposes first and then only
            # polls, so its own engine thread must finish the step. Whichever rank
            # proposes first, nobody waits, and the results are checked the same.
            time.sleep(0.05)
    hvd.shutdown()
    return out


@pytest.mark.ranks
@pytest.mark.timeout(90)
def test_a_lane_proposal_nobody_waits_for_finishes():
    for out in run_ranks(2, poll_only_job, timeout=80):
        assert out == [[float(1 + 2 * step)] * 2 for step in range(6)]


def leaving_job(how: str, grouped: bool, flags: str) -> str:
    import pathlib
    import threading

    import hora.numpy as hvd
    from hora.core.api import current

    hvd.init()
    me = hvd.rank()
    folder = pathlib.Path(flags)

    def step() -> None:  # small (with its data on the lane) or a group (by id)
        if grouped:
            hvd.grouped_allreduce([np.ones(5000)], op=hvd.Sum, name="step")
        else:
            hvd.allreduce(np.ones(2), op=hvd.Sum, name="step")

    for _ in range(5):
        step()
    engine = current().engine
    if me == 1:
        # Idle, rank 1 does not refuse rank 0's next proposal; it leaves only once rank 0
        # waits on the lane for that proposal, which it never answers.
        _wait_until(lambda: engine.stats().idle)
        (folder / "idle").touch()
        _wait_until((folder / "waiting").exists)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.shutdown()
        return "left"
    _wait_until((folder / "idle").exists)

    def say_when_waiting() -> None:  # the main thread is in the allreduce below meanwhile
        _wait_until(lambda: engine.stats().lane_pending)
        (folder / "waiting").touch()

    threading.Thread(target=say_when_waiting, daemon=True).start()
    try:
        step()
        return "no error"
    except hvd.HoraInternalError as exc:
        return str(exc)


@pytest.mark.ranks
@pytest.mark.parametrize("grouped", [False, True], ids=["small", "by-id"])
@pytest.mark.parametrize("how", ["kill", "shutdown"])
@pytest.mark.timeout(60)
def test_a_rank_that_leaves_while_another_waits_on_the_lane_fails_that_wait(how, grouped, tmp_path):
    results = run_ranks(2, leaving_job, how, grouped, str(tmp_path), check=False)
    assert results[0].returncode == 0, results[0].output
    op = "grouped_allreduce 'step_0'" if grouped else "allreduce 'step'"
    if how == "kill":
        assert results[1].returncode == -signal.SIGKILL
        assert f"{op} failed: rank 1 on host" in results[0].value
        assert "was lost" in results[0].value
    else:
        assert results[1].value == "left"
        assert f"{op} cannot run: in its process set, rank 1 on host" in results[0].value
        assert "has shut down (it called shutdown())" in results[0].value


def leaving_proposer_job(flags: str) -> list:
    import time

    import hora.numpy as hvd

    hvd.init()
    me = hvd.rank()
    for step in range(3):
        hvd.grouped_allreduce([np.full(5000, me + 1.0)], op=hvd.Sum, name="g")
        _idle_barrier(flags, f"step{step}")
    if me == 1:
        # Proposes the group by id and shuts down without waiting for it: the others
        # will agree to it, and its data phase needs this rank, which settles it first.
        hvd.grouped_allreduce_async([np.full(5000, me + 1.0)], op=hvd.Sum, name="g")
        hvd.shutdown()
        return ["left"]
    time.sleep(0.3)
    out = hvd.grouped_allreduce([np.full(5000, me + 1.0)], op=hvd.Sum, name="g")
    return [float(out[0].min()), float(out[0].max())]


@pytest.mark.ranks
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.timeout(60)
def test_a_rank_that_shuts_down_with_a_proposal_by_id_runs_it_first(size, tmp_path):
    # Under 30 s: the leaving rank leaves once its proposal has run, not at the next stall
    # check (60 s), which was the first thing to wake its engine thread again.
    results = run_ranks(size, leaving_proposer_job, str(tmp_path), timeout=30)
    total = float(sum(r + 1 for r in range(size)))
    assert results[1] == ["left"]
    assert all(out == [total, total] for rank, out in enumerate(results) if rank != 1), results


def leaving_proposer_loses_a_peer_job(victim: int, flags: str) -> str:
    import pathlib
    import time

    import hora.numpy as hvd
    from hora.core.api import current

    hvd.init()
    me = hvd.rank()
    folder = pathlib.Path(flags)
    for step in range(3):
        hvd.grouped_allreduce([np.full(5000, me + 1.0)], op=hvd.Sum, name="g")
        _idle_barrier(flags, f"step{step}")
    if me == 1:
        # Proposes by id and shuts down, so it waits for the others' answers before it
        # leaves; a peer dies meanwhile, and nothing but hora stops this rank.
        engine = current().engine
        hvd.grouped_allreduce_async([np.full(5000, me + 1.0)], op=hvd.Sum, name="g")
        _wait_until(lambda: engine.stats().lane_pending)
        (folder / "proposed").touch()
        start = time.monotonic()
        try:
            hvd.shutdown()
        except hvd.HoraInternalError as exc:
            return f"{time.monotonic() - start:.3f}\n{exc}"
        return f"{time.monotonic() - start:.3f}\nleft"
    _wait_until((folder / "proposed").exists)
    if me == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    # The survivor neither answers the proposal nor leaves (either would end rank 1's wait):
    # only the loss may.
    engine = current().engine
    _wait_until(lambda: engine.failure is not None)
    return engine.failure or "no failure"


@pytest.mark.ranks
@pytest.mark.parametrize("victim", [0, 2], ids=["coordinator", "worker"])
@pytest.mark.timeout(90)
def test_a_rank_leaving_with_a_proposal_by_id_is_not_held_by_a_dead_peer(victim, tmp_path):
    # Started as torchrun would: no launcher ends a survivor that waits.
    results = run_ranks(
        3, leaving_proposer_loses_a_peer_job, victim, str(tmp_path), check=False, launcher="torchrun", timeout=80
    )
    assert results[victim].returncode == -signal.SIGKILL
    assert results[1].returncode == 0, results[1].output + (results[1].error or "")
    seconds, outcome = results[1].value.split("\n", 1)
    assert float(seconds) < 20.0, results[1].value
    survivor = 2 if victim == 0 else 0
    message = results[survivor].value
    assert re.search(rf"rank {victim} (\(the coordinator\) )?on host .* was lost", message), message
    assert outcome == "left" or re.search(rf"rank {victim} .*was lost", outcome), outcome
