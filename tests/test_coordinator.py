"""The coordinator's decisions, in-process: readiness, order, validation messages, fusion, join, riders."""

import numpy as np
import pytest

from hora.collectives.reduce import AVERAGE, MAX, MIN, PRODUCT, SUM, DataType, reducer, scale
from hora.engine.coordinator import Coordinator
from hora.engine.executor import Executor
from hora.engine.fusion import fuse
from hora.engine.handles import Handle
from hora.engine.messages import Request, RequestType, Response, ResponseType
from hora.engine.process_sets import ProcessSetTable
from hora.engine.queue import Entry, TensorQueue
from hora.engine.riders import _batch_key, computed_result, computed_results, riders

F32 = int(DataType.FLOAT32)


def req(rank, name, kind=RequestType.ALLREDUCE, shape=(4,), **kw):
    kw.setdefault("dtype", F32)
    kw.setdefault("reduce_op", SUM)
    return Request(rank, kind, name, shape=shape, **kw)


def take(coordinator):
    return [(r.type, r.names, members) for r, members in coordinator.take()]


def test_ready_only_when_every_rank_submitted_in_any_order():
    c = Coordinator(3, fusion_threshold=0)
    c.submit(req(2, "a"))
    c.submit(req(0, "b"))
    c.submit(req(0, "a"))
    assert take(c) == []
    c.submit(req(1, "b"))
    c.submit(req(1, "a"))
    assert take(c) == [(ResponseType.ALLREDUCE, ["a"], (0, 1, 2))]
    c.submit(req(2, "b"))
    assert take(c) == [(ResponseType.ALLREDUCE, ["b"], (0, 1, 2))]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({1: {"shape": (17, 23, 57)}, 0: {"shape": (17, 1311)}, 2: {"shape": (17, 1311)}},
         "allreduce 'grad': shapes differ across ranks: ranks 0, 2: (17, 1311), rank 1: (17, 23, 57)"),
        ({1: {"dtype": int(DataType.INT64)}}, "data types differ across ranks: ranks 0, 2: float32, rank 1: int64"),
        ({2: {"reduce_op": AVERAGE}}, "reduce ops differ across ranks: ranks 0, 1: Sum, rank 2: Average"),
        ({0: {"prescale": 2.0}}, "prescale factors differ across ranks: rank 0: 2.0, ranks 1, 2: 1.0"),
        ({1: {"postscale": 0.5}}, "postscale factors differ across ranks"),
        ({1: {"kind": RequestType.ALLGATHER}}, "operations differ across ranks: ranks 0, 2: allreduce, rank 1: allgather"),
    ],
)
def test_mismatches_name_each_ranks_value(changes, message):
    c = Coordinator(3, fusion_threshold=0)
    for rank in range(3):
        kw = {"shape": (4,)} | changes.get(rank, {})
        kind = kw.pop("kind", RequestType.ALLREDUCE)
        c.submit(req(rank, "allreduce.grad", kind=kind, **kw))
    [(response, members)] = c.take()
    assert response.type == ResponseType.ERROR
    assert message in response.error
    assert members == (0, 1, 2)


def test_allgather_and_alltoall_rules():
    c = Coordinator(2, fusion_threshold=0)
    c.submit(req(0, "g", RequestType.ALLGATHER, shape=(3, 2)))
    c.submit(req(1, "g", RequestType.ALLGATHER, shape=(5, 2)))
    [(ok, _)] = c.take()
    assert ok.type == ResponseType.ALLGATHER and ok.sizes == [3, 5]
    c.submit(req(0, "h", RequestType.ALLGATHER, shape=(3, 2)))
    c.submit(req(1, "h", RequestType.ALLGATHER, shape=(3, 4)))
    [(bad, _)] = c.take()
    assert "shapes beyond the first dimension differ across ranks: rank 0: (3, 2), rank 1: (3, 4)" in bad.error
    c.submit(req(0, "t", RequestType.ALLTOALL, shape=(3,), splits=(1, 2)))
    c.submit(req(1, "t", RequestType.ALLTOALL, shape=(4,), splits=(4, 0)))
    [(a2a, _)] = c.take()
    assert a2a.sizes == [1, 2, 4, 0]


