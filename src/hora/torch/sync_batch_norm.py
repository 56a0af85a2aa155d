"""SyncBatchNorm: batch normalization with statistics over the whole batch of every rank.

In training, each rank computes its per-channel count, mean and sum of squared
deviations; one allgather gives every rank all of them, and each combines them
(in float64, with the parallel-variance formula, which does not lose precision to
cancellation) into the mean and variance of the global batch. The backward pass
needs two more per-channel sums from every rank, reduced with one allreduce. The
gradient is that of batch normalization over the concatenated batch; the weight and
bias gradients stay local, for the optimizer to average like any other.

Unlike Horovod's, this runs on CPU tensors (Horovod's needs CUDA kernels).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hora.collectives.reduce import SUM
from hora.core.process_sets import ProcessSet, global_process_set
from hora.torch.autograd import _apply, allgather
from hora.torch.autograd import allreduce as _allreduce


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training statistics span every rank of the process set.

    Args:
        num_features: ``C`` in an input of shape ``(N, C, ...)``.
        eps: added to the variance for numerical stability.
        momentum: weight of the newest batch in the running statistics; None for a
            cumulative average.
        affine: learn a per-channel scale and shift.
        track_running_stats: keep running statistics (used in eval mode).
        process_set: the ranks whose batches are normalized together (an addition to
            Horovod's signature).

    Every rank of the set must call ``forward`` (and ``backward``) the same number of
    times, as with any collective. The batch size may differ between ranks.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or (self.process_set.size() or 1) == 1:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, use_batch_stats, factor, self.eps
            )
        return _apply(  # type: ignore[no-any-return]
            _SyncBatchNormFunction,
            input, self.weight, self.bias, self.running_mean, self.running_var, self.eps, factor, self.process_set
        )


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """(N, C, *) -> (M, C): one row per element position, one column per channel."""
    channels = x.shape[1]
    return x.transpose(0, 1).reshape(channels, x.numel() // max(channels, 1)).t()


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        rows = _channels_last(input.detach()).double()
        count = rows.shape[0]
        local_mean = rows.mean(0) if count else rows.new_zeros(rows.shape[1])
        local_m2 = ((rows - local_mean) ** 2).sum(0)
        mine = torch.cat([rows.new_tensor([float(count)]), local_mean, local_m2]).unsqueeze(0)
        stats = allgather(mine, process_set=process_set)  # (ranks, 1 + 2C)
        counts, means, m2s = stats[:, :1], stats[:, 1 : 1 + rows.shape[1]], stats[:, 1 + rows.shape[1] :]
        total = float(counts.sum())
        if total == 0:
            raise ValueError("SyncBatchNorm: the batch is empty on every rank")
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        var = m2 / total
        if running_mean is not None and running_var is not None:
            unbiased = m2 / max(total - 1.0, 1.0)
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        invstd = torch.rsqrt(var + eps)
        shape = [1, -1] + [1] * (input.dim() - 2)
        mean_, invstd_ = mean.to(input.dtype).view(shape), invstd.to(input.dtype).view(shape)
        x_hat = (input - mean_) * invstd_
        out = x_hat
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        ctx.save_for_backward(x_hat, weight, invstd_)
        ctx.total, ctx.process_set = total, process_set
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        x_hat, weight, invstd = ctx.saved_tensors
        dims = [0] + list(range(2, grad_output.dim()))
        shape = [1, -1] + [1] * (grad_output.dim() - 2)
        sum_dy = grad_output.sum(dims)
        sum_dy_xhat = (grad_output * x_hat).sum(dims)
        grad_weight = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            # The input gradient of batch norm over the concatenated batch needs the global sums.
            sums = _allreduce(torch.cat([sum_dy, sum_dy_xhat]).detach(), op=SUM, process_set=ctx.process_set)
            channels = sum_dy.shape[0]
            mean_dy = (sums[:channels] / ctx.total).view(shape)
            mean_dy_xhat = (sums[channels:] / ctx.total).view(shape)
            scale = invstd if weight is None else invstd * weight.view(shape)
            grad_input = scale * (grad_output - mean_dy - x_hat * mean_dy_xhat)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
