"""hora.mxnet's collectives at 1-3 ranks: every op and dtype, in place, process sets, errors on every rank.

These run in MXNet's own environment (.venv-mxnet, NumPy < 2: MXNet 1.9.1 does not run
on NumPy 2); `make test` runs them there after the main suite, and an interpreter
without mxnet does not collect them (tests/conftest.py). Each multi-rank test is one
job per world size: every rank runs all cases and returns the cases that disagree
with NumPy (empty when all agree).
"""

from __future__ import annotations

import warnings

import pytest

from mxnet_support import DTYPES, OPS, address, check, make, reduce_expected

import mxnet as mx  # noqa: E402  (after mxnet_support, which imports hora.mxnet first)
import numpy as np  # noqa: E402

from harness import run_ranks  # noqa: E402

SHAPES = [(), (5,), (17, 3), (2, 3, 4)]


def _cases(dtype: str) -> list[str]:
    return [op for op in OPS if not (dtype == "bool" and op == "Average")]


def collectives_job() -> list[str]:
    import hora.mxnet as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    ops = {name: getattr(hvd, name) for name in OPS}
    for dtype in DTYPES:
        # allreduce and allreduce_, every op and shape.
        for op in _cases(dtype):
            for salt, shape in enumerate(SHAPES):
                inputs = [make(dtype, r, shape, salt) for r in range(n)]
                want = reduce_expected(inputs, op)
                case = f"allreduce {dtype} {op} {shape}"
                tensor = mx.nd.array(inputs[me], dtype=dtype)
                got = hvd.allreduce(tensor, name=case, op=ops[op])
                check(case, got, want, problems)
                check(case + " (input kept)", tensor, inputs[me], problems)
                inplace = mx.nd.array(inputs[me], dtype=dtype)
                before = address(inplace)
                result = hvd.allreduce_(inplace, name=case + " in place", op=ops[op])
                if result is not inplace or address(inplace) != before:
                    problems.append(f"{case}: allreduce_ did not reduce into its input's memory")
                check(case + " in place", inplace, want, problems)
        # grouped_allreduce(_), Sum.
        op = "Sum"
        inputs = [[make(dtype, r, shape, 50 + i) for i, shape in enumerate(SHAPES)] for r in range(n)]
        wants = [reduce_expected([inputs[r][i] for r in range(n)], op) for i in range(len(SHAPES))]
        mine = [mx.nd.array(x, dtype=dtype) for x in inputs[me]]
        for i, got in enumerate(hvd.grouped_allreduce(mine, name=f"grouped {dtype}", op=hvd.Sum)):
            check(f"grouped_allreduce {dtype} #{i}", got, wants[i], problems)
        results = hvd.grouped_allreduce_(mine, name=f"grouped_ {dtype}", op=hvd.Sum)
        if any(a is not b for a, b in zip(results, mine)):
            problems.append(f"grouped_allreduce_ {dtype}: did not return its inputs")
        for i, tensor in enumerate(mine):
            check(f"grouped_allreduce_ {dtype} #{i}", tensor, wants[i], problems)
        # allgather: a first dimension that differs by rank.
        parts = [make(dtype, r, (r + 1, 3), 70) for r in range(n)]
        check(f"allgather {dtype}", hvd.allgather(mx.nd.array(parts[me], dtype=dtype), name=f"ag {dtype}"),
              np.concatenate(parts), problems)  # fmt: skip
        gathered = hvd.grouped_allgather(
            [mx.nd.array(parts[me], dtype=dtype), mx.nd.array(parts[me][:, :1], dtype=dtype)], name=f"gag {dtype}"
        )
        check(f"grouped_allgather {dtype} #0", gathered[0], np.concatenate(parts), problems)
        check(f"grouped_allgather {dtype} #1", gathered[1], np.concatenate([p[:, :1] for p in parts]), problems)
        # broadcast and broadcast_ from every root.
        for root in range(n):
            values = [make(dtype, r, (4, 2), 80 + root) for r in range(n)]
            tensor = mx.nd.array(values[me], dtype=dtype)
            check(f"broadcast {dtype} root {root}", hvd.broadcast(tensor, root, name=f"b {dtype} {root}"),
                  values[root], problems)  # fmt: skip
            check(f"broadcast {dtype} root {root} (input kept)", tensor, values[me], problems)
            before = address(tensor)
            if hvd.broadcast_(tensor, root, name=f"b_ {dtype} {root}") is not tensor or address(tensor) != before:
                problems.append(f"broadcast_ {dtype} root {root}: not into its input's memory")
            check(f"broadcast_ {dtype} root {root}", tensor, values[root], problems)
        # alltoall: rank r sends (r + d + 1) rows to rank d, and evenly without splits.
        rows = [[r + d + 1 for d in range(n)] for r in range(n)]
        sent = [make(dtype, r, (sum(rows[r]), 2), 90) for r in range(n)]
        got, received = hvd.alltoall(mx.nd.array(sent[me], dtype=dtype), splits=rows[me], name=f"a2a {dtype}")
        want = np.concatenate([np.split(sent[r], np.cumsum(rows[r])[:-1])[me] for r in range(n)])
        check(f"alltoall {dtype}", got, want, problems)
        check(f"alltoall {dtype} splits", received, np.array([rows[r][me] for r in range(n)], np.int32), problems)
        even = [make(dtype, r, (2 * n, 3), 95) for r in range(n)]
        got = hvd.alltoall(mx.nd.array(even[me], dtype=dtype), splits=None, name=f"a2a even {dtype}")
        check(f"alltoall even {dtype}", got, np.concatenate([even[r][2 * me : 2 * me + 2] for r in range(n)]), problems)
        got, _ = hvd.alltoall(mx.nd.array(even[me], dtype=dtype), splits=mx.nd.array([2] * n, dtype="int32"))
        check(f"alltoall NDArray splits {dtype}", got,
              np.concatenate([even[r][2 * me : 2 * me + 2] for r in range(n)]), problems)  # fmt: skip
        # reducescatter: 2n+1 rows, so the first rank gets one more.
        if dtype != "bool":
            for op in ("Sum", "Average"):
                inputs = [make(dtype, r, (2 * n + 1, 2), 99) for r in range(n)]
                full = reduce_expected(inputs, op)
                start = 2 * me + min(me, 1)
                mine_rows = full[start : start + 2 + (1 if me < 1 else 0)]
                got = hvd.reducescatter(mx.nd.array(inputs[me], dtype=dtype), op=ops[op], name=f"rs {dtype} {op}")
                check(f"reducescatter {dtype} {op}", got, mine_rows, problems)
            pair = hvd.grouped_reducescatter(
                [mx.nd.array(x, dtype=dtype) for x in (inputs[me], inputs[me][:, :1])], op=hvd.Sum, name=f"grs {dtype}"
            )
            full = reduce_expected(inputs, "Sum")
            check(f"grouped_reducescatter {dtype} #0", pair[0], full[start : start + len(mine_rows)], problems)
            check(f"grouped_reducescatter {dtype} #1", pair[1], full[start : start + len(mine_rows), :1], problems)
    # Scaling, Horovod's positional order, and the deprecated average argument.
    x = mx.nd.array(make("float32", me, (6,), 7))
    want = reduce_expected([make("float32", r, (6,), 7) for r in range(n)], "Sum") * 0.5 * 3
    check("prescale/postscale", hvd.allreduce(x, None, "scaled", 0, 0.5, 3.0, hvd.global_process_set, hvd.Sum),
          want.astype(np.float32), problems)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = hvd.allreduce(x, average=False, name="average=False")
    check("average=False", got, reduce_expected([make("float32", r, (6,), 7) for r in range(n)], "Sum"), problems)
    if not any(issubclass(w.category, DeprecationWarning) for w in caught):
        problems.append("average= did not warn that it is deprecated")
    if hvd.grouped_allreduce([]) != []:
        problems.append("grouped_allreduce([]) is not []")
    # Objects.
    if hvd.broadcast_object({"rank": me}, root_rank=n - 1) != {"rank": n - 1}:
        problems.append("broadcast_object")
    if hvd.allgather_object(("r", me)) != [("r", r) for r in range(n)]:
        problems.append("allgather_object")
    hvd.shutdown()
    return problems