def test_broadcast_root_mismatch():
    c = Coordinator(2, fusion_threshold=0)
    c.submit(req(0, "b", RequestType.BROADCAST, root_rank=0))
    c.submit(req(1, "b", RequestType.BROADCAST, root_rank=1))
    [(bad, _)] = c.take()
    assert "root ranks differ across ranks: rank 0: 0, rank 1: 1" in bad.error


def test_fusion_respects_kind_and_threshold():
    c = Coordinator(2, fusion_threshold=64)  # 16 float32s
    for name in ("a", "b", "c", "d"):
        for rank in range(2):
            c.submit(req(rank, name, shape=(6,)))
    for rank in range(2):
        c.submit(req(rank, "other-dtype", shape=(2,), dtype=int(DataType.FLOAT64)))
    fused = take(c)
    assert [names for _, names, _ in fused] == [["a", "b"], ["c", "d"], ["other-dtype"]]


def test_fuse_disabled_and_non_fusable():
    responses = [
        Response(ResponseType.ALLREDUCE, ["x"], dtype=F32, sizes=[1]),
        Response(ResponseType.BROADCAST, ["y"], dtype=F32),
        Response(ResponseType.ALLREDUCE, ["z"], dtype=F32, sizes=[1]),
    ]
    assert [r.names for r in fuse(responses, 0)] == [["x"], ["y"], ["z"]]
    assert [r.names for r in fuse(responses, 1024)] == [["x", "z"], ["y"]]


def test_groups_are_released_together():
    c = Coordinator(2, fusion_threshold=1 << 20)
    for rank in range(2):
        c.submit(req(rank, "g_0", group="g", group_size=2))
    assert take(c) == []
    for rank in range(2):
        c.submit(req(rank, "g_1", group="g", group_size=2))
    assert [names for _, names, _ in take(c)] == [["g_0", "g_1"]]


def test_join_lets_others_proceed_and_reports_last_rank():
    c = Coordinator(3, fusion_threshold=0)
    c.submit(req(0, "a"))
    c.submit(Request(1, RequestType.JOIN, "join"))
    c.submit(req(2, "a"))
    assert take(c) == [(ResponseType.ALLREDUCE, ["a"], (0, 1, 2))]  # rank 1 contributes zeros
    c.submit(req(0, "g", RequestType.ALLGATHER, shape=(1,)))
    c.submit(req(2, "g", RequestType.ALLGATHER, shape=(1,)))
    [(refused, _)] = c.take()
    assert "rank(s) 1 have called join()" in refused.error
    c.submit(Request(2, RequestType.JOIN, "join"))
    c.submit(Request(0, RequestType.JOIN, "join"))
    [(done, members)] = c.take()
    assert done.type == ResponseType.JOIN and done.root_rank == 0 and members == (0, 1, 2)


def test_ranks_that_leave_do_not_hold_up_a_join():
    # Found with Horovod's own test_torch.py at 3 ranks: rank 0 waited in join() for ever
    # once the others ended without joining.
    c = Coordinator(3, fusion_threshold=0)
    c.submit(Request(0, RequestType.JOIN, "join"))
    c.depart(1)
    assert take(c) == []  # rank 2 may still join
    c.depart(2, "has shut down (its program ended)")
    [(done, members)] = c.take()
    assert done.type == ResponseType.JOIN and done.root_rank == 0 and members == (0,)
    c.submit(req(0, "a"))  # what needs the ranks that left fails, naming them
    [(aborted, _)] = c.take()
    assert aborted.type == ResponseType.ABORTED and "rank 2 has shut down (its program ended)" in aborted.error


