"""hora.jax at 1-3 ranks: every op eager and under ``jax.jit``, gradients, the optimizer.

* Every collective, eagerly and inside ``jit``, for float16/bfloat16/float32/float64 and
  int32/int64, against the same computation done with NumPy on every rank's inputs.
* Allreduce and broadcast inside ``jit`` reduce in the buffers XLA hands over, and an
  input the program still reads is left intact.
* A ``jit`` program of many independent collectives (no data dependencies between them,
  each its own shape, so a swapped name cannot pass), run many times: every run equals
  the eager results; also through the ``io_callback`` fallback.
* Gradients of every differentiable op, eagerly and under ``jit``, against central
  differences of the loss summed over the ranks (averaged for allgather and broadcast,
  as Horovod's gradients define them), computed with collectives.
* ``DistributedOptimizer``: training on N ranks, each on its shard of the batch, equals
  single-process training on the whole batch (also grouped, with fp16 compression
  (approximately), with ``backward_passes_per_step``, and with Sum).
* A check that fails on one rank while tracing fails the collective on every rank.
* A rank killed or frozen while the others run a compiled program's collectives: each
  survivor's program fails (``JaxRuntimeError`` carrying hora's error, which names the
  rank), none hangs.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from harness import freeze, run_ranks

pytestmark = pytest.mark.ranks

JAX_ENV = {"OMP_NUM_THREADS": "1", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]
JIT_RUNS = 30


def start(process_sets: Any = None) -> tuple[Any, Any, Any]:
    """Imports JAX with float64 on, starts hora; returns (jax, jnp, hvd)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    import hora.jax as hvd

    hvd.init(process_sets=process_sets)
    return jax, jnp, hvd


def _np_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _input(rank: int, rows: int, dtype: str) -> np.ndarray:
    return ((np.arange(rows * 3).reshape(rows, 3) % 7) + rank + 1).astype(_np_dtype(dtype))


def _close(got: Any, want: np.ndarray, dtype: str) -> bool:
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    tol = {"float16": 1e-2, "bfloat16": 5e-2}.get(dtype, 1e-6)
    return got.shape == want.shape and np.allclose(got, want, rtol=tol, atol=tol)


