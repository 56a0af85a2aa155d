"""Horovod's collectives on NumPy arrays, with horovod.torch's names, signatures and defaults.

Inputs are read in place (no copy when C-contiguous); the ``_`` variants write the
result into the input array itself. ``*_async`` functions return an integer handle for
``poll``/``synchronize``. bfloat16 arrays (``ml_dtypes.bfloat16``) are supported.

Example, on 2 ranks::

    hvd.allreduce(np.array([1.0, 2.0]) * (hvd.rank() + 1), op=hvd.Sum)
    # rank 0: array([3., 6.])   rank 1: array([3., 6.])
    hvd.allgather(np.full((hvd.rank() + 1, 2), hvd.rank()))
    # both ranks: array([[0, 0], [1, 1], [1, 1]])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hora import ops
from hora.api import current, synchronize
from hora.collectives.reduce import AVERAGE
from hora.compression import Compression, Compressor
from hora.process_sets import ProcessSet, global_process_set


def _restore(dtype: np.dtype[Any]) -> Callable[[np.ndarray], np.ndarray]:
    """Views a result held in wire storage (bfloat16 as uint16) as the caller's dtype."""
    if dtype.name == "bfloat16":
        return lambda result: result.view(dtype)
    return lambda result: result


def _group_names(base: str, count: int) -> list[str]:
    if count == 0:
        raise ValueError("grouped collectives need at least one tensor")
    return [f"{base}_{i}of{count}" for i in range(count)]


# ----- allreduce -----


