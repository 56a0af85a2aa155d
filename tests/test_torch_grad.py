"""Gradients of the differentiable hora.torch collectives, checked against a single process.

Every rank builds every rank's input, runs the op for real, backpropagates its own
weighting of the output, and compares the gradient of its input with autograd on a
single-process emulation of the op over all inputs. Horovod's gradients are those of
these objectives (L_r is rank r's weighted output):

- allreduce, alltoall: the sum of the L_r;
- allgather, broadcast: the mean of the L_r;
- reducescatter: the size times the sum of the L_r.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks
from test_torch_support import setup_rank

pytestmark = pytest.mark.ranks


def _random(n: int, shape_of, salt: int) -> list[torch.Tensor]:
    """One float64 tensor per rank, of shape ``shape_of(rank)``, the same on every rank."""
    return [
        torch.randn(shape_of(r), generator=torch.Generator().manual_seed(100 * r + salt), dtype=torch.float64)
        for r in range(n)
    ]


def grad_job() -> list[str]:
    import hora.torch as hvd

    setup_rank()
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []

    def check(case: str, run, emulate, objective: str, count: int, in_shape_of, out_shape_of, salt: int) -> None:
        """run(my inputs) -> my outputs; emulate(every rank's inputs) -> every rank's outputs.

        ``in_shape_of(r, i)``/``out_shape_of(r, i)``: shape of tensor ``i`` on rank ``r``.
        """
        xs = [_random(n, lambda r, i=i: in_shape_of(r, i), salt + 10 * i) for i in range(count)]
        ws = [_random(n, lambda r, i=i: out_shape_of(r, i), 5000 + salt + 10 * i) for i in range(count)]
        mine = [x[me].clone().requires_grad_() for x in xs]
        outputs = run(mine)
        loss = sum((w[me] * out).sum() for w, out in zip(ws, outputs))
        loss.backward()
        leaves = [[x[r].clone().requires_grad_() for r in range(n)] for x in xs]
        per_rank = emulate(leaves)  # per_rank[r][i]: output i on rank r
        total = sum((ws[i][r] * per_rank[r][i]).sum() for r in range(n) for i in range(count))
        scale = {"sum": 1.0, "mean": 1.0 / n, "size*sum": float(n)}[objective]
        (total * scale).backward()
        for i, (got, leaf) in enumerate(zip(mine, leaves)):
            want = leaf[me].grad if leaf[me].grad is not None else torch.zeros_like(leaf[me])
            if got.grad is None or not torch.allclose(got.grad, want, rtol=1e-9, atol=1e-9):
                shown = None if got.grad is None else got.grad.reshape(-1)[:4].tolist()
                problems.append(f"{case} tensor {i}: grad {shown} want {want.reshape(-1)[:4].tolist()}")

    same = lambda shape: (lambda r, i: shape)  # noqa: E731 - shape tables
    # allreduce with the ops that have a gradient, and the scale factors
    for op_name, op, mean in (("Sum", hvd.Sum, False), ("Average", hvd.Average, True)):
        check(
            f"allreduce {op_name}", lambda m, op=op: [hvd.allreduce(m[0], op=op)],
            lambda ls, mean=mean: [[sum(ls[0]) / (n if mean else 1)] for _ in range(n)], "sum", 1,
            same((3, 4)), same((3, 4)), 1,
        )  # fmt: skip
    check(
        "allreduce scaled", lambda m: [hvd.allreduce(m[0], op=hvd.Average, prescale_factor=2.0, postscale_factor=0.5)],
        lambda ls: [[sum(2.0 * x for x in ls[0]) / n * 0.5] for _ in range(n)], "sum", 1, same((3, 4)), same((3, 4)), 2,
    )  # fmt: skip
    pair = lambda r, i: [(2, 3), (5,)][i]  # noqa: E731
    check(
        "grouped_allreduce", lambda m: hvd.grouped_allreduce(m, op=hvd.Sum),
        lambda ls: [[sum(ls[0]), sum(ls[1])] for _ in range(n)], "sum", 2, pair, pair, 3,
    )  # fmt: skip
    # allgather: the rows differ by rank
    rows_of = lambda r: r % 3 + 1  # noqa: E731
    all_rows = sum(rows_of(q) for q in range(n))
    check(
        "allgather", lambda m: [hvd.allgather(m[0])], lambda ls: [[torch.cat(ls[0])] for _ in range(n)], "mean", 1,
        lambda r, i: (rows_of(r), 2), same((all_rows, 2)), 4,
    )  # fmt: skip
    check(
        "grouped_allgather", lambda m: hvd.grouped_allgather(m),
        lambda ls: [[torch.cat(ls[0]), torch.cat(ls[1])] for _ in range(n)], "mean", 2,
        lambda r, i: [(rows_of(r), 2), (r + 1,)][i], lambda r, i: [(all_rows, 2), (n * (n + 1) // 2,)][i], 5,
    )  # fmt: skip
    # broadcast from every root
    for root in range(n):
        check(
            f"broadcast root {root}", lambda m, root=root: [hvd.broadcast(m[0], root)],
            lambda ls, root=root: [[ls[0][root]] for _ in range(n)], "mean", 1, same((3, 4)), same((3, 4)), 6 + root,
        )  # fmt: skip
    # alltoall with uneven splits: rank r sends (r + j) % 2 + 1 rows to rank j
    splits = [[(r + j) % 2 + 1 for j in range(n)] for r in range(n)]
    offsets = [[sum(s[:j]) for j in range(n + 1)] for s in splits]
    check(
        "alltoall", lambda m: [hvd.alltoall(m[0], splits=splits[me])[0]],
        lambda ls: [[torch.cat([ls[0][q][offsets[q][r] : offsets[q][r + 1]] for q in range(n)])] for r in range(n)],
        "sum", 1, lambda r, i: (sum(splits[r]), 3), lambda r, i: (sum(splits[q][r] for q in range(n)), 3), 20,
    )  # fmt: skip
    check(
        "alltoall even", lambda m: [hvd.alltoall(m[0])],
        lambda ls: [[torch.cat([ls[0][q][2 * r : 2 * r + 2] for q in range(n)])] for r in range(n)], "sum", 1,
        same((2 * n, 2)), same((2 * n, 2)), 21,
    )  # fmt: skip
    # reducescatter, uneven rows
    rows = 2 * n + 1
    bounds = [r * (rows // n) + min(r, rows % n) for r in range(n + 1)]
    for op_name, op, divisor in (("Sum", hvd.Sum, 1.0), ("Average", hvd.Average, float(n))):
        check(
            f"reducescatter {op_name}", lambda m, op=op: [hvd.reducescatter(m[0], op=op)],
            lambda ls, d=divisor: [[(sum(ls[0]) / d)[bounds[r] : bounds[r + 1]]] for r in range(n)], "size*sum", 1,
            same((rows, 2)), lambda r, i: (bounds[r + 1] - bounds[r], 2), 30,
        )  # fmt: skip
    check(
        "grouped_reducescatter", lambda m: hvd.grouped_reducescatter(m, op=hvd.Sum),
        lambda ls: [[sum(ls[0])[bounds[r] : bounds[r + 1]], sum(ls[1])[r : r + 1]] for r in range(n)], "size*sum", 2,
        lambda r, i: [(rows, 2), (n,)][i], lambda r, i: [(bounds[r + 1] - bounds[r], 2), (1,)][i], 31,
    )  # fmt: skip
    # Horovod's autograd functions called directly, with its positional arguments (average first)
    from hora.torch.mpi_ops import HorovodAllreduce, HorovodGroupedAllreduce

    ps = hvd.global_process_set
    check(
        "HorovodAllreduce.apply", lambda m: [HorovodAllreduce.apply(m[0], None, "direct", hvd.Sum, 1.0, 1.0, ps)],
        lambda ls: [[sum(ls[0])] for _ in range(n)], "sum", 1, same((3,)), same((3,)), 40,
    )  # fmt: skip
    check(
        "HorovodAllreduce.apply average=True", lambda m: [HorovodAllreduce.apply(m[0], True, None, None, 1.0, 1.0, ps)],
        lambda ls: [[sum(ls[0]) / n] for _ in range(n)], "sum", 1, same((3,)), same((3,)), 41,
    )  # fmt: skip
    check(
        "HorovodGroupedAllreduce.apply",
        lambda m: list(HorovodGroupedAllreduce.apply(None, "direct group", hvd.Sum, 1.0, 1.0, ps, *m)),
        lambda ls: [[sum(ls[0]), sum(ls[1])] for _ in range(n)], "sum", 2, same((2,)), same((2,)), 42,
    )  # fmt: skip
    hvd.shutdown()
    return problems


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.timeout(120)
def test_gradients_match_a_single_process(size):
    for rank, problems in enumerate(run_ranks(size, grad_job, timeout=100)):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:20])
