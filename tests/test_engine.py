"""The engine under real use: threads, any submission order, fusion, join, lifecycle, idle CPU."""

from __future__ import annotations

import numpy as np
import pytest

from harness import run_ranks

pytestmark = pytest.mark.ranks


def threads_job() -> list[str]:
    import random
    import threading

    import hora.numpy as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    names = [f"t{t}-{i}" for t in range(4) for i in range(25)]
    random.Random(me).shuffle(names)  # every rank submits in a different order
    chunks = [names[i::4] for i in range(4)]

    def worker(chunk: list[str]) -> None:
        handles = []
        for name in chunk:
            value = float(sum(map(ord, name)))
            handles.append((name, value, hvd.allreduce_async(np.full(7, value * (me + 1)), name=name, op=hvd.Sum)))
        for name, value, handle in reversed(handles):  # waited in yet another order
            got = hvd.synchronize(handle)
            if not np.array_equal(got, np.full(7, value * n * (n + 1) / 2)):
                problems.append(f"{name}: {got[:2]}")

    threads = [threading.Thread(target=worker, args=(chunk,)) for chunk in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hvd.shutdown()
    return problems


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.timeout(120)
def test_threads_and_any_submission_order(size):
    assert run_ranks(size, threads_job) == [[]] * size


def many_small_job() -> list[np.ndarray]:
    import hora.numpy as hvd

    hvd.init()
    me = hvd.rank()
    values = np.random.default_rng(me)
    sizes = np.random.default_rng(0).integers(1, 40, size=300)  # the same on every rank
    dtypes = [np.float32, np.float64, np.int32, np.float16]
    tensors = [values.integers(-8, 8, size=sizes[i]).astype(dtypes[i % 4]) for i in range(300)]
    handles = [hvd.allreduce_async(t, name=f"small{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
    results = [hvd.synchronize(h) for h in handles]
    grouped = hvd.grouped_allreduce(tensors[:50], name="grouped", op=hvd.Sum)
    hvd.shutdown()
    return results + grouped


@pytest.mark.timeout(120)
def test_fusion_gives_the_same_results_as_no_fusion():
    fused = run_ranks(3, many_small_job)
    unfused = run_ranks(3, many_small_job, env={"HORA_FUSION_THRESHOLD": "0"})
    tiny = run_ranks(3, many_small_job, env={"HORA_FUSION_THRESHOLD": "64"})
    for rank in range(3):
        for a, b, c in zip(fused[rank], unfused[rank], tiny[rank]):
            assert a.dtype == b.dtype == c.dtype and np.array_equal(a, b) and np.array_equal(a, c)
    # and they are right: every rank agrees, and the sums are exact for these small integers
    for a, b in zip(fused[0], fused[2]):
        assert np.array_equal(a, b)


def packed_job() -> list[str]:
    """Fused allreduces larger than a staging half: packed straight into shared memory."""
    import hora.numpy as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    lengths = [30_011 + 977 * i for i in range(12)]  # ~1.6 MB of float32: rounds end mid-tensor
    mine = [np.arange(k, dtype=np.float32) % 97 + me for k in lengths]
    base = [np.arange(k, dtype=np.float32) % 97 for k in lengths]
    got = hvd.grouped_allreduce(mine, op=hvd.Average, prescale_factor=2.0, postscale_factor=0.5, name="avg")
    for i, (g, b) in enumerate(zip(got, base)):
        want = (b * n + sum(range(n))) * 2.0 * 0.5 / n
        if not np.allclose(g, want, rtol=1e-6):
            problems.append(f"average {i}: {g[:3]} want {want[:3]}")
    in_place = [np.full(k, float(me + 1), dtype=np.float64) for k in lengths[:5]]
    hvd.grouped_allreduce_(in_place, op=hvd.Sum, name="in place")
    for i, t in enumerate(in_place):
        if not np.array_equal(t, np.full(t.size, n * (n + 1) / 2)):
            problems.append(f"in place {i}: {t[:3]}")
    # Uneven work: ranks that joined contribute zeros to the fused tensors of the others.
    for step in range(me + 1):
        got = hvd.grouped_allreduce([np.ones(k, dtype=np.float32) for k in lengths[:4]], op=hvd.Sum, name=f"j{step}")
        active = sum(1 for r in range(n) if r + 1 > step)
        if any(not np.array_equal(g, np.full(g.size, float(active))) for g in got):
            problems.append(f"joined step {step}: {[g[:2] for g in got]}")
    hvd.join()
    hvd.shutdown()
    return problems


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.timeout(120)
def test_fused_allreduce_packed_in_shared_memory(size):
    # Staging halves of 512 KiB: each fused response takes several rounds.
    results = run_ranks(size, packed_job, env={"HORA_SHM_STAGING_MB": "1"})
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems)


def bad_group_job() -> dict:
    import hora.numpy as hvd
    from hora.core.api import current

    hvd.init()
    error = ""
    if hvd.rank() == 0:
        try:  # the second tensor is refused (Average of bools): the first must not be queued either
            hvd.grouped_allreduce([np.ones(3), np.array([True])], name="bad")
        except ValueError as exc:
            error = str(exc)
    in_flight = len(current().engine.queue)
    after = hvd.grouped_allreduce([np.ones(2), np.full(3, 2.0)], op=hvd.Sum, name="good")
    hvd.shutdown()
    return {"error": error, "in_flight": in_flight, "after": [a.tolist() for a in after]}


@pytest.mark.timeout(60)
def test_a_refused_tensor_keeps_its_whole_group_out():
    results = run_ranks(2, bad_group_job)
    assert "Average is not defined for bool" in results[0]["error"]
    for result in results:
        assert result["in_flight"] == 0
        assert result["after"] == [[2.0, 2.0], [4.0, 4.0, 4.0]]


def join_job() -> dict:
    import hora.numpy as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    averages = []
    for step in range(me + 2):  # rank r has r + 2 batches: uneven work
        averages.append(hvd.allreduce(np.full(3, float(me + 1)), name=f"step{step}").tolist())
    last = hvd.join()
    after = hvd.allreduce(np.ones(2), op=hvd.Sum, name="after").tolist()  # usable after everyone joined
    hvd.shutdown()
    return {"averages": averages, "last": last, "after": after}


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.timeout(90)
def test_join_with_uneven_work(size):
    results = run_ranks(size, join_job)
    for rank, result in enumerate(results):
        assert result["last"] == size - 1
        assert result["after"] == [float(size)] * 2
        for step, avg in enumerate(result["averages"]):
            # ranks with fewer than step + 2 batches have joined and contribute zeros;
            # Average still divides by the full size, as in Horovod.
            active = [r for r in range(size) if r + 2 > step]
            assert avg == pytest.approx([sum(r + 1 for r in active) / size] * 3), (rank, step)


def join_refuses_other_ops_job() -> str:
    import hora.numpy as hvd

    hvd.init()
    if hvd.rank() == 0:
        hvd.join()
        return "joined"
    try:
        hvd.allgather(np.ones(1), name="gather")
        message = "no error"
    except hvd.CollectiveMismatchError as exc:
        message = str(exc)
    hvd.join()
    return message


@pytest.mark.timeout(60)
def test_join_refuses_everything_but_allreduce():
    results = run_ranks(2, join_refuses_other_ops_job)
    assert "rank(s) 0 have called join(); only allreduce may run" in results[1]


def leave_without_join_job() -> object:
    import hora.numpy as hvd

    hvd.init()
    if hvd.rank() == 0:
        last = hvd.join()  # the others end without joining
        try:
            hvd.allreduce(np.ones(1), name="after")
            return (last, "no error")
        except hvd.HoraInternalError as exc:
            return (last, str(exc))
    hvd.allreduce(np.ones(1), name="before")
    hvd.shutdown()
    return None


@pytest.mark.timeout(90)
def test_ranks_that_end_without_joining_release_a_join():
    results = run_ranks(3, leave_without_join_job)
    last, message = results[0]
    assert last == 0
    assert "cannot run" in message and "rank 1" in message and "rank 2" in message


def cycles_job() -> list[float]:
    import hora.numpy as hvd

    out = []
    for cycle in range(3):
        hvd.init()
        hvd.init()  # idempotent
        out.append(float(hvd.allreduce(np.array([cycle + 1.0]), op=hvd.Sum, name="x")[0]))
        hvd.shutdown()
        assert not hvd.is_initialized()
    return out


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.timeout(90)
def test_init_shutdown_cycles(size):
    assert run_ranks(size, cycles_job) == [[size * 1.0, size * 2.0, size * 3.0]] * size


def idle_cpu_job() -> float | None:
    import resource
    import time

    import hora.numpy as hvd

    hvd.init()
    if hvd.rank() == 1:
        time.sleep(4)
        hvd.allreduce(np.ones(1), name="late")
        hvd.shutdown()
        return None
    handle = hvd.allreduce_async(np.ones(1), name="late")
    before = resource.getrusage(resource.RUSAGE_SELF)
    hvd.synchronize(handle)  # blocks about 4 s waiting for rank 1
    after = resource.getrusage(resource.RUSAGE_SELF)
    hvd.shutdown()
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.timeout(60)
def test_a_waiting_rank_burns_no_cpu():
    cpu_seconds = run_ranks(2, idle_cpu_job)[0]
    # A spinning waiter would burn about 4 s; blocking on events costs milliseconds.
    assert cpu_seconds < 0.5, cpu_seconds


def no_waiter_job(flags: str) -> dict:
    import os
    import time

    import hora.numpy as hvd

    n = 3
    rest = hvd.ProcessSet(list(range(1, n)))
    hvd.init(process_sets=[rest])
    me = hvd.rank()
    out: dict = {}
    # A blocking collective ran on this thread just now, so the engine thread is parked;
    # it must still complete what nobody waits for.
    hvd.allreduce(np.ones(1), name="blocking")
    handle = hvd.allreduce_async(np.full(3, me + 1.0), name="async", op=hvd.Sum)
    deadline = time.monotonic() + 30
    while not hvd.poll(handle) and time.monotonic() < deadline:
        time.sleep(0.001)
    out["polled"] = hvd.poll(handle)
    out["async"] = hvd.synchronize(handle).tolist()
    hvd.allreduce(np.ones(1), name="blocking again")
    if me == 0:
        # Rank 0 makes no hora call until the others finished a collective that only its
        # coordinator (its engine thread) can let them run.
        deadline = time.monotonic() + 30
        while len(os.listdir(flags)) < n - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        out["served"] = sorted(os.listdir(flags))
    else:
        out["rest"] = hvd.allreduce(np.ones(2), name="without 0", op=hvd.Sum, process_set=rest).tolist()
        open(os.path.join(flags, str(me)), "w").close()
    hvd.shutdown()
    return out


@pytest.mark.timeout(90)
def test_the_engine_thread_completes_what_no_thread_waits_for(tmp_path):
    results = run_ranks(3, no_waiter_job, str(tmp_path))
    for out in results:
        assert out["polled"] is True
        assert out["async"] == [6.0, 6.0, 6.0]
    assert results[0]["served"] == ["1", "2"]
    assert results[1]["rest"] == results[2]["rest"] == [2.0, 2.0]


def crossing_waits_job() -> dict:
    import threading

    import hora.numpy as hvd

    hvd.init()
    out: dict = {}
    if hvd.rank() == 0:
        # Thread "x" waits for a collective that rank 1 starts only after "z", which this
        # rank's other thread submits only once its wait for "y" has returned. Waiting
        # threads must not hold each other up: "y" is done long before "x".
        handle = hvd.allreduce_async(np.ones(1), name="x", op=hvd.Sum)
        waiter = threading.Thread(target=lambda: out.__setitem__("x", hvd.synchronize(handle).tolist()))
        waiter.start()
        out["y"] = hvd.allreduce(np.ones(1), name="y", op=hvd.Sum).tolist()
        out["z"] = hvd.allreduce(np.ones(1), name="z", op=hvd.Sum).tolist()
        waiter.join()
    else:
        for name in ("y", "z", "x"):
            out[name] = hvd.allreduce(np.ones(1), name=name, op=hvd.Sum).tolist()
    hvd.shutdown()
    return out


@pytest.mark.timeout(60)
def test_threads_waiting_at_once_do_not_hold_each_other_up():
    for out in run_ranks(2, crossing_waits_job, timeout=40):
        assert out == {"x": [2.0], "y": [2.0], "z": [2.0]}


def shutdown_by_one_job(leaver: int) -> dict:
    import time

    import hora.numpy as hvd

    others = hvd.ProcessSet([r for r in range(4) if r != leaver])
    hvd.init(process_sets=[others])
    out: dict = {"together": hvd.allreduce(np.ones(1), op=hvd.Sum, name="together").tolist()}
    if hvd.rank() == leaver:
        time.sleep(0.3)
        hvd.shutdown()
        out["left"] = True
        return out
    pending = hvd.allreduce_async(np.ones(1), name="pending")  # the leaver never submits this
    try:
        hvd.synchronize(pending)
        out["pending"] = "no error"
    except hvd.HoraInternalError as exc:
        out["pending"] = str(exc)
    try:
        hvd.allreduce(np.ones(1), name="later")
        out["later"] = "no error"
    except hvd.HoraInternalError as exc:
        out["later"] = str(exc)
    # Collectives that do not need the rank that left go on.
    out["others"] = [hvd.allreduce(np.ones(1), op=hvd.Sum, name=f"o{i}", process_set=others).tolist() for i in range(3)]
    hvd.shutdown()
    return out


@pytest.mark.parametrize("leaver", [1, 0])
@pytest.mark.timeout(60)
def test_a_rank_that_shuts_down_leaves_and_the_others_go_on(leaver):
    results = run_ranks(4, shutdown_by_one_job, leaver)
    for rank, out in enumerate(results):
        assert out["together"] == [4.0]
        if rank == leaver:
            assert out["left"]
            continue
        for key in ("pending", "later"):
            assert f"in its process set, rank {leaver} on host" in out[key], out[key]
            assert "has shut down (it called shutdown())" in out[key], out[key]
        assert out["others"] == [[3.0]] * 3


def cache_job() -> list:
    import hora.numpy as hvd

    hvd.init()
    me = hvd.rank()
    out = []
    for step in range(5):  # the same tensors every step: negotiated by cache id after the first
        out.append(hvd.grouped_allreduce([np.full(3, me + step), np.full(2, 1.0)], name="grads", op=hvd.Sum))
    for _ in range(2):
        hvd.allreduce(np.ones(3), name="x", op=hvd.Sum)  # cached after the first time
    try:  # one rank changes the cached tensor's shape: the cache must not hide the mismatch
        hvd.allreduce(np.ones(4 if me == 1 else 3), name="x", op=hvd.Sum)
        out.append("no error")
    except hvd.CollectiveMismatchError as exc:
        out.append(str(exc))
    out.append(hvd.allreduce(np.ones(5), name="after", op=hvd.Sum))
    hvd.shutdown()
    return out


@pytest.mark.parametrize("capacity", ["1024", "0"])
@pytest.mark.timeout(60)
def test_response_cache_is_transparent(capacity):
    results = run_ranks(2, cache_job, env={"HORA_CACHE_CAPACITY": capacity})
    for out in results:
        for step in range(5):
            assert out[step][0].tolist() == [float(2 * step + 1)] * 3
            assert out[step][1].tolist() == [2.0, 2.0]
        assert "shapes differ across ranks: rank 0: (3,), rank 1: (4,)" in out[5]
        assert out[6].tolist() == [2.0] * 5


def caller_left_early_job() -> dict:
    import time

    import hora.numpy as hvd
    from hora.core.api import current

    hvd.init()
    me = hvd.rank()
    out: dict = {}
    # A kernel's block: its submits leave executing to this thread's own wait ...
    with current().caller_drives():
        out["driven"] = hvd.allreduce(np.full(2, me + 1.0), name="driven", op=hvd.Sum).tolist()
    # ... and when the block raises before it waits, the engine thread executes them.
    handle = None
    try:
        with current().caller_drives():
            handle = hvd.allreduce_async(np.full(3, me + 1.0), name="left", op=hvd.Sum)
            raise KeyError("the kernel failed before waiting")
    except KeyError:
        pass
    deadline = time.monotonic() + 20  # the stall check (60 s) would be the engine thread's next look
    while not hvd.poll(handle) and time.monotonic() < deadline:
        time.sleep(0.001)
    out["polled"] = hvd.poll(handle)
    out["left"] = hvd.synchronize(handle).tolist()
    hvd.shutdown()
    return out


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.timeout(90)
def test_a_caller_that_drives_its_own_submits_and_one_that_leaves_early(size):
    total = size * (size + 1) / 2
    for out in run_ranks(size, caller_left_early_job):
        assert out == {"driven": [total] * 2, "polled": True, "left": [total] * 3}


def burst_job(marker: str) -> dict:
    import os
    import threading
    import time

    import hora.numpy as hvd
    from hora.engine.control import ControlPlane

    announced: list[tuple[str, list[str]]] = []
    original = ControlPlane.announce

    def recording(self, entries):  # type: ignore[no-untyped-def]
        announced.append((threading.current_thread().name, [e.request.name for e in entries]))
        return original(self, entries)

    ControlPlane.announce = recording  # type: ignore[method-assign]
    hvd.init()
    me = hvd.rank()
    burst = [f"allreduce.b{i}" for i in range(20)]
    if me == 1:  # "first" stays in flight on rank 0 until rank 0 has submitted its burst
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
    handles = [hvd.allreduce_async(np.full(3, float(me + 1)), name="first", op=hvd.Sum)]
    for i, name in enumerate(burst):
        handles.append(hvd.allreduce_async(np.full(3, float(i * (me + 1))), name=name[len("allreduce."):], op=hvd.Sum))
    out: dict = {}
    if me == 0:
        main = threading.current_thread().name
        # Nothing waits for the burst yet: the engine thread announces it.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not set(burst) <= {n for _, names in announced for n in names}:
            time.sleep(0.01)
        out["first_by"] = [thread for thread, names in announced if "allreduce.first" in names]
        out["main"] = main
        out["burst_by"] = sorted({thread for thread, names in announced if set(names) & set(burst)})
        with open(marker, "w"):
            pass
    out["results"] = [hvd.synchronize(h).tolist() for h in handles]
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
def test_tensors_submitted_while_others_are_in_flight_are_announced_together_by_the_engine(tmp_path):
    """A burst of ``*_async`` calls (Horovod's gradient hooks): the first tensor is
    announced by the submitting thread at once; those submitted while it is in flight
    are left to the engine thread, which sends what gathered in one frame, rather than
    each call running a round of its own (Engine.submit_many)."""
    results = run_ranks(2, burst_job, str(tmp_path / "burst-submitted"))
    assert results[0]["first_by"] == [results[0]["main"]]
    assert results[0]["burst_by"] == ["hora-engine-0"]
    for out in results:
        assert out["results"] == [[3.0] * 3] + [[3.0 * i] * 3 for i in range(20)]