@pytest.mark.ranks
@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_collective_and_dtype(size: int) -> None:
    for rank, problems in enumerate(run_ranks(size, collectives_job, timeout=240)):
        assert problems == [], f"rank {rank}: {problems}"


def engine_job() -> list[str]:
    """Collectives on NDArrays that MXNet's asynchronous engine is still computing or reading."""
    import hora.mxnet as hvd

    hvd.init()
    n = hvd.size()
    problems: list[str] = []
    a = mx.nd.ones((600, 600))
    for step in range(3):
        # The input is still being computed when allreduce_ is called: it must wait for it.
        product = mx.nd.dot(a, a) + step  # pushed, not done
        hvd.allreduce_(product, name=f"pending write {step}", op=hvd.Sum)
        check(f"step {step}: pending write", product, np.full((600, 600), (600.0 + step) * n, np.float32), [])
        if not np.allclose(product.asnumpy(), (600.0 + step) * n):
            problems.append(f"step {step}: allreduce_ read the input before MXNet finished writing it")
        # A pending reader of the input must see the old value, later operations the new one.
        source = mx.nd.dot(a, a)
        doubled = mx.nd.dot(source, a) * 2  # reads source, pushed before the in-place write
        hvd.broadcast_(source, root_rank=0, name=f"pending read {step}")
        after = source + 1  # pushed after: sees the broadcast value (the same on every rank here)
        if not np.allclose(doubled.asnumpy(), 600.0 * 600.0 * 2):
            problems.append(f"step {step}: broadcast_ wrote the input while MXNet was still reading it")
        if not np.allclose(after.asnumpy(), 601.0):
            problems.append(f"step {step}: an operation after broadcast_ did not see its result")
    # A temporary input (nothing else refers to it) lives until the collective is done.
    for i, shape in enumerate([(17,), (17, 17), (17, 17, 17)]):
        total = hvd.allreduce(mx.nd.ones(shape) * (i + 1), op=hvd.Sum, name=f"temporary {i}")
        if not np.allclose(total.asnumpy(), (i + 1) * n):
            problems.append(f"a temporary input of shape {shape} was not kept alive")
    hvd.shutdown()
    return problems