def ops_job() -> list[str]:
    jax, jnp, hvd = start()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []

    for dtype in DTYPES:
        rows = 2 * n
        everyone = [_input(r, rows, dtype) for r in range(n)]
        x = jnp.asarray(everyone[me])
        wide = [e.astype(np.float64) for e in everyone]
        total = sum(wide)
        q = rows // n
        want = {
            "sum": total,
            "avg": total / n,
            "max": np.max(wide, axis=0),
            "scaled": total * 0.5 * 3.0,
            "gather": np.concatenate(wide),
            "bcast": wide[n - 1],
            "a2a": np.concatenate([w[me * q : (me + 1) * q] for w in wide]),
            "rs": total[me * q : (me + 1) * q],
            "g0": total,
            "g1": 2 * total,
        }
        floating = dtype.startswith(("float", "bfloat"))

        def program(x: Any) -> dict[str, Any]:
            g0, g1 = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum)
            out = {
                "sum": hvd.allreduce(x, op=hvd.Sum),
                "max": hvd.allreduce(x, op=hvd.Max),
                "gather": hvd.allgather(x),
                "bcast": hvd.broadcast(x, root_rank=n - 1),
                "a2a": hvd.alltoall(x),
                "rs": hvd.reducescatter(x, op=hvd.Sum),
                "g0": g0,
                "g1": g1,
            }
            if floating:  # integers are scaled with truncation (the core's rule, tested there)
                out["avg"] = hvd.allreduce(x)
                out["scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
            return out

        jitted = jax.jit(program)
        for mode, fn in (("eager", program), ("jit", jitted), ("jit again", jitted)):
            got = fn(x)
            for key, value in got.items():
                if value.dtype != x.dtype:
                    problems.append(f"{mode} {dtype} {key}: dtype {value.dtype}")
                if not _close(value, want[key], dtype):
                    problems.append(f"{mode} {dtype} {key}: got {np.asarray(value).tolist()} want {want[key].tolist()}")

    # Eager only: a different first dimension per rank, alltoall with splits.
    y = jnp.ones((me + 1, 2), jnp.float32) * me
    gathered = hvd.allgather(y)
    if np.asarray(gathered).tolist() != [[r, r] for r in range(n) for _ in range(r + 1)]:
        problems.append(f"uneven allgather: {gathered}")
    splits = [1] * n
    rows_out, received = hvd.alltoall(jnp.arange(n, dtype=jnp.int32) + 10 * me, splits=splits)
    if np.asarray(rows_out).tolist() != [10 * r + me for r in range(n)] or np.asarray(received).tolist() != [1] * n:
        problems.append(f"alltoall with splits: {rows_out} {received}")

    # Objects, barrier, parameters.
    if hvd.broadcast_object({"me": me} if me == 0 else None, root_rank=0) != {"me": 0}:
        problems.append("broadcast_object")
    if hvd.allgather_object(me * 2) != [r * 2 for r in range(n)]:
        problems.append("allgather_object")
    hvd.barrier()
    params = {"w": jnp.full((2, 2), float(me)), "b": [jnp.arange(3) + me, 7]}
    got = hvd.broadcast_parameters(params, root_rank=n - 1)
    if np.asarray(got["w"]).tolist() != [[n - 1.0] * 2] * 2 or np.asarray(got["b"][0]).tolist() != [n - 1, n, n + 1]:
        problems.append(f"broadcast_parameters: {got}")
    jit_got = jax.jit(lambda p: hvd.broadcast_parameters(p, root_rank=0))({"w": params["w"]})
    if np.asarray(jit_got["w"]).tolist() != [[0.0] * 2] * 2:
        problems.append(f"broadcast_parameters in jit: {jit_got}")
    fp16 = hvd.allreduce(jnp.full(4, 1.5 + me, jnp.float32), op=hvd.Sum, compression=hvd.Compression.fp16)
    if fp16.dtype != jnp.float32 or not np.allclose(fp16, sum(1.5 + r for r in range(n))):
        problems.append(f"fp16 compression: {fp16}")
    hvd.shutdown()
    return problems


@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_op_eager_and_jit(size: int) -> None:
    results = run_ranks(size, ops_job, timeout=300, env=JAX_ENV)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:30])


def independent_job(runs: int, io_callback: bool) -> list[str]:
    """Many independent collectives in one jit, run many times, against eager; with
    ``io_callback``, through the fallback for a JAX without what ``hora.jax.ffi`` uses."""
    jax, jnp, hvd = start()
    if io_callback:
        from hora.jax import ffi

        ffi.HostCalls.create = staticmethod(lambda: None)  # as on a JAX without the FFI pieces hora uses
    n, me = hvd.size(), hvd.rank()

    def program(xs: list[Any]) -> list[Any]:
        outs = [hvd.allreduce(xs[0]), hvd.allreduce(xs[1], op=hvd.Sum), hvd.broadcast(xs[2], root_rank=n - 1)]
        outs += hvd.grouped_allreduce([xs[3], xs[4]], op=hvd.Max)
        outs.append(hvd.allgather(xs[5]))
        outs += hvd.grouped_allgather([xs[6], xs[7]])
        outs.append(hvd.reducescatter(xs[8], op=hvd.Sum))
        outs.append(hvd.alltoall(xs[9]))
        outs += [hvd.allreduce(x, op=hvd.Sum) for x in xs[10:]]  # one line, many tensors
        return outs

    problems: list[str] = []
    jitted = jax.jit(program)
    for run in range(runs):
        rows = [4 * n if i == 9 else i + 1 for i in range(14)]  # alltoall splits evenly
        xs = [jnp.asarray(np.full((rows[i], 2 * n), float(i + run + me), np.float32)) for i in range(14)]
        want = program(xs)  # eager: program order, numbered names
        got = jitted(xs)
        for i, (g, w) in enumerate(zip(got, want)):
            if g.shape != w.shape or not np.allclose(g, w):
                problems.append(f"run {run} output {i}: jit {np.asarray(g).tolist()} eager {np.asarray(w).tolist()}")
    hvd.shutdown()
    return problems


@pytest.mark.parametrize(("size", "io_callback"), [(2, False), (3, False), (2, True)])
def test_independent_collectives_in_one_jit(size: int, io_callback: bool) -> None:
    results = run_ranks(size, independent_job, JIT_RUNS, io_callback, timeout=300, env=JAX_ENV)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:30])


