"""Horovod's asynchronous collectives and in-place collectives on torch tensors.

Each ``*_async`` function returns an integer handle for ``poll``/``synchronize``;
``synchronize`` returns torch tensors. The ``_`` variants write the result into the
input tensor's own storage (zero-copy for CPU tensors). The differentiable
out-of-place functions (``allreduce``, ``allgather``, ...) are in ``autograd.py``.

Example, on 2 ranks::

    t = torch.tensor([1.0, 2.0]) * (hvd.rank() + 1)
    hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Sum))
    # rank 0 and rank 1: t is tensor([3., 6.]), in its original storage
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hora import ops
from hora.api import current, synchronize
from hora.collectives.reduce import AVERAGE, SUM
from hora.process_sets import ProcessSet, global_process_set
from hora.torch import tensors as tt

Splits = Sequence[int] | torch.Tensor | None


def _group_names(base: str, count: int) -> list[str]:
    if count == 0:
        raise ValueError("grouped collectives need at least one tensor")
    return [f"{base}_{i}of{count}" for i in range(count)]


def _finish_allreduce(staged: tt.Staged, output: torch.Tensor, inplace: bool) -> Callable[[Any], torch.Tensor]:
    if inplace:
        return lambda _: tt.write_back(staged)
    return lambda _: tt.to_device(output, staged.tensor)


def _prepare(tensor: torch.Tensor, name: str, inplace: bool) -> tuple[tt.Staged, torch.Tensor, np.ndarray]:
    """Stages a tensor for an allreduce or broadcast; returns it, the result tensor and its flat view."""
    staged = tt.stage(tensor, writable=inplace, what=name)
    if inplace:
        return staged, staged.host, staged.wire.data
    output = tt.empty_host(staged)
    return staged, output, tt.numpy_view(output)


def _allreduce_async(
    tensor: torch.Tensor,
    average: bool | None,
    name: str | None,
    op: int | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    inplace: bool,
) -> int:
    runtime = current()
    op = ops.resolve_op(op, average)
    handle_id = runtime.next_id()
    full = ops.full_name(runtime, "allreduce", name, process_set)
    staged, output, out_view = _prepare(tensor, f"allreduce '{full}'", inplace)
    handle = ops.allreduce(runtime, staged.wire, out_view, full, op, prescale_factor, postscale_factor, process_set)
    return runtime.register(handle_id, handle, _finish_allreduce(staged, output, inplace))


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts reducing ``tensor`` over the ranks of the set; the input is not modified.

    Args:
        tensor: the tensor to reduce (same shape and dtype on every rank).
        average: deprecated; use ``op``.
        name: a name unique among this rank's unfinished collectives; ranks match
            tensors by name (unnamed ones by their order).
        op: Average (default), Sum, Min, Max, Product or Adasum.
        prescale_factor: multiplies each rank's input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks taking part.

    Returns:
        A handle for ``poll``/``synchronize``; ``synchronize`` returns a new tensor.

    Raises:
        ValueError: an unsupported dtype or op, a name already in flight, or this rank
            is not in ``process_set``.
    """
    return _allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set, False)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Like ``allreduce_async``, writing the result into ``tensor`` (which must be contiguous)."""
    return _allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set, True)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduces ``tensor`` over the ranks of the set in place and returns it."""
    handle = allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return synchronize(handle)  # type: ignore[no-any-return]


def _grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None,
    name: str | None,
    op: int | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    inplace: bool,
) -> int:
    runtime = current()
    op = ops.resolve_op(op, average)
    handle_id = runtime.next_id()
    base = ops.full_name(runtime, "grouped_allreduce", name, process_set)
    names = _group_names(base, len(tensors))
    # Stage every tensor before queueing any, so a bad tensor leaves nothing half-submitted.
    prepared = [_prepare(t, f"allreduce '{full}'", inplace) for t, full in zip(tensors, names)]
    handles = [
        ops.allreduce(
            runtime, staged.wire, out_view, full, op, prescale_factor, postscale_factor, process_set,
            group=(base, len(tensors)),
        )  # fmt: skip
        for (staged, _, out_view), full in zip(prepared, names)
    ]
    finishers = [_finish_allreduce(staged, output, inplace) for staged, output, _ in prepared]
    return runtime.register(handle_id, handles, lambda results: [f(r) for f, r in zip(finishers, results)])


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts one allreduce per tensor, negotiated and fused as one group; ``synchronize`` returns a list."""
    return _grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set, False)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Like ``grouped_allreduce_async``, writing each result into its input tensor."""
    return _grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set, True)


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduces every tensor of the list in place; returns them."""
    handle = grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    return synchronize(handle)  # type: ignore[no-any-return]


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None, op: int | None, process_set: ProcessSet = global_process_set
) -> Callable[[], torch.Tensor]:
    """Starts reducing a sparse COO tensor as two allgathers (indices, values), as Horovod does.

    Duplicate indices from different ranks are kept; they add up when the result is
    used or coalesced.

    Args:
        tensor: a sparse COO tensor (same dense shape on every rank).
        name: the base name of the two allgathers.
        op: Average or Sum (None means Average).

    Returns:
        A callable handle: calling it waits and returns the reduced sparse tensor.
    """
    op = AVERAGE if op is None else int(op)
    if op not in (AVERAGE, SUM):
        raise ValueError("sparse_allreduce_async supports op=Average or op=Sum only")
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async needs a sparse COO tensor; use allreduce_async for dense tensors")
    runtime = current()
    base = name if name is not None else ops.full_name(runtime, "sparse_allreduce", None, process_set)
    # Allgather concatenates along dimension 0, so indices travel transposed: (nnz, sparse dims).
    indices_handle = allgather_async(tensor._indices().t().contiguous(), f"{base}.indices", process_set)
    values_handle = allgather_async(tensor._values(), f"{base}.values", process_set)
    shape, size = tensor.shape, process_set.size() or 1

    def handle() -> torch.Tensor:
        values = synchronize(values_handle)
        indices = synchronize(indices_handle)
        if op == AVERAGE:
            values = values / size
        return torch.sparse_coo_tensor(indices.t(), values, shape)

    return handle


# ----- allgather -----


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Starts concatenating every rank's ``tensor`` along dimension 0 (its size may differ by rank).

    Returns:
        A handle; ``synchronize`` returns the concatenation, in rank order.
    """
    runtime = current()
    handle_id = runtime.next_id()
    full = ops.full_name(runtime, "allgather", name, process_set)
    staged = tt.stage(tensor, writable=False, what=f"allgather '{full}'")
    handle = ops.allgather(runtime, staged.wire, full, process_set)
    return runtime.register(handle_id, handle, _finish_array(tensor))