@pytest.mark.ranks
def test_mxnets_asynchronous_engine_is_respected() -> None:
    for rank, problems in enumerate(run_ranks(2, engine_job, timeout=120)):
        assert problems == [], f"rank {rank}: {problems}"


def process_set_job() -> list[str]:
    import hora.mxnet as hvd

    evens = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[evens])
    me = hvd.rank()
    problems: list[str] = []
    if me in (0, 2):
        x = mx.nd.array([float(me + 1)] * 3)
        check("set allreduce", hvd.allreduce(x, op=hvd.Sum, process_set=evens, name="s"),
              np.full(3, 4.0, np.float32), problems)  # fmt: skip
        hvd.allreduce_(x, process_set=evens, name="s_")
        check("set allreduce_ (Average over 2)", x, np.full(3, 2.0, np.float32), problems)
        check("set broadcast, global root 2", hvd.broadcast(mx.nd.array([me]), root_rank=2, process_set=evens),
              np.array([2.0], np.float32), problems)  # fmt: skip
        check("set allgather", hvd.allgather(mx.nd.array([me]), process_set=evens),
              np.array([0.0, 2.0], np.float32), problems)  # fmt: skip
        check("set reducescatter", hvd.reducescatter(mx.nd.array([1.0, 2.0]), op=hvd.Sum, process_set=evens),
              np.array([2.0 if me == 0 else 4.0], np.float32), problems)  # fmt: skip
    else:
        try:
            hvd.allreduce(mx.nd.ones(2), process_set=evens, name="outsider")
            problems.append("rank 1 ran a collective of a set it is not in")
        except ValueError:
            pass
    # A DistributedOptimizer over the even ranks: they step alike, rank 1 alone.
    optimizer = hvd.DistributedOptimizer(mx.optimizer.Test(learning_rate=10.0), process_set=evens)
    weight = hvd.broadcast(mx.nd.array(np.random.default_rng(0).uniform(size=(3, 10))), root_rank=0, name="w")
    grad = mx.nd.array(np.random.default_rng(1 + me).uniform(size=(3, 10)))
    optimizer.update(0, weight, grad, optimizer.create_state(0, weight))
    weights = hvd.allgather_object(weight.asnumpy())
    if not np.allclose(weights[0], weights[2]) or np.allclose(weights[0], weights[1]):
        problems.append("DistributedOptimizer(process_set=evens): ranks 0 and 2 should agree and rank 1 differ")
    check("global after sets", hvd.allreduce(mx.nd.ones(2), op=hvd.Sum, name="all"), np.full(2, 3.0, np.float32),
          problems)  # fmt: skip
    hvd.shutdown()
    return problems