def in_place_job() -> list[str]:
    """Allreduce and broadcast inside jit may get an input's buffer as their output's:
    an input the program reads again stays intact (XLA copies it first), one it does
    not is reduced in place, a donated argument too."""
    jax, jnp, hvd = start()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []

    @jax.jit
    def program(x: Any, ys: list[Any]) -> tuple[Any, ...]:
        total = hvd.allreduce(x, op=hvd.Sum)
        # Computed here and dead after: XLA hands their buffers over. Over 16 KiB in all,
        # so shared memory reduces them in shares, each rank reducing its own in place.
        grouped = hvd.grouped_allreduce([y * 2 for y in ys], op=hvd.Sum, prescale_factor=0.5)
        averaged = hvd.grouped_allreduce([y + 1 for y in ys])
        root = hvd.broadcast(x, root_rank=n - 1)
        return x, total, grouped, averaged, root, x + 1

    base = np.arange(12000, dtype=np.float32)
    for run in range(3):
        x = jnp.asarray(base + me + run)
        ys = [jnp.full((5000 + i,), float(me + i + run), jnp.float32) for i in range(3)]
        x_out, total, grouped, averaged, root, x1 = program(x, ys)
        expect = {
            "x": (x_out, base + me + run),
            "sum": (total, sum(base + r + run for r in range(n))),
            "root": (root, base + n - 1 + run),
            "x + 1": (x1, base + me + run + 1),
        }
        for i in range(3):
            values = [float(r + i + run) for r in range(n)]
            expect[f"grouped {i}"] = (grouped[i], np.full(5000 + i, sum(values), np.float32))
            expect[f"averaged {i}"] = (averaged[i], np.full(5000 + i, sum(values) / n + 1, np.float32))
        for what, (got, want) in expect.items():
            if not np.allclose(np.asarray(got), want):
                got_head, want_head = np.asarray(got)[:4].tolist(), np.asarray(want)[:4].tolist()
                problems.append(f"run {run} {what}: {got_head} want {want_head}")
        if not np.array_equal(np.asarray(x), base + me + run):
            problems.append(f"run {run}: the input changed to {np.asarray(x)[:4].tolist()}")
    donated = jax.jit(lambda v: hvd.allreduce(v, op=hvd.Sum), donate_argnums=0)
    got = donated(jnp.full((9000,), float(me + 1), jnp.float32))
    if not np.allclose(np.asarray(got), n * (n + 1) / 2):
        problems.append(f"donated: {np.asarray(got)[:4].tolist()}")
    hvd.shutdown()
    return problems


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_in_jit_reduce_in_place_and_keep_live_inputs(size: int) -> None:
    results = run_ranks(size, in_place_job, timeout=300, env=JAX_ENV)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:30])


def gradients_job() -> list[str]:
    """Every differentiable op's gradient against central differences over the ranks."""
    jax, jnp, hvd = start()
    n, me = hvd.size(), hvd.rank()
    rng = np.random.default_rng(me)
    x0 = jnp.asarray(rng.normal(size=(n, 2)))
    weight = float(me + 1)

    # (op name, function of x, how Horovod's gradient combines the ranks' losses)
    cases = [
        ("allreduce avg", lambda x: hvd.allreduce(x), "sum"),
        ("allreduce sum scaled", lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5), "sum"),
        ("allreduce max", lambda x: hvd.allreduce(x, op=hvd.Max), "sum"),
        ("allreduce product", lambda x: hvd.allreduce(x, op=hvd.Product), "sum"),
        ("grouped_allreduce", lambda x: hvd.grouped_allreduce([x, x * x], op=hvd.Sum)[1], "sum"),
        ("allgather", lambda x: hvd.allgather(x), "mean"),
        ("broadcast", lambda x: hvd.broadcast(x, root_rank=n - 1), "mean"),
        ("alltoall", lambda x: hvd.alltoall(x), "sum"),
        # Horovod's reducescatter gradient is n times the sum's (allgather, times n for Sum)
        ("reducescatter avg", lambda x: hvd.reducescatter(x), "n * sum"),
        ("reducescatter sum", lambda x: hvd.reducescatter(x, op=hvd.Sum), "n * sum"),
    ]
    problems: list[str] = []
    for label, fn, combine in cases:

        def loss(x: Any, fn: Any = fn) -> Any:
            y = fn(x)
            return jnp.sum(jnp.sin(y) * weight)

        def total(x: Any, loss: Any = loss, combine: str = combine) -> float:
            value = hvd.allreduce(loss(x), op=hvd.Average if combine == "mean" else hvd.Sum)
            return float(value) * (n if combine == "n * sum" else 1)

        numeric = np.zeros(x0.shape)
        h = 1e-6
        for q in range(n):
            for j in range(x0.size):
                step = np.zeros(x0.size)
                if me == q:
                    step[j] = h
                shift = jnp.asarray(step.reshape(x0.shape))
                diff = (total(x0 + shift) - total(x0 - shift)) / (2 * h)
                if me == q:
                    numeric.flat[j] = diff
        for mode, grad in (("eager", jax.grad(loss)), ("jit", jax.jit(jax.grad(loss)))):
            got = np.asarray(grad(x0))
            if not np.allclose(got, numeric, rtol=1e-4, atol=1e-6):
                problems.append(f"{mode} {label}: got {got.tolist()} numeric {numeric.tolist()}")
    hvd.shutdown()
    return problems