def test_process_sets_order_and_membership():
    c = Coordinator(3, fusion_threshold=0)
    for rank in range(3):
        c.submit(Request(rank, RequestType.ADD_PROCESS_SET, "add.1", splits=(0, 2)))
    [(added, members)] = c.take()
    assert added.type == ResponseType.ADD_PROCESS_SET and added.root_rank == 1 and members == (0, 1, 2)
    c.submit(req(0, "x", process_set_id=1))
    c.submit(req(2, "x", process_set_id=1))
    assert take(c) == [(ResponseType.ALLREDUCE, ["x"], (0, 2))]
    c.submit(req(1, "y", process_set_id=1))  # not a member
    [(error, members)] = c.take()
    assert error.type == ResponseType.ERROR and members == (1,)
    for rank in range(3):
        c.submit(Request(rank, RequestType.ADD_PROCESS_SET, "add.2", splits=(0, 2)))
    [(dup, _)] = c.take()
    assert "duplicate process set" in dup.error


def test_stalls_name_missing_ranks():
    now = [100.0]
    c = Coordinator(3, fusion_threshold=0, clock=lambda: now[0])
    c.submit(req(0, "a"))
    c.submit(req(2, "a"))
    now[0] = 200.0
    [stall] = c.stalls(60)
    assert stall.name == "a" and stall.missing == [1] and stall.waited == 100.0
    assert c.stalls(101) == []


def test_a_tensor_only_refused_is_no_stall_and_no_deadline():
    # A TF1 graph's op refused by rank 1 while building, built by rank 0 and never run:
    # nobody waits for it, so no stall warning (nor shutdown) and no wake-up for one.
    now = [100.0]
    c = Coordinator(2, fusion_threshold=0, clock=lambda: now[0])
    c.submit(Request(1, RequestType.ALLTOALL, "alltoall.k", error="ValueError: a scalar", scope=1))
    now[0] = 200.0
    assert c.stalls(60) == [] and c.next_deadline() is None
    c.submit(req(0, "b"))  # a tensor rank 0 waits for is one
    assert [s.name for s in c.stalls(0)] == ["b"] and c.next_deadline() == 200.0


def test_the_deadline_is_the_oldest_waited_for_tensor_also_after_a_clock_restarts():
    now = [100.0]
    c = Coordinator(2, fusion_threshold=0, clock=lambda: now[0])
    # A refusal from TF1 graph 1 for "k", then tensors a rank waits for.
    c.submit(Request(1, RequestType.ALLTOALL, "alltoall.k", error="ValueError: a scalar", scope=1))
    now[0] = 110.0
    c.submit(req(0, "a"))
    now[0] = 120.0
    c.submit(req(0, "b"))
    assert c.next_deadline() == 110.0
    # Graph 2's "k" retires the stale refusal: that tensor is new, first seen now.
    now[0] = 130.0
    c.submit(req(0, "alltoall.k", kind=RequestType.ALLTOALL, scope=2))
    assert c.next_deadline() == 110.0
    c.submit(req(1, "a"))  # "a" runs: "b" is the oldest left, then "k"
    c.take()
    assert c.next_deadline() == 120.0
    c.submit(req(1, "b"))
    c.take()
    assert c.next_deadline() == 130.0 and [s.name for s in c.stalls(0)] == ["alltoall.k"]


