"""DistributedOptimizer: the factory that picks the variant for its arguments.

- ``allreduce_optimizer._DistributedOptimizer``: gradient allreduce in backward hooks
  (the default, Horovod's optimizer);
- ``adasum_optimizer._DistributedAdasumOptimizer``: ``op=Adasum`` on more than one rank;
- ``sharding._ShardedOptimizer`` and ``_Stage2Optimizer``: ``shard_optimizer_state=1``
  or ``2`` (ZeRO stages 1 and 2, see docs/sharding.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from hora.core.api import size
from hora.collectives.reduce import ADASUM, AVERAGE
from hora.compression import Compression, Compressor
from hora.core.process_sets import ProcessSet, global_process_set
from hora.torch.allreduce_optimizer import _DistributedOptimizer
from hora.torch.sharding import sharded_optimizer, shard_stage
from hora.torch.wrapper import WrappedOptimizer

__all__ = ["DistributedOptimizer", "_DistributedOptimizer"]


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[Any] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = AVERAGE,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | list[list[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
    *,
    shard_optimizer_state: bool | int = False,
) -> WrappedOptimizer:
    """Wraps an optimizer so that ``step()`` applies gradients averaged over all ranks.

    Each gradient's allreduce starts as soon as backward has computed it, in parallel
    with the rest of the backward pass; ``step()`` waits for them and then steps the
    wrapped optimizer. Call ``hvd.init()`` first, then::

        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    To change gradients before the step (clipping), synchronize first::

        loss.backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with optimizer.skip_synchronize():
            optimizer.step()

    Args:
        optimizer: the ``torch.optim.Optimizer`` to wrap. It stays usable: the wrapper
            shares its parameter groups and state.
        named_parameters: ``(name, parameter)`` pairs, usually ``model.named_parameters()``,
            naming each gradient's allreduce; default names are by position.
        compression: ``Compression.fp16`` sends floating-point gradients as float16.
        backward_passes_per_step: backward passes that accumulate gradients locally
            before one allreduce and one step.
        op: Average (default), Sum or Adasum (Adasum: each rank steps locally and the
            ranks combine their weight changes with Adasum; needs a power-of-two number
            of ranks and the global process set).
        gradient_predivide_factor: with Average, gradients are multiplied by
            ``1 / gradient_predivide_factor`` before the sum and by
            ``gradient_predivide_factor / size`` after it.
        num_groups: deprecated; use ``groups``.
        groups: an int ``n`` reduces the gradients in ``n`` groups of consecutive
            parameters (each group one grouped allreduce once all its gradients are
            ready); a list of lists of parameters gives the groups explicitly (others
            travel alone). None lets the engine fuse whatever is ready.
        sparse_as_dense: reduce sparse gradients as dense tensors.
        process_set: the ranks whose gradients are averaged (ranks outside it step
            on their local gradients).
        shard_optimizer_state: (keyword only; not in Horovod) ``True`` or ``1`` keeps
            1/N of the optimizer state on each rank (ZeRO stage 1: gradients allreduced,
            each rank steps its slice of every parameter, then an allgather); ``2`` also
            keeps 1/N of the gradients (ZeRO stage 2: reducescatter instead of
            allreduce; ``p.grad`` is None after the step). Checkpoints go through
            ``consolidate_state_dict(to=0)`` + ``state_dict()``; see docs/sharding.md.

    Returns:
        The wrapped optimizer, with ``synchronize()``, ``skip_synchronize()`` and
        ``set_backward_passes_per_step()`` added.

    Raises:
        ValueError: ``backward_passes_per_step`` is not positive, a predivide factor
            with an op other than Average, bad ``groups``, or duplicate or missing
            names in ``named_parameters``.
            With ``shard_optimizer_state``: a value other than False/True/0/1/2, Adasum,
            an op other than Average or Sum, a process set other than the global one,
            ``groups`` with stage 2, or an optimizer that is not elementwise.
        NotImplementedError: Adasum with a process set other than the global one.
    """
    world = size()  # raises a clear error before hvd.init()
    if gradient_predivide_factor != 1.0 and op != AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=2,
        )
        if groups is None:
            groups = num_groups
    stage = shard_stage(shard_optimizer_state)
    if stage:
        return sharded_optimizer(
            stage, optimizer, named_parameters, compression, backward_passes_per_step, op,
            gradient_predivide_factor, groups, process_set,
        )  # fmt: skip
    if op != ADASUM or world == 1:
        return _DistributedOptimizer(
            optimizer, named_parameters, compression, backward_passes_per_step, op,
            gradient_predivide_factor, groups, sparse_as_dense, process_set,
        )  # fmt: skip
    if process_set is not global_process_set:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    from hora.torch.adasum_optimizer import _DistributedAdasumOptimizer

    return _DistributedAdasumOptimizer(optimizer, named_parameters, compression, backward_passes_per_step)