@pytest.mark.parametrize("size", [2, 3])
def test_gradients_match_central_differences(size: int) -> None:
    results = run_ranks(size, gradients_job, timeout=400, env=JAX_ENV)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:30])


def training_job() -> list[str]:
    """N ranks on shards == one process on the whole batch."""
    jax, jnp, hvd = start()
    import optax

    n, me = hvd.size(), hvd.rank()
    rng = np.random.default_rng(0)
    features = rng.normal(size=(8 * n, 5))
    targets = features @ rng.normal(size=(5, 3)) + 0.1 * rng.normal(size=(8 * n, 3))
    mine = slice(me * 8, (me + 1) * 8)

    def init_params() -> dict[str, Any]:
        keys = jax.random.split(jax.random.PRNGKey(1), 2)
        return {
            "hidden": {"w": jax.random.normal(keys[0], (5, 16)) * 0.3, "b": jnp.zeros(16)},
            "out": {"w": jax.random.normal(keys[1], (16, 3)) * 0.3, "b": jnp.zeros(3)},
        }

    def loss(params: Any, x: Any, y: Any) -> Any:
        h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
        return jnp.mean((h @ params["out"]["w"] + params["out"]["b"] - y) ** 2)

    def train(tx: Any, x: Any, y: Any, steps: int, jit: bool) -> Any:
        params = init_params()
        state = tx.init(params)

        def step(params: Any, state: Any, x: Any, y: Any) -> Any:
            grads = jax.grad(loss)(params, x, y)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        run = jax.jit(step) if jit else step
        for _ in range(steps):
            params, state = run(params, state, x, y)
        return params

    problems: list[str] = []
    variants = [
        ("adam", dict(), optax.adam(0.05), 1e-7),
        ("sgd grouped, predivided", dict(num_groups=2, gradient_predivide_factor=2.0), optax.sgd(0.1), 1e-7),
        ("sgd fp16", dict(compression=hvd.Compression.fp16), optax.sgd(0.1), 2e-3),
        ("sgd 2 passes", dict(backward_passes_per_step=2), optax.sgd(0.1), 1e-7),
    ]
    for label, kwargs, inner, tol in variants:
        for jit in (True, False) if label == "adam" else (True,):  # eager steps are slow to dispatch
            distributed = hvd.DistributedOptimizer(inner, **kwargs)
            got = train(distributed, features[mine], targets[mine], 6, jit)
            single = inner if kwargs.get("backward_passes_per_step", 1) == 1 else optax.MultiSteps(inner, 2)
            want = train(single, features, targets, 6, jit)
            for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
                if not np.allclose(g, w, rtol=tol, atol=tol):
                    problems.append(f"{label} jit={jit}: max difference {float(np.max(np.abs(g - w)))}")
                    break
    # Sum: the summed gradient of n shards is n times the whole batch's mean gradient.
    got = train(hvd.DistributedOptimizer(optax.sgd(0.1 / n), op=hvd.Sum), features[mine], targets[mine], 4, True)
    want = train(optax.sgd(0.1), features, targets, 4, True)
    if not all(np.allclose(g, w, atol=1e-7) for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))):
        problems.append("op=Sum differs from the whole batch")
    hvd.shutdown()
    return problems