def _allreduce_async(
    tensor: np.ndarray,
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
    tensor_ = ops.from_numpy(tensor, writable=inplace)
    output = tensor_.data if inplace else np.empty_like(tensor_.data)
    full = ops.full_name(runtime, "allreduce", name, process_set)
    handle = ops.allreduce(runtime, tensor_, output, full, op, prescale_factor, postscale_factor, process_set)
    restore = _restore(tensor.dtype)
    return runtime.register(handle_id, handle, (lambda _: tensor) if inplace else restore)


def allreduce_async(
    tensor: np.ndarray,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts averaging (or summing, ...) ``tensor`` over all ranks; returns a handle.

    Args:
        tensor: the array to reduce; it is not modified.
        average: deprecated; use ``op``.
        name: a name unique among this rank's unfinished collectives.
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor: multiplies each rank's input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks taking part.

    Returns:
        A handle for ``poll`` and ``synchronize`` (which returns the reduced array).
    """
    return _allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set, False)


def allreduce_async_(
    tensor: np.ndarray,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Like ``allreduce_async``, but writes the result into ``tensor`` itself."""
    return _allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set, True)


def allreduce(
    tensor: np.ndarray,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> np.ndarray:
    """Reduces ``tensor`` over all ranks and returns the result (see ``allreduce_async``).

    Args:
        compression: compresses the data in transit (``Compression.fp16`` halves floats).
    """
    compressed, ctx = compression.compress(tensor)
    handle = allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(synchronize(handle), ctx)  # type: ignore[no-any-return]


def allreduce_(
    tensor: np.ndarray,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> np.ndarray:
    """Reduces ``tensor`` over all ranks in place and returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))  # type: ignore[no-any-return]


def _grouped_allreduce_async(
    tensors: Sequence[np.ndarray],
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
    handles, finishers = [], []
    for tensor, full in zip(tensors, names):
        tensor_ = ops.from_numpy(tensor, writable=inplace)
        output = tensor_.data if inplace else np.empty_like(tensor_.data)
        handles.append(
            ops.allreduce(
                runtime, tensor_, output, full, op, prescale_factor, postscale_factor, process_set,
                group=(base, len(tensors)),
            )  # fmt: skip
        )
        finishers.append((lambda t: lambda _: t)(tensor) if inplace else _restore(tensor.dtype))
    return runtime.register(handle_id, handles, lambda results: [f(r) for f, r in zip(finishers, results)])


def grouped_allreduce_async(
    tensors: Sequence[np.ndarray],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts one allreduce per tensor, negotiated and fused as one group; returns a handle."""
    return _grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set, False)


def grouped_allreduce_async_(
    tensors: Sequence[np.ndarray],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Like ``grouped_allreduce_async``, writing each result into its input."""
    return _grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set, True)


def grouped_allreduce(
    tensors: Sequence[np.ndarray],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[np.ndarray]:
    """Reduces every tensor of the list over all ranks; returns the results in order."""
    pairs = [compression.compress(t) for t in tensors]
    handle = grouped_allreduce_async(
        [p[0] for p in pairs], average, name, op, prescale_factor, postscale_factor, process_set
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(synchronize(handle), pairs)]


def grouped_allreduce_(
    tensors: Sequence[np.ndarray],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[np.ndarray]:
    """Reduces every tensor of the list in place; returns them."""
    return synchronize(  # type: ignore[no-any-return]
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


# ----- allgather -----


def allgather_async(tensor: np.ndarray, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Starts concatenating every rank's ``tensor`` along dimension 0 (whose size may differ by rank)."""
    runtime = current()
    handle_id = runtime.next_id()
    handle = ops.allgather(runtime, ops.from_numpy(tensor), ops.full_name(runtime, "allgather", name, process_set), process_set)
    return runtime.register(handle_id, handle, _restore(tensor.dtype))


def allgather(tensor: np.ndarray, name: str | None = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenates every rank's ``tensor`` along dimension 0, in rank order."""
    return synchronize(allgather_async(tensor, name, process_set))  # type: ignore[no-any-return]


def grouped_allgather_async(
    tensors: Sequence[np.ndarray], name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts an allgather of each tensor, negotiated as one group."""
    runtime = current()
    handle_id = runtime.next_id()
    base = ops.full_name(runtime, "grouped_allgather", name, process_set)
    handles = [
        ops.allgather(runtime, ops.from_numpy(t), full, process_set, group=(base, len(tensors)))
        for t, full in zip(tensors, _group_names(base, len(tensors)))
    ]
    finishers = [_restore(t.dtype) for t in tensors]
    return runtime.register(handle_id, handles, lambda results: [f(r) for f, r in zip(finishers, results)])


def grouped_allgather(
    tensors: Sequence[np.ndarray], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[np.ndarray]:
    """Allgathers every tensor of the list; returns the results in order."""
    return synchronize(grouped_allgather_async(tensors, name, process_set))  # type: ignore[no-any-return]


# ----- broadcast -----


def _broadcast_async(
    tensor: np.ndarray, root_rank: int, name: str | None, process_set: ProcessSet, inplace: bool
) -> int:
    runtime = current()
    handle_id = runtime.next_id()
    tensor_ = ops.from_numpy(tensor, writable=inplace)
    output = tensor_.data if inplace else np.empty_like(tensor_.data)
    handle = ops.broadcast(
        runtime, tensor_, output, root_rank, ops.full_name(runtime, "broadcast", name, process_set), process_set
    )
    return runtime.register(handle_id, handle, (lambda _: tensor) if inplace else _restore(tensor.dtype))


def broadcast_async(
    tensor: np.ndarray, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts copying ``root_rank``'s ``tensor`` to every rank (into a new array)."""
    return _broadcast_async(tensor, root_rank, name, process_set, False)


def broadcast_async_(
    tensor: np.ndarray, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts copying ``root_rank``'s ``tensor`` into ``tensor`` on every rank."""
    return _broadcast_async(tensor, root_rank, name, process_set, True)


def broadcast(
    tensor: np.ndarray, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> np.ndarray:
    """Returns ``root_rank``'s ``tensor`` on every rank (``root_rank`` is a rank within the set)."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]


def broadcast_(
    tensor: np.ndarray, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> np.ndarray:
    """Overwrites ``tensor`` with ``root_rank``'s on every rank and returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]


# ----- alltoall -----


def alltoall_async(
    tensor: np.ndarray,
    splits: Sequence[int] | np.ndarray | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts sending slice ``i`` of ``tensor`` (along dimension 0) to rank ``i``.

    Args:
        tensor: rows to distribute, in destination-rank order.
        splits: rows for each rank; None splits evenly.
    """
    runtime = current()
    handle_id = runtime.next_id()
    handle = ops.alltoall(runtime, ops.from_numpy(tensor), splits, ops.full_name(runtime, "alltoall", name, process_set), process_set)
    restore = _restore(tensor.dtype)

    def finish(result: tuple[np.ndarray, np.ndarray]) -> Any:
        output, received = result
        return (restore(output), received) if splits is not None else restore(output)

    return runtime.register(handle_id, handle, finish)


def alltoall(
    tensor: np.ndarray,
    splits: Sequence[int] | np.ndarray | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Exchanges slices of ``tensor`` between all ranks.

    Returns:
        The received rows in source-rank order; with ``splits`` given, a tuple of
        (received rows, rows received from each rank).
    """
    return synchronize(alltoall_async(tensor, splits, name, process_set))


# ----- reducescatter -----


def reducescatter_async(
    tensor: np.ndarray,
    name: str | None = None,
    op: int = AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts reducing ``tensor`` over all ranks, each rank keeping its slice of dimension 0.

    With ``q, m = divmod(rows, size)``, rank ``r`` gets ``q + 1`` rows if ``r < m``, else ``q``.
    """
    runtime = current()
    handle_id = runtime.next_id()
    handle = ops.reducescatter(
        runtime, ops.from_numpy(tensor), ops.full_name(runtime, "reducescatter", name, process_set), op,
        prescale_factor, postscale_factor, process_set,
    )  # fmt: skip
    return runtime.register(handle_id, handle, _restore(tensor.dtype))


def reducescatter(
    tensor: np.ndarray,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> np.ndarray:
    """Reduces ``tensor`` over all ranks and returns this rank's slice (see ``reducescatter_async``)."""
    compressed, ctx = compression.compress(tensor)
    handle = reducescatter_async(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(synchronize(handle), ctx)  # type: ignore[no-any-return]


def grouped_reducescatter_async(
    tensors: Sequence[np.ndarray],
    name: str | None = None,
    op: int = AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts a reducescatter of each tensor, negotiated as one group."""
    runtime = current()
    handle_id = runtime.next_id()
    base = ops.full_name(runtime, "grouped_reducescatter", name, process_set)
    handles = [
        ops.reducescatter(
            runtime, ops.from_numpy(t), full, op, prescale_factor, postscale_factor, process_set,
            group=(base, len(tensors)),
        )  # fmt: skip
        for t, full in zip(tensors, _group_names(base, len(tensors)))
    ]
    finishers = [_restore(t.dtype) for t in tensors]
    return runtime.register(handle_id, handles, lambda results: [f(r) for f, r in zip(finishers, results)])


def grouped_reducescatter(
    tensors: Sequence[np.ndarray],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[np.ndarray]:
    """Reducescatters every tensor of the list; returns this rank's slices in order."""
    pairs = [compression.compress(t) for t in tensors]
    handle = grouped_reducescatter_async([p[0] for p in pairs], name, op, process_set, prescale_factor, postscale_factor)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(synchronize(handle), pairs)]
