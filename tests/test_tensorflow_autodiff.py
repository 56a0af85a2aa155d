"""Gradients through hora.tensorflow's collectives, DistributedGradientTape and its
options, and process sets, at world sizes 1-3, eagerly and inside tf.function.

Every rank knows every rank's inputs (data.make), so each rank computes the expected
gradient of ``sum_r sum(y_r * w_r)`` (the losses of all ranks, each rank's loss
weighted by its own ``w_r``) with NumPy and compares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from data import make
from harness import run_ranks
from test_tensorflow_ops import SIZES, TF_ENV, Checks, start

pytestmark = pytest.mark.framework


def _grad(tf: Any, fn: Callable[[Any], Any], x: np.ndarray, w: np.ndarray, graph: bool) -> Any:
    """d/dx of sum(fn(x) * w), eagerly or inside tf.function."""

    def compute(x_: Any, w_: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x_)
            loss = tf.reduce_sum(fn(x_) * w_)
        return tape.gradient(loss, x_)

    return (tf.function(compute) if graph else compute)(tf.constant(x), tf.constant(w))


def _gradients(c: Checks, tf: Any, hvd: Any) -> None:
    n, me = hvd.size(), hvd.rank()
    f64 = np.dtype(np.float64)
    for graph in (False, True):
        mode = "tf.function" if graph else "eager"
        xs = [make(f64, r, (4, 3)) for r in range(n)]
        ws = [make(f64, r + 10, (4, 3)) for r in range(n)]
        w_sum, w_mean = sum(ws), sum(ws) / n
        scaled = _grad(tf, lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), xs[me], ws[me], graph)
        c.close(f"allreduce Sum scaled {mode}", scaled, 0.5 * w_sum)
        c.close(f"allreduce Average {mode}", _grad(tf, lambda t: hvd.allreduce(t), xs[me], ws[me], graph), w_mean)
        stack = np.stack(xs)
        for op_name, op, result in (("Max", hvd.Max, stack.max(0)), ("Min", hvd.Min, stack.min(0))):
            got = _grad(tf, lambda t, op=op: hvd.allreduce(t, op=op), xs[me], ws[me], graph)
            c.close(f"allreduce {op_name} {mode}", got, w_sum * (xs[me] == result))
        positive = [make(f64, r, (4, 3), near_one=True) for r in range(n)]
        product = np.prod(np.stack(positive), 0)
        got = _grad(tf, lambda t: hvd.allreduce(t, op=hvd.Product), positive[me], ws[me], graph)
        c.close(f"allreduce Product {mode}", got, w_sum * product / positive[me])

        def grouped(t: Any) -> Any:
            a, b = hvd.grouped_allreduce([t, t * 2.0], op=hvd.Sum)
            return a + b

        c.close(f"grouped_allreduce {mode}", _grad(tf, grouped, xs[me], ws[me], graph), 3 * w_sum)

        # allgather: rank r contributes r + 1 rows; its gradient is the averaged weight's rows
        rows = [r + 1 for r in range(n)]
        gx = [make(f64, r, (rows[r], 2)) for r in range(n)]
        gw = [make(f64, r + 10, (sum(rows), 2)) for r in range(n)]
        start_row = sum(rows[:me])
        got = _grad(tf, lambda t: hvd.allgather(t), gx[me], gw[me], graph)
        c.close(f"allgather {mode}", got, (sum(gw) / n)[start_row : start_row + rows[me]])

        # broadcast from the last rank: the averaged gradient on the root, zeros elsewhere
        got = _grad(tf, lambda t: hvd.broadcast(t, n - 1), xs[me], ws[me], graph)
        c.close(f"broadcast {mode}", got, w_mean if me == n - 1 else np.zeros((4, 3)))

        # alltoall with uneven splits and an unsent last row (whose gradient is 0)
        splits = [[(r + j) % 3 for j in range(n)] for r in range(n)]
        ax = [make(f64, r, (sum(splits[r]) + 1, 2)) for r in range(n)]
        aw = [make(f64, r + 10, (sum(splits[s][r] for s in range(n)), 2)) for r in range(n)]
        want = np.zeros_like(ax[me])
        offset = 0
        for j in range(n):
            into_j = sum(splits[s][j] for s in range(me))  # where my rows start in rank j's output
            want[offset : offset + splits[me][j]] = aw[j][into_j : into_j + splits[me][j]]
            offset += splits[me][j]
        got = _grad(tf, lambda t: hvd.alltoall(t, splits=splits[me])[0], ax[me], aw[me], graph)
        c.close(f"alltoall {mode}", got, want)

        # reducescatter: every rank's weights, concatenated, times n for Sum (Horovod's rule)
        rs_rows = 2 * n + 1
        q, m = divmod(rs_rows, n)
        counts = [q + (1 if r < m else 0) for r in range(n)]
        rx = [make(f64, r, (rs_rows, 2)) for r in range(n)]
        rw = [make(f64, r + 10, (counts[r], 2)) for r in range(n)]
        for op_name, op, factor in (("Sum", hvd.Sum, n), ("Average", hvd.Average, 1)):
            got = _grad(tf, lambda t, op=op: hvd.reducescatter(t, op=op), rx[me], rw[me], graph)
            c.close(f"reducescatter {op_name} {mode}", got, np.concatenate(rw) * factor)


def _model(tf: Any, me: int) -> tuple[list[Any], Callable[[], Any]]:
    """A small model with an embedding (IndexedSlices gradients) and a dense layer."""
    f32 = np.dtype(np.float32)
    embedding = tf.Variable(make(f32, 0, (10, 4)), name="embedding")
    kernel = tf.Variable(make(f32, 1, (4, 3)), name="kernel")
    bias = tf.Variable(np.zeros(3, np.float32), name="bias")
    ids = tf.constant([me % 10, (3 * me + 1) % 10, 7])
    target = tf.constant(make(f32, me + 20, (3, 3)))

    def loss() -> Any:
        hidden = tf.gather(embedding, ids) @ kernel + bias
        return tf.reduce_mean(tf.square(hidden - target))

    return [embedding, kernel, bias], loss


def autodiff_job() -> list[str]:
    import os

    from hora.core.process_sets import ProcessSet

    n = int(os.environ["HORA_SIZE"])
    pair = ProcessSet([0, n - 1]) if n > 2 else None  # registered by init (at 2 ranks it would be the global set)
    tf, hvd = start(process_sets=[pair] if pair is not None else None)
    me = hvd.rank()
    c = Checks()
    _gradients(c, tf, hvd)
    variables, loss = _model(tf, me)

    def local_grads() -> list[np.ndarray]:
        with tf.GradientTape() as tape:
            value = loss()
        return [np.asarray(tf.convert_to_tensor(g)) for g in tape.gradient(value, variables)]

    everyone = hvd.allgather_object(local_grads())
    mean = [sum(g[i] for g in everyone) / n for i in range(3)]
    total = [sum(g[i] for g in everyone) for i in range(3)]
    mine = everyone[me]

    def distributed(graph: bool, **options: Any) -> list[Any]:
        def compute() -> list[Any]:
            with tf.GradientTape() as tape:
                value = loss()
            tape = hvd.DistributedGradientTape(tape, **options)
            return [tf.convert_to_tensor(g) for g in tape.gradient(value, variables)]

        return (tf.function(compute) if graph else compute)()

    cases: dict[str, tuple[dict[str, Any], list[np.ndarray], float | None]] = {
        "default": ({}, mean, None),
        "Sum": ({"op": hvd.Sum}, total, None),
        "predivide": ({"gradient_predivide_factor": 2.0, "sparse_as_dense": True}, mean, None),
        "fp16": ({"compression": hvd.Compression.fp16}, mean, 2e-2),
        "groups=2": ({"groups": 2}, mean, None),
        "groups of variables": ({"groups": [[variables[1], variables[2]]]}, mean, None),
        "sparse_as_dense": ({"sparse_as_dense": True}, mean, None),
    }
    for graph in (False, True):
        mode = "tf.function" if graph else "eager"
        for label, (options, want, tol) in cases.items():
            for i, got in enumerate(distributed(graph, **options)):
                c.close(f"tape {label} {mode} grad {i}", got, want[i], "float32", tol=tol)
        # gradients of local variables stay local (divided by n unless scale_local_gradients=False)
        for scale in (True, False):

            def partial(scale: bool = scale) -> list[Any]:
                with tf.GradientTape() as tape:
                    value = loss()
                layer = type("Layer", (), {"trainable_weights": [variables[2]]})()
                tape = hvd.PartialDistributedGradientTape(tape, local_layers=[layer], scale_local_gradients=scale)
                return [tf.convert_to_tensor(g) for g in tape.gradient(value, variables)]

            got = (tf.function(partial) if graph else partial)()
            c.close(f"partial tape {mode} scale={scale} shared", got[1], mean[1])
            c.close(f"partial tape {mode} scale={scale} local", got[2], mine[2] / (n if scale else 1))
    with pytest.warns(DeprecationWarning):
        c.close("tape num_groups", distributed(False, num_groups=2)[1], mean[1])
    c.raises("predivide with Sum", lambda: distributed(False, op=hvd.Sum, gradient_predivide_factor=2.0), ValueError, "predivide")
    if n > 1:  # (one rank reduces nothing) As Horovod: the embedding's tf.IndexedSlices gradient is gathered, which
        # takes no scale factors.
        sparse_predivide = lambda: distributed(False, gradient_predivide_factor=2.0)  # noqa: E731
        c.raises("predivide, sparse", sparse_predivide, NotImplementedError, "sparse_as_dense")

    if pair is not None:
        # a process set of the first and the last rank
        inside = me in (0, n - 1)
        c.close("process_set_included_op", hvd.process_set_included_op(pair.process_set_id), int(inside))
        c.close("size_op of the set", hvd.size_op(pair.process_set_id), 2)
        if inside:
            c.close("allreduce in set", hvd.allreduce(tf.constant([float(me)]), op=hvd.Sum, process_set=pair), [float(n - 1)])
            # root_rank is a global rank inside a process set too, as in Horovod
            got = tf.function(lambda: hvd.broadcast(tf.constant([me]), n - 1, process_set=pair))()
            c.close("broadcast in set (root = the last rank, globally)", got, [n - 1])
            got = hvd.broadcast(tf.constant([me]), 0, process_set=pair)
            c.close("eager broadcast in set from global rank 0", got, [0])
            if n > 2:
                c.raises("root outside the set", lambda: hvd.broadcast(tf.constant([me]), 1, process_set=pair), ValueError, "global rank")
            x = tf.Variable([float(me + 1)])
            with tf.GradientTape() as tape:
                y = hvd.broadcast(x, n - 1, process_set=pair) * 2.0
            # the gradient averages over the set and lands on the root alone
            c.close("broadcast gradient in set", tape.gradient(y, x), [2.0 if me == n - 1 else 0.0])
            grads = distributed(True, process_set=pair)
            pair_mean = [(everyone[0][i] + everyone[n - 1][i]) / 2 for i in range(3)]
            for i, got in enumerate(grads):
                c.close(f"tape in set grad {i}", got, pair_mean[i])
        else:
            c.raises("allreduce outside set", lambda: hvd.allreduce(tf.ones(1), process_set=pair), ValueError, "not a member")
            # Horovod's class too, eagerly and while tracing
            outside = tf.function(lambda: hvd.allgather(tf.ones(1), process_set=pair))
            for label, call in (("eager", lambda: hvd.allgather(tf.ones(1), process_set=pair)), ("traced", outside)):
                c.raises(f"{label} outside set", call, tf.errors.InvalidArgumentError, "not a member")
            for i, got in enumerate(distributed(False, process_set=pair)):
                c.close(f"tape outside set grad {i}", got, mine[i])  # not a member: gradients unchanged
    hvd.shutdown()
    return c.problems


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.timeout(300)
def test_tensorflow_autodiff(size: int) -> None:
    results = run_ranks(size, autodiff_job, timeout=280, env=TF_ENV)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:30])