@pytest.mark.ranks
def test_process_sets() -> None:
    for rank, problems in enumerate(run_ranks(3, process_set_job, timeout=90)):
        assert problems == [], f"rank {rank}: {problems}"


def mismatch_job() -> list[str]:
    import hora.mxnet as hvd

    hvd.init()
    me = hvd.rank()
    messages: list[str] = []
    calls = [
        # Disagreements only the coordinator sees.
        ("shape", lambda: hvd.allreduce(mx.nd.ones((3,) if me == 0 else (4,)), name="shape")),
        ("dtype", lambda: hvd.allreduce(mx.nd.ones(3, dtype="float32" if me == 0 else "float64"), name="dtype")),
        ("op", lambda: hvd.allreduce(mx.nd.ones(3), name="op", op=hvd.Sum if me == 0 else hvd.Max)),
        ("allgather", lambda: hvd.allgather(mx.nd.ones((2, 3 if me == 0 else 4)), name="ag")),
        ("root", lambda: hvd.broadcast(mx.nd.ones(2), root_rank=me, name="root")),
        # A check that fails on rank 1 only reaches rank 0 too.
        ("local", lambda: hvd.allreduce(
            mx.nd.ones(2) if me == 0 else mx.nd.ones(2, dtype="float32").tostype("row_sparse"), name="local")),
        ("splits", lambda: hvd.alltoall(mx.nd.ones(4), splits=[2, 2] if me == 0 else [5, 0], name="splits")),
        ("float splits", lambda: hvd.alltoall(mx.nd.ones(4), splits=mx.nd.array([2, 2]), name="float splits")),
    ]  # fmt: skip
    for what, call in calls:
        try:
            call()
            messages.append(f"{what}: no error")
        except Exception as exc:  # noqa: BLE001 - the test reports the class and message
            # Horovod's MXNet ops raise MXNetError: hora's errors are ones too.
            horovods = "" if isinstance(exc, mx.base.MXNetError) else " (not an MXNetError)"
            messages.append(f"{what}: {type(exc).__name__}{horovods}: {exc}")
    check("after the errors", hvd.allreduce(mx.nd.ones(2), op=hvd.Sum, name="after"),
          np.full(2, 2.0, np.float32), messages)  # fmt: skip
    hvd.shutdown()
    return messages


@pytest.mark.ranks
def test_mismatches_raise_on_every_rank() -> None:
    results = run_ranks(2, mismatch_job, timeout=90)
    for rank, messages in enumerate(results):
        by_what = dict(m.split(": ", 1) for m in messages)
        assert "no error" not in by_what.values(), (rank, messages)
        assert not [m for m in messages if "(not an MXNetError)" in m], messages
        assert by_what["shape"].startswith("MismatchError"), messages
        assert "shape" in by_what and "rank 0" in by_what["shape"] and "rank 1" in by_what["shape"], messages
        assert "(3,)" in by_what["shape"] and "(4,)" in by_what["shape"], messages
        assert "float32" in by_what["dtype"] and "float64" in by_what["dtype"], messages
        assert "row_sparse" in by_what["local"] and "splits" in by_what["splits"], messages
        if rank == 0:  # rank 1's local error reaches rank 0, naming rank 1
            assert "rank 1" in by_what["local"] and "rank 1" in by_what["splits"], messages
        assert "int32 NDArray" in by_what["float splits"], messages
        assert len(messages) == 8, messages  # "after the errors" worked: nothing appended


