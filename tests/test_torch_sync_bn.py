"""SyncBatchNorm on N ranks equals BatchNorm on the concatenated batch: outputs, statistics, gradients."""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks
from test_torch_support import setup_rank

pytestmark = pytest.mark.ranks


def sync_bn_job() -> list[str]:
    import hora.torch as hvd

    setup_rank()
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []

    def close(case: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-9, atol=1e-9):
            problems.append(f"{case}: got {got.reshape(-1)[:4].tolist()} want {want.reshape(-1)[:4].tolist()}")

    cases = [
        ("2d", (5,), torch.nn.BatchNorm1d, {}),
        ("3d", (3, 4), torch.nn.BatchNorm1d, {}),
        ("4d", (2, 3, 3), torch.nn.BatchNorm2d, {}),
        ("cumulative", (3,), torch.nn.BatchNorm1d, {"momentum": None}),
        ("no running stats", (3,), torch.nn.BatchNorm1d, {"track_running_stats": False}),
        ("not affine", (3, 2), torch.nn.BatchNorm1d, {"affine": False}),
    ]
    for case, shape, reference_cls, kwargs in cases:
        channels = shape[0]
        sync = hvd.SyncBatchNorm(channels, **kwargs).double()
        reference = reference_cls(channels, **kwargs).double()
        if sync.affine:
            with torch.no_grad():
                for module in (sync, reference):
                    g = torch.Generator().manual_seed(3)
                    module.weight.copy_(torch.rand(channels, generator=g, dtype=torch.float64) + 0.5)
                    module.bias.copy_(torch.randn(channels, generator=torch.Generator().manual_seed(4), dtype=torch.float64))
        sizes = [r % 3 + 2 for r in range(n)]  # the batch size differs by rank
        offsets = [sum(sizes[:r]) for r in range(n + 1)]
        for step in range(2):
            g = torch.Generator().manual_seed(10 * step)
            inputs = [torch.randn((sizes[r], *shape), generator=g, dtype=torch.float64) * 3 + 5 for r in range(n)]
            weights = [torch.randn((sizes[r], *shape), generator=g, dtype=torch.float64) for r in range(n)]
            mine = inputs[me].clone().requires_grad_()
            out = sync(mine)
            (out * weights[me]).sum().backward()
            full = torch.cat(inputs).requires_grad_()
            want = reference(full)
            (want * torch.cat(weights)).sum().backward()
            rows = slice(offsets[me], offsets[me + 1])
            close(f"{case} step {step} output", out.detach(), want.detach()[rows])
            close(f"{case} step {step} input grad", mine.grad, full.grad[rows])
            if sync.affine:
                # Parameter gradients stay local; their sum over ranks is the whole batch's.
                total = hvd.allreduce(torch.cat([sync.weight.grad, sync.bias.grad]), op=hvd.Sum)
                close(f"{case} step {step} weight/bias grad", total, torch.cat([reference.weight.grad, reference.bias.grad]))
                for module in (sync, reference):
                    module.zero_grad()
        if sync.track_running_stats:
            close(f"{case} running mean", sync.running_mean, reference.running_mean)
            close(f"{case} running var", sync.running_var, reference.running_var)
            if int(sync.num_batches_tracked) != int(reference.num_batches_tracked):
                problems.append(f"{case}: num_batches_tracked {int(sync.num_batches_tracked)}")
            sync.eval()
            reference.eval()
            probe = torch.randn((2, *shape), generator=torch.Generator().manual_seed(99), dtype=torch.float64)
            close(f"{case} eval", sync(probe).detach(), reference(probe).detach())
    try:
        hvd.SyncBatchNorm(3)(torch.ones(3))
        problems.append("1-D input did not raise")
    except ValueError as exc:
        if "expected at least 2D input (got 1D input)" not in str(exc):
            problems.append(str(exc))
    hvd.shutdown()
    return problems


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.timeout(90)
def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch(size):
    for rank, problems in enumerate(run_ranks(size, sync_bn_job, timeout=80)):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:20])