def test_cached_tensors_skip_validation_and_changes_are_caught(monkeypatch):
    from hora.engine import validate

    c = Coordinator(2, fusion_threshold=0, cache_capacity=2)
    for rank in range(2):
        c.submit(req(rank, "a"))
    [(first, _)] = c.take()
    assert first.cache_ids == [0]

    def no_validation(*args, **kwargs):
        raise AssertionError("a fully cached tensor was validated again")

    with monkeypatch.context() as m:
        m.setattr(validate, "construct", no_validation)
        c.submit_cached(0, 0)
        c.submit_cached(1, 0)
        [(again, _)] = c.take()
    assert (again.type, again.names, again.sizes, again.cache_ids) == (first.type, ["a"], [4], [0])
    # Rank 0 changes the shape; rank 1 sends its unchanged tensor by id: the mismatch is caught.
    c.submit(req(0, "a", shape=(5,)))
    c.submit_cached(1, 0)
    [(error, _)] = c.take()
    assert error.type == ResponseType.ERROR
    assert "shapes differ across ranks: rank 0: (5,), rank 1: (4,)" in error.error
    # Past the capacity, new tensors negotiate in full and get no id.
    for name in ("b", "c"):
        for rank in range(2):
            c.submit(req(rank, name))
    assert [r.cache_ids for r, _ in c.take()] == [[1], [-1]]
    with pytest.raises(Exception, match="unknown cache id 7"):
        c.submit_cached(0, 7)


def test_a_consistent_change_updates_the_cache():
    c = Coordinator(2, fusion_threshold=0)
    for shape in ((4,), (6,)):
        for rank in range(2):
            c.submit(req(rank, "a", shape=shape))
        [(response, _)] = c.take()
        assert response.sizes == [shape[0]] and response.cache_ids == [0]
    c.submit_cached(0, 0)
    c.submit_cached(1, 0)
    [(response, _)] = c.take()
    assert response.sizes == [6]


def test_rank_cache_sends_ids_only_for_unchanged_requests():
    from hora.engine.cache import RankCache

    cache = RankCache()
    a = req(0, "a")
    assert cache.lookup(a) is None
    cache.learn(a, 3)
    assert cache.lookup(req(0, "a")) == 3
    assert cache.lookup(req(0, "a", shape=(5,))) is None
    assert cache.lookup(req(0, "a", process_set_id=1)) is None
    cache.learn(req(0, "b"), -1)
    assert cache.lookup(req(0, "b")) is None


def test_a_cached_response_is_an_independent_copy_of_every_field():
    from hora.engine.cache import CoordinatorCache

    cache = CoordinatorCache(4)
    template = Response(ResponseType.ALLREDUCE, ["a"], 2, F32, AVERAGE, 3, 0.5, 2.0, [4], "", [0])
    cache_id = cache.record((2, "a"), [req(0, "a", process_set_id=2)], template)
    first = cache.response(cache_id)
    assert first == template and first is not template
    first.names.append("b")
    first.sizes.append(1)
    first.cache_ids.append(1)
    assert cache.response(cache_id) == template  # fusion extends copies, never the template


def test_a_group_whose_size_differs_across_ranks_fails_whole_on_every_rank():
    c = Coordinator(2, fusion_threshold=1 << 20)
    c.submit_many([req(1, f"grouped_allreduce.g_{i}", group="grouped_allreduce.g", group_size=3) for i in range(3)])
    c.submit_many([req(0, f"grouped_allreduce.g_{i}", group="grouped_allreduce.g", group_size=2) for i in range(2)])
    [(response, members)] = c.take()
    assert response.type == ResponseType.ERROR and members == (0, 1)
    assert sorted(response.names) == [f"grouped_allreduce.g_{i}" for i in range(3)]
    assert response.error == (
        "grouped_allreduce 'g': numbers of tensors in the grouped call differ across ranks: rank 0: 2, rank 1: 3"
    )
    assert c.stalls(0.0) == []  # nothing left waiting


def test_a_refused_request_fails_the_tensor_on_every_rank_naming_the_rank():
    c = Coordinator(3, fusion_threshold=0)
    c.submit(req(0, "alltoall.a", kind=RequestType.ALLTOALL))
    c.submit(req(2, "alltoall.a", kind=RequestType.ALLTOALL))
    c.submit(Request(1, RequestType.ALLTOALL, "alltoall.a", error="ValueError: splits must be integers"))
    [(response, members)] = c.take()
    assert response.type == ResponseType.ERROR and members == (0, 1, 2)
    assert response.error == "alltoall 'a': refused by rank 1: ValueError: splits must be integers"