@pytest.mark.parametrize("size", [2, 3])  # 1 rank: the ops test covers a set of one
def test_distributed_optimizer_equals_whole_batch(size: int) -> None:
    results = run_ranks(size, training_job, timeout=400, env=JAX_ENV)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:30])


def process_set_and_refusal_job() -> list[str]:
    """A process set eager and in jit; a dtype only rank 0 cannot move fails every rank."""
    from hora.core.process_sets import ProcessSet

    pair = ProcessSet([0, 1])
    jax, jnp, hvd = start(process_sets=[pair])
    me = hvd.rank()
    problems: list[str] = []
    if me in (0, 1):
        x = jnp.full(3, float(me + 1))
        for fn in (lambda x: hvd.allreduce(x, op=hvd.Sum, process_set=pair), jax.jit(
            lambda x: hvd.allreduce(x, op=hvd.Sum, process_set=pair)
        )):
            if np.asarray(fn(x)).tolist() != [3.0] * 3:
                problems.append(f"process set allreduce: {fn(x)}")
    hvd.barrier()
    # While tracing, rank 0 has a complex input (not movable): every rank must fail, inside
    # jit and under jax.grad without jit (where the others run the call at once, concrete).
    dtype = jnp.complex64 if me == 0 else jnp.float32
    traced = {
        "jit": lambda: jax.jit(lambda x: hvd.allreduce(x))(jnp.ones(2, dtype)),
        "grad": lambda: jax.grad(lambda x: jnp.real(hvd.allreduce(x.astype(dtype))).sum())(jnp.ones(2)),
    }
    for mode, call in traced.items():
        try:
            call()
            problems.append(f"{mode}: a dtype refused on rank 0 did not fail this rank")
        except Exception as exc:  # noqa: BLE001 - rank 0: ValueError at trace; others: when run
            if "rank 0" not in str(exc) and me != 0:
                problems.append(f"{mode}: the error does not name rank 0: {exc}")
        hvd.barrier()
    if float(hvd.allreduce(jnp.ones(()), op=hvd.Sum)) != hvd.size():
        problems.append("the job did not go on after the refusal")
    hvd.shutdown()
    return problems


def test_process_set_and_refusal_while_tracing() -> None:
    results = run_ranks(3, process_set_and_refusal_job, timeout=300, env=JAX_ENV)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:30])


def lost_rank_in_jit_job(victim: int, frozen: bool) -> str:
    import os
    import signal
    import time

    jax, jnp, hvd = start()
    xs = [jnp.ones((512, 512), jnp.float32), jnp.ones(1000, jnp.float32)]  # 1 MiB: by id, then a data phase
    step = jax.jit(lambda *xs: hvd.grouped_allreduce([x * 1.5 for x in xs], op=hvd.Sum))
    jax.block_until_ready(step(*xs))  # compiled, negotiated and cached on every rank
    if hvd.rank() == victim:
        time.sleep(0.3)  # the others are most likely inside the program by then
        if frozen:
            freeze(-12.0)  # for good: a helper kills it after the others are done
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(100000):
            jax.block_until_ready(step(*xs))
    except Exception as exc:  # noqa: BLE001 - the test reads its class and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("frozen", [False, True], ids=["killed", "frozen"])
@pytest.mark.timeout(120)
def test_a_rank_lost_inside_jit_fails_every_survivors_program(frozen: bool) -> None:
    env = {**JAX_ENV, "HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    results = run_ranks(3, lost_rank_in_jit_job, 2, frozen, env=env, check=False, launcher="torchrun", timeout=90)
    for result in results[:2]:
        assert result.returncode == 0, result.output + (result.error or "")
        message = result.value
        assert message.startswith("JaxRuntimeError: ") and "HoraInternalError: grouped_allreduce" in message, message
        if frozen:  # the negotiation's stall report or the data phase's probe names it
            assert re.search(r"Missing ranks:\n2: |rank\(s\) 2(, which stopped| stopped) making progress", message), message
        else:
            assert "rank 2 on host" in message and "was lost" in message, message