def _finish_array(like: torch.Tensor) -> Callable[[np.ndarray], torch.Tensor]:
    return lambda result: tt.to_device(tt.from_numpy(result, like.dtype), like)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts an allgather of each tensor, negotiated as one group; ``synchronize`` returns a list."""
    runtime = current()
    handle_id = runtime.next_id()
    base = ops.full_name(runtime, "grouped_allgather", name, process_set)
    names = _group_names(base, len(tensors))
    staged = [tt.stage(t, writable=False, what=f"allgather '{full}'") for t, full in zip(tensors, names)]
    handles = [
        ops.allgather(runtime, s.wire, full, process_set, group=(base, len(tensors))) for s, full in zip(staged, names)
    ]
    finishers = [_finish_array(t) for t in tensors]
    return runtime.register(handle_id, handles, lambda results: [f(r) for f, r in zip(finishers, results)])


# ----- broadcast -----


def _broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet, inplace: bool
) -> int:
    runtime = current()
    handle_id = runtime.next_id()
    full = ops.full_name(runtime, "broadcast", name, process_set)
    staged, output, out_view = _prepare(tensor, f"broadcast '{full}'", inplace)
    handle = ops.broadcast(runtime, staged.wire, out_view, root_rank, full, process_set)
    return runtime.register(handle_id, handle, _finish_allreduce(staged, output, inplace))


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts copying ``root_rank``'s tensor to every rank of the set, into a new tensor.

    ``root_rank`` is a rank within the process set (the global rank for the global set).
    """
    return _broadcast_async(tensor, root_rank, name, process_set, False)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts copying ``root_rank``'s tensor into ``tensor`` on every rank of the set."""
    return _broadcast_async(tensor, root_rank, name, process_set, True)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Overwrites ``tensor`` with ``root_rank``'s on every rank of the set and returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]


# ----- alltoall -----


def _splits_list(splits: Splits) -> list[int] | None:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"alltoall: splits must be an int32 tensor or a list of ints; got a {splits.dtype} tensor")
        return [int(s) for s in splits.reshape(-1).tolist()]
    return [int(s) for s in splits]


def alltoall_async(
    tensor: torch.Tensor,
    splits: Splits = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts sending slice ``i`` of ``tensor`` (along dimension 0) to rank ``i`` of the set.

    Args:
        tensor: rows to distribute, in destination-rank order.
        splits: rows for each rank (a list, or an int32 tensor); None splits evenly.

    Returns:
        A handle; ``synchronize`` returns ``(received rows, rows received from each
        rank as an int32 tensor)``, as Horovod's does.
    """
    runtime = current()
    handle_id = runtime.next_id()
    full = ops.full_name(runtime, "alltoall", name, process_set)
    staged = tt.stage(tensor, writable=False, what=f"alltoall '{full}'")
    handle = ops.alltoall(runtime, staged.wire, _splits_list(splits), full, process_set)

    def finish(result: tuple[np.ndarray, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = result
        return tt.to_device(tt.from_numpy(output, tensor.dtype), tensor), torch.from_numpy(received)

    return runtime.register(handle_id, handle, finish)


# ----- reducescatter -----


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts reducing ``tensor`` over the set, each rank keeping its slice of dimension 0.

    With ``q, m = divmod(rows, size)``, rank ``r`` gets ``q + 1`` rows if ``r < m``, else ``q``.
    ``op`` is Average or Sum.
    """
    runtime = current()
    handle_id = runtime.next_id()
    full = ops.full_name(runtime, "reducescatter", name, process_set)
    staged = tt.stage(tensor, writable=False, what=f"reducescatter '{full}'")
    handle = ops.reducescatter(
        runtime, staged.wire, full, int(op), prescale_factor, postscale_factor, process_set
    )
    return runtime.register(handle_id, handle, _finish_array(tensor))


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts a reducescatter of each tensor, negotiated as one group; ``synchronize`` returns a list."""
    runtime = current()
    handle_id = runtime.next_id()
    base = ops.full_name(runtime, "grouped_reducescatter", name, process_set)
    names = _group_names(base, len(tensors))
    staged = [tt.stage(t, writable=False, what=f"reducescatter '{full}'") for t, full in zip(tensors, names)]
    handles = [
        ops.reducescatter(
            runtime, s.wire, full, int(op), prescale_factor, postscale_factor, process_set,
            group=(base, len(tensors)),
        )  # fmt: skip
        for s, full in zip(staged, names)
    ]
    finishers = [_finish_array(t) for t in tensors]
    return runtime.register(handle_id, handles, lambda results: [f(r) for f, r in zip(finishers, results)])