def test_a_refusal_from_an_earlier_tf1_graph_does_not_meet_a_later_graphs_tensor_of_its_name():
    c = Coordinator(2, fusion_threshold=0)
    # Rank 1 refused the op while building graph 1; rank 0 built it and never ran it.
    c.submit(Request(1, RequestType.ALLTOALL, "alltoall.k", error="ValueError: a scalar", scope=1))
    # Graph 2 reuses the name (names restart per graph): rank 0's op comes first.
    c.submit(req(0, "alltoall.k", kind=RequestType.ALLTOALL, scope=2))
    assert take(c) == []  # the stale refusal is gone, rank 1's op is awaited
    c.submit(req(1, "alltoall.k", kind=RequestType.ALLTOALL, scope=2))
    [(response, members)] = c.take()
    assert response.type == ResponseType.ALLTOALL and members == (0, 1)
    # A refusal from the same graph still fails the op, in either order.
    c.submit(req(0, "alltoall.m", kind=RequestType.ALLTOALL, scope=3))
    c.submit(Request(1, RequestType.ALLTOALL, "alltoall.m", error="ValueError: a scalar", scope=3))
    c.submit(Request(1, RequestType.ALLTOALL, "alltoall.n", error="ValueError: a scalar", scope=3))
    c.submit(req(0, "alltoall.n", kind=RequestType.ALLTOALL, scope=3))
    failed = [(ResponseType.ERROR, ["alltoall.m"], (0, 1)), (ResponseType.ERROR, ["alltoall.n"], (0, 1))]
    assert take(c) == failed
    assert c.stalls(0.0) == []


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_stuck_ranks_waiting_for_each_other_fail_after_the_grace():
    from hora.engine.coordinator import MISMATCH_GRACE

    clock = Clock()
    c = Coordinator(3, fusion_threshold=0, clock=clock)
    c.submit(Request(0, RequestType.BARRIER, "barrier"))
    c.submit(req(1, "allreduce.c"))
    c.submit(req(2, "allgather.c", kind=RequestType.ALLGATHER))
    for rank in range(3):
        c.note_stuck(rank, 0)
    assert c.seconds_to_mismatch_check() == MISMATCH_GRACE
    c.find_mismatches()
    assert take(c) == []  # within the grace: a thread may still submit
    clock.now += MISMATCH_GRACE
    assert c.seconds_to_mismatch_check() == 0.0
    c.find_mismatches()
    responses = c.take()
    assert sorted(r.names[0] for r, _ in responses) == ["allgather.c", "allreduce.c", "barrier"]
    error = responses[0][0].error
    assert all(r.type == ResponseType.ERROR and r.error == error for r, _ in responses)
    assert "rank 0 waits for barrier (not submitted by rank 1, 2)" in error
    assert "rank 1 waits for allreduce 'c' (not submitted by rank 0, 2)" in error
    assert "(the name 'c' is used for allgather and allreduce)" in error
    assert c.seconds_to_mismatch_check() is None


def test_a_stuck_rank_is_not_failed_while_a_rank_it_waits_for_may_still_submit():
    clock = Clock()
    c = Coordinator(3, fusion_threshold=0, clock=clock)
    c.submit(req(0, "allreduce.x"))
    c.submit(req(1, "allreduce.x"))
    c.note_stuck(0, 0)
    c.note_stuck(1, 0)  # rank 2 is busy, not stuck: it may still submit x
    clock.now += 10
    c.find_mismatches()
    assert take(c) == [] and c.seconds_to_mismatch_check() is None  # and no busy re-checking
    c.submit(req(2, "allreduce.x"))
    assert take(c) == [(ResponseType.ALLREDUCE, ["allreduce.x"], (0, 1, 2))]


