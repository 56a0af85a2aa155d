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

from hora.core import binding, ops
from hora.core.api import current, synchronize
from hora.collectives.reduce import AVERAGE, SUM
from hora.core.process_sets import ProcessSet, global_process_set
from hora.torch import tensors as tt
from hora.torch.dynamo import outside_compile

Splits = Sequence[int] | torch.Tensor | None


class TorchAdapter:
    """Torch tensors as the core moves them (``binding.Adapter``): zero-copy for CPU
    tensors, staged through host memory for others (``tensors.stage``)."""

    def stage(self, tensor: torch.Tensor, writable: bool, what: str) -> tuple[ops.Tensor, Callable[[], Any]]:
        staged = tt.stage(tensor, writable=writable, what=what)
        return staged.wire, lambda: tt.write_back(staged)

    def output(self, tensor: torch.Tensor, wire: ops.Tensor) -> tuple[np.ndarray, Callable[[], Any]]:
        output = torch.empty(wire.shape, dtype=tensor.dtype)
        return tt.numpy_view(output), lambda: tt.to_device(output, tensor)

    def wrap(self, array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        return tt.to_device(tt.from_numpy(array, like.dtype), like)

    def splits(self, splits: Splits) -> Sequence[int] | None:
        if splits is None:
            return None
        if isinstance(splits, torch.Tensor):
            if splits.dtype != torch.int32:
                raise ValueError(
                    f"alltoall: splits must be an int32 tensor or a list of ints; got a {splits.dtype} tensor"
                )
            return [int(s) for s in splits.reshape(-1).tolist()]
        return list(splits)  # ops checks they are integers

    def alltoall_result(self, output: torch.Tensor, received: np.ndarray, splits_given: bool) -> Any:
        return output, torch.from_numpy(received)  # Horovod's alltoall_async always gives both


_ADAPTER = TorchAdapter()


@outside_compile
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
    return binding.allreduce_async(
        _ADAPTER, [tensor], average, name, op, prescale_factor, postscale_factor, process_set, False, False
    )


@outside_compile
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
    return binding.allreduce_async(
        _ADAPTER, [tensor], average, name, op, prescale_factor, postscale_factor, process_set, True, False
    )


@outside_compile
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


@outside_compile
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
    return binding.allreduce_async(
        _ADAPTER, tensors, average, name, op, prescale_factor, postscale_factor, process_set, False, True
    )


@outside_compile
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
    return binding.allreduce_async(
        _ADAPTER, tensors, average, name, op, prescale_factor, postscale_factor, process_set, True, True
    )


@outside_compile
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


@outside_compile
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


@outside_compile
def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Starts concatenating every rank's ``tensor`` along dimension 0 (its size may differ by rank).

    Returns:
        A handle; ``synchronize`` returns the concatenation, in rank order.
    """
    return binding.allgather_async(_ADAPTER, [tensor], name, process_set, False)


@outside_compile
def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts an allgather of each tensor, negotiated as one group; ``synchronize`` returns a list."""
    return binding.allgather_async(_ADAPTER, tensors, name, process_set, True)


# ----- broadcast -----


@outside_compile
def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts copying ``root_rank``'s tensor to every rank of the set, into a new tensor.

    ``root_rank`` is a global rank (a member of the set), as in Horovod.
    """
    return binding.broadcast_async(_ADAPTER, tensor, root_rank, name, process_set, False)


@outside_compile
def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts copying ``root_rank``'s tensor into ``tensor`` on every rank of the set."""
    return binding.broadcast_async(_ADAPTER, tensor, root_rank, name, process_set, True)


@outside_compile
def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Overwrites ``tensor`` with ``root_rank``'s on every rank of the set and returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]


# ----- alltoall -----


@outside_compile
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
    return binding.alltoall_async(_ADAPTER, tensor, splits, name, process_set)


# ----- reducescatter -----


@outside_compile
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
    return binding.reducescatter_async(
        _ADAPTER, [tensor], name, op, process_set, prescale_factor, postscale_factor, False
    )


@outside_compile
def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts a reducescatter of each tensor, negotiated as one group; ``synchronize`` returns a list."""
    return binding.reducescatter_async(
        _ADAPTER, tensors, name, op, process_set, prescale_factor, postscale_factor, True
    )