# ----- one process: staging and the NumPy aliases -----


def test_numpy_aliases_restored_only_where_missing() -> None:
    from hora.mxnet import numpy_compat

    assert np.bool is bool and np.int is int and np.object is object  # restored when hora.mxnet was imported
    assert numpy_compat.restore() == []  # the second time: nothing missing
    assert np.bool_ is not bool  # NumPy's own names untouched


def test_staging_is_zero_copy_and_waits(fresh: None) -> None:
    from hora.mxnet import tensors

    x = mx.nd.arange(12).reshape(3, 4)
    staged = tensors.stage(x, writable=True, what="allreduce 'x'")
    assert staged.wire.data.ctypes.data == address(x) and staged.wire.shape == (3, 4)
    staged.wire.data[:] = 7  # the core's writes land in the NDArray
    assert (x.asnumpy() == 7).all()
    tail = x[1:]  # a view: its own address, inside x
    assert tensors.stage(tail, writable=True, what="t").wire.data.ctypes.data == address(x) + 16
    read = tensors.stage(x, writable=False, what="r").wire.data
    assert not read.flags.writeable
    result = tensors.from_numpy(np.arange(4, dtype=np.float32))
    assert result.asnumpy().tolist() == [0, 1, 2, 3]
    assert tensors.from_numpy(np.arange(3, dtype=np.int8)).dtype == np.int8  # copied: from_numpy refuses int8
    bfloat16 = np.dtype([("bfloat16", np.uint16)])  # how MXNet 1.9 spells it; Horovod does not move it either
    with pytest.raises(ValueError, match="bfloat16.*is not supported"):
        tensors.stage(mx.nd.zeros(2, dtype=bfloat16), writable=False, what="allreduce 'bf16'")
    with pytest.raises(ValueError, match="needs an mxnet NDArray"):
        tensors.stage(np.ones(2), writable=False, what="allreduce 'np'")


def test_one_rank_collectives_and_trainer(fresh: None) -> None:
    import hora.mxnet as hvd

    hvd.init()
    x = mx.nd.array([1.0, 2.0])
    assert hvd.allreduce(x).asnumpy().tolist() == [1.0, 2.0]
    assert hvd.allreduce_(x, op=hvd.Sum) is x
    net = mx.gluon.nn.Dense(2, in_units=2)
    net.initialize()
    hvd.broadcast_parameters(net.collect_params())  # size 1: nothing to do
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    with mx.autograd.record():
        loss = net(mx.nd.ones((1, 2))).sum()
    loss.backward()
    trainer.step(1)
    with pytest.warns(UserWarning, match="unwrapped"):
        hvd.DistributedTrainer(net.collect_params(), hvd.DistributedOptimizer(mx.optimizer.SGD()))
    with pytest.raises(ValueError, match="prefix"):
        hvd.DistributedTrainer(net.collect_params(), "sgd", prefix=3)  # type: ignore[arg-type]


def killed_rank_job() -> str:
    """Rank 1 is SIGKILLed while rank 0 trains with DistributedTrainer: rank 0 must raise, not hang."""
    import os
    import signal
    import time

    import hora.mxnet as hvd

    hvd.init()
    net = mx.gluon.nn.Dense(8, in_units=8)
    net.initialize()
    hvd.broadcast_parameters(net.collect_params())
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01})
    if hvd.rank() == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(100000):
            with mx.autograd.record():
                loss = net(mx.nd.ones((2, 8))).sum()
            loss.backward()
            trainer.step(2)
    except hvd.HorovodInternalError as exc:
        return str(exc)
    return "no error"


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_a_killed_rank_makes_the_trainer_raise_not_hang() -> None:
    results = run_ranks(2, killed_rank_job, timeout=100, check=False)
    assert results[1].returncode == -9
    assert results[0].returncode == 0, results[0].output + (results[0].error or "")
    assert "rank 1" in results[0].value and "was lost" in results[0].value, results[0].value