def test_ranks_that_wait_on_each_other_through_a_busy_rank_are_doomed_all_the_same():
    clock = Clock()
    c = Coordinator(3, fusion_threshold=0, clock=clock)
    c.submit(req(0, "allreduce.x"))  # needs rank 1, which waits for y
    c.submit(req(1, "allreduce.y"))  # needs rank 0, which waits for x
    c.note_stuck(0, 0)
    c.note_stuck(1, 0)  # whatever busy rank 2 submits, neither x nor y can complete
    clock.now += 10
    c.find_mismatches()
    assert sorted(names[0] for _, names, _ in take(c)) == ["allreduce.x", "allreduce.y"]


def test_a_stuck_report_that_missed_a_response_is_ignored():
    clock = Clock()
    c = Coordinator(2, fusion_threshold=0, clock=clock)
    c.submit(req(0, "allreduce.a"))
    c.submit(req(1, "allreduce.a"))
    c.take()  # one response each, not yet received when they report
    c.submit(req(0, "allreduce.x"))
    c.submit(Request(1, RequestType.BARRIER, "barrier"))
    c.note_stuck(0, 0)
    c.note_stuck(1, 0)
    clock.now += 10
    c.find_mismatches()
    assert take(c) == []
    c.note_stuck(0, 1)
    c.note_stuck(1, 1)
    clock.now += 10
    c.find_mismatches()
    assert sorted(names[0] for _, names, _ in take(c)) == ["allreduce.x", "barrier"]


def test_a_rank_flooding_the_coordinator_with_names_is_refused(monkeypatch):
    from hora.engine import coordinator
    from hora.errors import ProtocolError

    monkeypatch.setattr(coordinator, "MAX_PENDING_PER_RANK", 10)
    c = Coordinator(2, fusion_threshold=0)
    c.submit_many([req(1, f"x{i}") for i in range(10)])
    with pytest.raises(ProtocolError, match="more than 10 of its collectives wait"):
        c.submit(req(1, "one too many"))
    for i in range(10):  # answered tensors no longer count
        c.submit(req(0, f"x{i}"))
    assert len(c.take()) == 10
    c.submit_many([req(1, f"y{i}") for i in range(10)])


# ----- riders: small collectives computed at the coordinator (hora.engine.riders) -----


def f32(*values):
    return np.array(values, dtype=np.float32).tobytes()


def test_riders_allreduce_in_member_order_with_scales_and_only_when_every_member_sent_one():
    c = Coordinator(3, fusion_threshold=1 << 20)
    data = {rank: f32(rank + 1, 10 * rank, 0.5, -rank) for rank in range(3)}
    for rank in (2, 0, 1):
        c.submit_many([req(rank, "a", prescale=2.0, postscale=0.25)], riders=[data[rank]])
    [(response, members)] = c.take()
    assert members == (0, 1, 2)
    expected = sum(np.frombuffer(data[rank], np.float32) * np.float32(2.0) for rank in range(3)) * np.float32(0.25)
    np.testing.assert_array_equal(np.frombuffer(response.data, np.float32), expected)
    # Cached the second time: the result is computed afresh, never taken from the cache.
    for rank in range(3):
        c.submit_many([], [0], rank, riders=[f32(1, 1, 1, 1)])
    [(again, _)] = c.take()
    np.testing.assert_array_equal(np.frombuffer(again.data, np.float32), [1.5] * 4)
    # One member without a rider (or with one of the wrong size): the members move the data.
    for rank0_rider in ([], [f32(1, 1)]):
        for rank in range(3):
            c.submit_many([], [0], rank, riders=[f32(1, 1, 1, 1)] if rank else rank0_rider)
        assert [r.data for r, _ in c.take()] == [b""]


@pytest.mark.parametrize("dtype", [DataType.FLOAT16, DataType.FLOAT32, DataType.FLOAT64, DataType.INT8,
                                   DataType.UINT8, DataType.INT32, DataType.INT64, DataType.BOOL, DataType.BFLOAT16])
