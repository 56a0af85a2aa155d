"""hora.tensorflow's collectives at world sizes 1-3, eagerly and inside tf.function,
against NumPy on every rank's inputs; static shapes; mismatch and local errors.

TensorFlow takes seconds to import, so each test is one job per world size that runs
many cases and returns the list of cases that went wrong (empty when all agree).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from data import make, tolerance
from harness import run_ranks

pytestmark = pytest.mark.framework

SIZES = [1, 2, 3]
DTYPES = ["float16", "float32", "float64", "int32", "int64"]
# Quiet, single-threaded TensorFlow in every rank: the machines have 2 cores.
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


def start(process_sets: Any = None) -> tuple[Any, Any]:
    """Imports TensorFlow with one thread per pool, starts hora; returns (tf, hvd)."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.get_logger().setLevel("ERROR")  # no retracing warnings: the tests retrace on purpose
    import hora.tensorflow as hvd

    hvd.init(process_sets=process_sets)
    return tf, hvd


class Checks:
    """Collects what went wrong instead of stopping at the first failure."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def close(self, case: str, got: Any, want: Any, dtype: str | None = None, tol: float | None = None) -> None:
        got_np = np.asarray(got.numpy() if hasattr(got, "numpy") else got)
        want_np = np.asarray(want)
        if got_np.shape != want_np.shape:
            self.problems.append(f"{case}: shape {got_np.shape} != {want_np.shape}")
            return
        if dtype is not None and str(got_np.dtype) != dtype:
            self.problems.append(f"{case}: dtype {got_np.dtype} != {dtype}")
            return
        kind = got_np.dtype.kind
        if kind in "iub":
            ok = np.array_equal(got_np, want_np.astype(got_np.dtype))
        else:
            t = tol if tol is not None else (tolerance(got_np.dtype) if got_np.dtype.kind == "f" else 3e-2)
            ok = np.allclose(got_np.astype(np.float64), want_np.astype(np.float64), rtol=t, atol=t)
        if not ok:
            self.problems.append(f"{case}: got {got_np.reshape(-1)[:6]} want {want_np.reshape(-1)[:6]}")

    def that(self, case: str, ok: bool, detail: str = "") -> None:
        if not ok:
            self.problems.append(f"{case}: {detail}")

    def raises(self, case: str, fn: Callable[[], Any], kind: Any, *fragments: str) -> None:
        try:
            fn()
        except kind as exc:
            missing = [f for f in fragments if f not in str(exc)]
            if missing:
                self.problems.append(f"{case}: message lacks {missing}: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - reported
            self.problems.append(f"{case}: raised {type(exc).__name__}: {exc}")
            return
        self.problems.append(f"{case}: did not raise")


def _reduce(stack: np.ndarray, op: str, kind: str) -> np.ndarray:
    if op == "Average":
        total = stack.sum(0) / len(stack)
        return np.trunc(total) if kind in "iu" else total
    return {"Sum": stack.sum(0), "Min": stack.min(0), "Max": stack.max(0), "Product": stack.prod(0)}[op]


def collectives_job() -> list[str]:
    tf, hvd = start()
    n, me = hvd.size(), hvd.rank()
    c = Checks()
    ops = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}
    graph_allreduce = tf.function(lambda x, op: hvd.allreduce(x, op=op))

    # allreduce: every dtype and op eagerly, the common ops in tf.function too
    for dt in DTYPES:
        dtype = np.dtype(dt)
        for op_name, op in ops.items():
            for salt, shape in enumerate([(17, 3), ()]):
                inputs = [make(dtype, r, shape, salt, near_one=op_name == "Product") for r in range(n)]
                want = _reduce(np.stack([x.astype(np.float64) for x in inputs]), op_name, dtype.kind)
                case = f"allreduce {dt} {op_name} {shape}"
                c.close(case, hvd.allreduce(tf.constant(inputs[me]), op=op), want, dt)
                if shape and op_name in ("Sum", "Average", "Max"):
                    c.close(case + " tf.function", graph_allreduce(tf.constant(inputs[me]), op), want, dt)
    bf16 = tf.cast(tf.constant(make(np.dtype(np.float32), me, (6,))), tf.bfloat16)
    want = sum(make(np.dtype(np.float32), r, (6,)) for r in range(n))
    c.close("allreduce bfloat16", tf.cast(hvd.allreduce(bf16, op=hvd.Sum), tf.float32), want, tol=5e-2)
    c.close("allreduce bfloat16 tf.function", tf.cast(graph_allreduce(bf16, hvd.Sum), tf.float32), want, tol=5e-2)
    x = make(np.dtype(np.float64), me, (7,))
    want = sum(make(np.dtype(np.float64), r, (7,)) for r in range(n)) * 2.0 * 0.25
    scaled = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25, name="s"))
    c.close("allreduce scaled", hvd.allreduce(tf.constant(x), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), want)
    c.close("allreduce scaled tf.function", scaled(tf.constant(x)), want)
    c.close("allreduce Variable", hvd.allreduce(tf.Variable(x), op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0), want * 4)
    fp16 = hvd.allreduce(tf.constant(x, tf.float32), compression=hvd.Compression.fp16, op=hvd.Sum)
    c.close("allreduce fp16 compression", fp16, want * 2, "float32", tol=2e-2)
    with pytest.warns(DeprecationWarning):
        c.close("allreduce average=False", hvd.allreduce(tf.ones([3]) * me, average=False), np.full(3, sum(range(n))))

    # grouped allreduce, dense and IndexedSlices
    group = [tf.fill([5], float(me + 1)), tf.fill([2, 3], tf.constant(me, tf.int64))]
    for label, fn in (("eager", hvd.grouped_allreduce), ("tf.function", tf.function(hvd.grouped_allreduce))):
        got = fn(group, op=hvd.Sum)
        c.close(f"grouped_allreduce 0 {label}", got[0], np.full(5, n * (n + 1) / 2), "float32")
        c.close(f"grouped_allreduce 1 {label}", got[1], np.full((2, 3), n * (n - 1) // 2), "int64")
    sparse = tf.IndexedSlices(tf.fill([me + 1, 3], float(me + 1)), tf.range(me + 1), tf.constant([5, 3]))
    values = np.concatenate([np.full((r + 1, 3), float(r + 1)) for r in range(n)])
    indices = np.concatenate([np.arange(r + 1) for r in range(n)])
    for label, fn in (("eager", hvd.allreduce), ("tf.function", tf.function(hvd.allreduce))):
        for op_name, op in (("Sum", hvd.Sum), ("Average", hvd.Average)):
            got = fn(sparse, op=op)
            c.that(f"IndexedSlices {op_name} {label}", isinstance(got, tf.IndexedSlices), type(got).__name__)
            c.close(f"IndexedSlices {op_name} {label} values", got.values, values / (n if op_name == "Average" else 1))
            c.close(f"IndexedSlices {op_name} {label} indices", got.indices, indices)
    dense = tf.convert_to_tensor(hvd.allreduce(sparse, op=hvd.Sum))
    c.close("IndexedSlices as dense", dense, np.stack([np.full(3, sum(r + 1 for r in range(n) if r >= i)) for i in range(5)]))

    # allgather (uneven rows, sometimes none) and grouped_allgather
    graph_allgather = tf.function(hvd.allgather)
    for dt in DTYPES:
        for salt, tail in enumerate([(), (3,)]):
            rows = [(r * 2 + salt) % 4 for r in range(n)]
            inputs = [make(np.dtype(dt), r, (rows[r], *tail), salt) for r in range(n)]
            c.close(f"allgather {dt} {tail}", hvd.allgather(tf.constant(inputs[me])), np.concatenate(inputs), dt)
            c.close(f"allgather {dt} {tail} tf.function", graph_allgather(tf.constant(inputs[me])), np.concatenate(inputs), dt)
    got = tf.function(hvd.grouped_allgather)([tf.fill([me + 1], me), tf.fill([1, 2], float(me))])
    c.close("grouped_allgather 0", got[0], np.concatenate([np.full(r + 1, r) for r in range(n)]))
    c.close("grouped_allgather 1", got[1], np.concatenate([np.full((1, 2), float(r)) for r in range(n)]))

    # broadcast, broadcast_, broadcast_variables
    graph_broadcast = tf.function(lambda t, root: hvd.broadcast(t, root))
    for dt in DTYPES:
        for root in range(n):
            want = make(np.dtype(dt), root, (4, 3), root)
            mine = tf.constant(make(np.dtype(dt), me, (4, 3), root))
            c.close(f"broadcast {dt} root {root}", hvd.broadcast(mine, root), want, dt)
            if dt == "float32":
                c.close(f"broadcast {dt} root {root} tf.function", graph_broadcast(mine, root), want, dt)
    variables = [tf.Variable(make(np.dtype(np.float32), me, (3, 2))), tf.Variable(tf.fill([2], me))]
    hvd.broadcast_(variables, root_rank=n - 1)
    c.close("broadcast_ 0", variables[0], make(np.dtype(np.float32), n - 1, (3, 2)))
    c.close("broadcast_ 1", variables[1], np.full(2, n - 1))
    variables[0].assign(tf.fill([3, 2], float(me)))
    hvd.broadcast_variables(variables[:1], root_rank=0)
    c.close("broadcast_variables", variables[0], np.zeros((3, 2)))
    tf.function(lambda: hvd.broadcast_variables(variables, root_rank=n - 1))()
    c.close("broadcast_variables tf.function", variables[0], np.full((3, 2), 0.0))

    # alltoall: even split, then explicit uneven splits with an unsent tail row
    graph_alltoall = tf.function(lambda t, s: hvd.alltoall(t, splits=s))
    for dt in DTYPES:
        inputs = [make(np.dtype(dt), r, (2 * n, 3)) for r in range(n)]
        want = np.concatenate([inputs[r][2 * me : 2 * me + 2] for r in range(n)])
        c.close(f"alltoall even {dt}", hvd.alltoall(tf.constant(inputs[me])), want, dt)
        splits = [[(r + j) % 3 for j in range(n)] for r in range(n)]
        inputs = [make(np.dtype(dt), r, (sum(splits[r]) + 1, 2), 5) for r in range(n)]
        offsets = [np.concatenate(([0], np.cumsum(s))) for s in splits]
        want = np.concatenate([inputs[r][offsets[r][me] : offsets[r][me + 1]] for r in range(n)])
        for label, fn in (("eager", lambda t, s: hvd.alltoall(t, splits=s)), ("tf.function", graph_alltoall)):
            got, received = fn(tf.constant(inputs[me]), tf.constant(splits[me], tf.int32))
            c.close(f"alltoall uneven {dt} {label}", got, want, dt)
            c.close(f"alltoall received {dt} {label}", received, [splits[r][me] for r in range(n)], "int32")

    # reducescatter and grouped_reducescatter
    graph_reducescatter = tf.function(lambda t, op: hvd.reducescatter(t, op=op))
    for dt in DTYPES:
        for op_name, op in (("Sum", hvd.Sum), ("Average", hvd.Average)):
            for rows in (n, 2 * n + 1):
                inputs = [make(np.dtype(dt), r, (rows, 3), rows) for r in range(n)]
                total = _reduce(np.stack([x.astype(np.float64) for x in inputs]), op_name, np.dtype(dt).kind)
                q, m = divmod(rows, n)
                start_row = me * q + min(me, m)
                want = total[start_row : start_row + q + (1 if me < m else 0)]
                case = f"reducescatter {dt} {op_name} rows={rows}"
                c.close(case, hvd.reducescatter(tf.constant(inputs[me]), op=op), want, dt)
                if dt in ("float32", "int64"):
                    c.close(case + " tf.function", graph_reducescatter(tf.constant(inputs[me]), op), want, dt)
    got = hvd.grouped_reducescatter([tf.ones([n, 2]), tf.ones([2 * n])], op=hvd.Sum)
    c.close("grouped_reducescatter 0", got[0], np.full((1, 2), float(n)))
    c.close("grouped_reducescatter 1", got[1], np.full((2,), float(n)))

    # topology ops, join, barrier, objects
    topology = tf.function(lambda: [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op(), hvd.process_set_included_op()])
    for label, values_ in (("eager", [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op(), hvd.process_set_included_op()]), ("tf.function", topology())):
        c.close(f"topology ops {label}", tf.stack(values_), [me, n, hvd.local_rank(), hvd.local_size(), 1], "int32")
    hvd.barrier()
    tf.function(lambda: hvd.barrier())()
    for label, join in (("eager", hvd.join), ("tf.function", tf.function(hvd.join))):
        last = join()
        everyone = hvd.allgather_object(int(last))
        c.that(f"join {label}", last.dtype == tf.int32 and len(set(everyone)) == 1 and 0 <= everyone[0] < n, str(everyone))
    obj = hvd.broadcast_object({"from": me}, root_rank=n - 1)
    c.that("broadcast_object", obj == {"from": n - 1}, str(obj))
    c.that("broadcast_object_fn", hvd.broadcast_object_fn(root_rank=0)(me) == 0)
    c.that("allgather_object", hvd.allgather_object(("r", me)) == [("r", r) for r in range(n)])
    _shapes_and_errors(c, tf, hvd)
    hvd.shutdown()
    return c.problems


def _shapes_and_errors(c: Checks, tf: Any, hvd: Any) -> None:
    """Static shapes inside tf.function, and errors: local ones and cross-rank mismatches."""
    n, me = hvd.size(), hvd.rank()
    spec = tf.TensorSpec([2 * n + 1, 3], tf.float32)
    q, m = divmod(2 * n + 1, n)
    shapes = {
        "allreduce": (lambda t: hvd.allreduce(t), [2 * n + 1, 3]),
        "broadcast": (lambda t: hvd.broadcast(t, 0), [2 * n + 1, 3]),
        "allgather": (lambda t: hvd.allgather(t), [None if n > 1 else 2 * n + 1, 3]),
        "alltoall": (lambda t: hvd.alltoall(t, splits=[1] * n), [None, 3]),
        "reducescatter": (lambda t: hvd.reducescatter(t), [q + (1 if me < m else 0), 3]),
    }
    for what, (fn, want) in shapes.items():
        out = tf.function(fn).get_concrete_function(spec).structured_outputs
        out = out[0] if isinstance(out, tuple) else out
        c.that(f"static shape {what}", out.shape.as_list() == want, f"{out.shape.as_list()} != {want}")

    # local errors: raised at once, also while tracing
    c.raises("string dtype", lambda: hvd.allreduce(tf.constant(["a"])), ValueError, "not supported")
    c.raises("string dtype traced", lambda: tf.function(hvd.allreduce)(tf.constant(["a"])), ValueError, "not supported")
    c.raises("op and average", lambda: hvd.allreduce(tf.ones(1), average=True, op=hvd.Sum), ValueError, "supersedes")
    c.raises("reducescatter Max", lambda: hvd.reducescatter(tf.ones([2]), op=hvd.Max), NotImplementedError, "Average or Sum")  # UnsupportedOperationError, as in hora.torch
    c.raises("sparse Max", lambda: hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0])), op=hvd.Max), NotImplementedError, "sparse_as_dense")
    scaled_sparse = lambda: hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0])), prescale_factor=0.5)  # noqa: E731
    c.raises("sparse scaled", scaled_sparse, NotImplementedError, "prescale_factor")
    # Average of integer slices: divided as TensorFlow's / divides them (into floats), as Horovod
    ints = hvd.allreduce(tf.IndexedSlices(tf.fill([1, 2], 3 * (me + 1)), tf.constant([me])), op=hvd.Average)
    c.close("sparse int Average", ints.values, np.stack([np.full(2, 3.0 * (r + 1) / n) for r in range(n)]), "float64")
    c.raises("allgather scalar", lambda: hvd.allgather(tf.constant(1.0)), ValueError, "scalar")
    c.raises("broadcast root", lambda: hvd.broadcast(tf.ones(1), n), ValueError, "root_rank")
    c.raises("alltoall splits", lambda: hvd.alltoall(tf.ones([n + 1]), splits=[n + 2] + [0] * (n - 1)), ValueError, "splits")
    c.raises("global variables", lambda: hvd.broadcast_global_variables(0), RuntimeError, "broadcast_variables")
    c.raises("not an optimizer", lambda: hvd.DistributedOptimizer(object()), TypeError, "Keras optimizers")
    c.raises(
        "XLA", lambda: tf.function(lambda t: hvd.allreduce(t), jit_compile=True)(tf.ones(2)),
        RuntimeError, "XLA", "jit_compile=False",
    )  # fmt: skip
    if n & (n - 1):
        c.raises("Adasum", lambda: hvd.allreduce(tf.ones(2), op=hvd.Adasum), NotImplementedError, "power-of-two")
    else:
        e = np.eye(n, dtype=np.float32)[me] if n > 1 else np.ones(1, np.float32)
        c.close("Adasum orthogonal", hvd.allreduce(tf.constant(e), op=hvd.Adasum), np.ones(n))

    if n > 1:
        # cross-rank mismatches: every rank raises, naming each rank's value; later collectives work
        def both(case: str, fn: Callable[[Any], Any], arg: Any, *fragments: str) -> None:
            c.raises(case, lambda: fn(arg), hvd.CollectiveMismatchError, *fragments)
            c.raises(case + " tf.function", lambda: tf.function(fn)(arg), tf.errors.UnknownError, *fragments)

        shape_words = [f"rank {r}: ({r + 2},)" for r in range(n)]
        both("shape mismatch", lambda t: hvd.allreduce(t, name="m"), tf.ones([me + 2]), "shapes differ", *shape_words)
        dtype = tf.float32 if me == 0 else tf.float64
        both("dtype mismatch", lambda t: hvd.allreduce(t, name="d"), tf.ones([2], dtype), "rank 0: float32", "float64")
        both("allgather mismatch", lambda t: hvd.allgather(t, name="g"), tf.ones([2, me + 1]), "allgather", "rank 0")
        both("broadcast root mismatch", lambda t: hvd.broadcast(t, me % 2, name="b"), tf.ones([2]), "root ranks differ")
        c.close("after mismatch", hvd.allreduce(tf.ones([2]), op=hvd.Sum), np.full(2, float(n)))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.timeout(300)
def test_tensorflow_collectives(size: int) -> None:
    results = run_ranks(size, collectives_job, timeout=280, env=TF_ENV)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:30])