def test_riders_reduce_in_the_storage_type_folding_members_in_order(dtype):
    # What the members' data phase would compute: rank 0's tensor, then each other rank's
    # folded in, in the storage type (small integers wrap, floats round at every step).
    rng = np.random.default_rng(int(dtype))
    storage = dtype.storage
    ops = [SUM, MIN, MAX, PRODUCT] + ([AVERAGE] if dtype.is_float else [])
    for op in ops:
        c = Coordinator(4, fusion_threshold=0)
        if dtype == DataType.BOOL:
            parts = [rng.integers(0, 2, 37).astype(np.bool_) for _ in range(4)]
        elif dtype.is_float and dtype != DataType.BFLOAT16:
            parts = [(rng.standard_normal(37) * 2).astype(storage) for _ in range(4)]
        else:
            parts = [rng.integers(0, 200, 37).astype(storage) for _ in range(4)]
        postscale = 0.25 if op == AVERAGE else 1.0
        for rank in range(4):
            request = req(rank, "r", shape=(37,), dtype=int(dtype), reduce_op=op, postscale=postscale)
            c.submit_many([request], riders=[parts[rank].tobytes()])
        [(response, _)] = c.take()
        expected = parts[0].copy()
        for part in parts[1:]:
            reducer(op, dtype)(expected, part)
        scale(expected, postscale, dtype)
        assert response.data == expected.tobytes(), (dtype, op)


def test_riders_broadcast_take_the_roots_tensor_and_skip_a_set_with_a_joined_rank():
    c = Coordinator(3, fusion_threshold=0)
    for rank in range(3):
        rider = [f32(7, 8)] if rank == 1 else []
        c.submit_many([req(rank, "b", kind=RequestType.BROADCAST, shape=(2,), root_rank=1)], riders=rider)
    [(response, _)] = c.take()
    assert response.data == f32(7, 8)
    c.submit(req(2, "join", kind=RequestType.JOIN))
    for rank in (0, 1):
        c.submit_many([req(rank, "a")], riders=[f32(1, 2, 3, 4)])
    [(response, members)] = c.take()
    assert response.names == ["a"] and members == (0, 1, 2) and response.data == b""


def test_computed_results_fuse_only_with_each_other():
    c = Coordinator(2, fusion_threshold=1 << 20)
    for rank in range(2):
        c.submit_many(
            [req(rank, "x"), req(rank, "y"), req(rank, "z")],
            riders=[f32(rank, 1, 2, 3), b"", f32(5, 5, 5, 5)],
        )
    fused = [(r.names, np.frombuffer(r.data, np.float32).tolist()) for r, _ in c.take()]
    assert fused == [(["x", "z"], [1, 2, 4, 6, 10, 10, 10, 10]), (["y"], [])]


def test_a_frame_of_riders_is_computed_together_bit_for_bit_as_one_at_a_time():
    # 3 ranks, one frame each of 40 small collectives: allreduces of several types, ops,
    # scalings and sizes (which share reductions by kind), a bfloat16 and a prescaled one
    # (computed alone), a broadcast, and one whose rider on rank 2 has the wrong size.
    rng = np.random.default_rng(7)
    kinds = [
        (DataType.FLOAT32, SUM, 1.0, 1.0), (DataType.FLOAT32, AVERAGE, 1.0, 1 / 3), (DataType.FLOAT16, MAX, 1.0, 1.0),
        (DataType.INT32, PRODUCT, 1.0, 1.0), (DataType.INT8, SUM, 1.0, 0.5), (DataType.FLOAT64, MIN, 1.0, 1.0),
        (DataType.BFLOAT16, SUM, 1.0, 1.0), (DataType.FLOAT32, SUM, 2.0, 1.0),
    ]  # fmt: skip
    names, requests, data = [], {rank: [] for rank in range(3)}, {rank: [] for rank in range(3)}
    for index in range(40):
        dtype, op, prescale, postscale = kinds[index % len(kinds)]
        shape = (int(rng.integers(1, 9)),)
        name = f"t{index}"
        names.append(name)
        for rank in range(3):
            part = (rng.standard_normal(shape) * 4).astype(dtype.storage) if dtype.is_float and dtype != DataType.BFLOAT16 \
                else rng.integers(0, 9, shape).astype(dtype.storage)
            rider = part.tobytes()[:-1] if (index == 17 and rank == 2) else part.tobytes()
            requests[rank].append(req(rank, name, shape=shape, dtype=int(dtype), reduce_op=op, prescale=prescale, postscale=postscale))
            data[rank].append(rider)
    for rank in range(3):
        requests[rank].append(req(rank, "b", kind=RequestType.BROADCAST, shape=(2,), root_rank=1))
        data[rank].append(f32(7, 8) if rank == 1 else b"")
    together = Coordinator(3, fusion_threshold=0)
    for rank in range(3):
        together.submit_many(requests[rank], riders=data[rank])
    ridings = list(together._riding)
    assert len(ridings) == 41
    assert sum(_batch_key(*riding) is not None for riding in ridings) == 29  # 6 kinds of 8 share; t17 is alone
    results = {r.names[0]: r.data for r, _ in together.take()}
    alone = {riding[0].names[0]: computed_result(*riding) for riding in ridings}
    assert results == alone
    assert results["t17"] == b"" and results["b"] == f32(7, 8)
    assert all(results[name] for name in names if name != "t17")
    assert computed_results([]) == []


def _entry(name, kind, data, root_rank=0, error=""):
    request = Request(0, kind, name, shape=data.shape, dtype=F32, root_rank=root_rank, error=error)
    return Entry(request, DataType.FLOAT32, data, np.empty_like(data), Handle(name))


def test_a_rank_sends_small_allreduces_and_its_own_broadcasts_along_within_the_budget():
    ones = np.ones(600, np.float32)  # 2400 bytes
    entries = [
        _entry("a", RequestType.ALLREDUCE, ones),
        _entry("b", RequestType.BROADCAST, ones[:3], root_rank=1),  # not this rank's
        _entry("c", RequestType.BROADCAST, ones[:3]),
        _entry("d", RequestType.ALLREDUCE, ones),  # past the budget with "a" and "c"
        _entry("e", RequestType.ALLGATHER, ones[:1]),
        _entry("f", RequestType.ALLREDUCE, ones[:1], error="bad"),
        _entry("g", RequestType.ALLREDUCE, ones[:2]),
    ]
    assert [len(r) for r in riders(entries, 0, 4096)] == [2400, 0, 12, 0, 0, 0, 8]
    assert riders(entries, 0, 0) == []
    assert riders(entries[1:2] + entries[4:6], 0, 4096) == []  # nothing rides: no list at all


def test_a_response_with_data_completes_its_tensors_without_a_data_phase():
    queue = TensorQueue()
    x, y = _entry("x", RequestType.ALLREDUCE, np.zeros(2, np.float32)), _entry("y", RequestType.ALLREDUCE, np.zeros(3, np.float32))
    queue.add_many([x, y])

    def no_data_phase(ranks):
        raise AssertionError("a data phase ran")

    executor = Executor(0, ProcessSetTable(2), queue, no_data_phase)
    data = np.arange(5, dtype=np.float32)
    executor.run(Response(ResponseType.ALLREDUCE, ["x", "y"], dtype=F32, sizes=[2, 3], cache_ids=[4, 5], data=data.tobytes()))
    assert x.handle.wait().tolist() == [0, 1] and y.handle.wait().tolist() == [2, 3, 4]
    assert executor.cache.lookup(x.request) == 4  # what it learned, as from any response
