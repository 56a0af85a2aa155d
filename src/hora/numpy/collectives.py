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

from hora.core import binding, ops
from hora.core.api import synchronize
from hora.collectives.reduce import AVERAGE
from hora.compression import Compression, Compressor
from hora.core.process_sets import ProcessSet, global_process_set


class NumpyAdapter:
    """NumPy arrays as the core moves them (``binding.Adapter``)."""

    @staticmethod
    def _restore(array: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
        # Results come back in wire storage: bfloat16 as uint16 (every other type as itself).
        return array if array.dtype == dtype else array.view(dtype)

    def stage(self, tensor: np.ndarray, writable: bool, what: str) -> tuple[ops.Tensor, Callable[[], Any]]:
        return ops.from_numpy(tensor, writable=writable), lambda: tensor

    def output(self, tensor: np.ndarray, wire: ops.Tensor) -> tuple[np.ndarray, Callable[[], Any]]:
        output = np.empty_like(wire.data)
        return output, lambda: self._restore(output.reshape(wire.shape), tensor.dtype)

    def wrap(self, array: np.ndarray, like: np.ndarray) -> np.ndarray:
        return self._restore(array, like.dtype)

    def splits(self, splits: Sequence[int] | np.ndarray | None) -> np.ndarray | None:
        return None if splits is None else np.asarray(splits).reshape(-1)  # ops checks they are integers

    def alltoall_result(self, output: np.ndarray, received: np.ndarray, splits_given: bool) -> Any:
        return (output, received) if splits_given else output


_ADAPTER = NumpyAdapter()


# ----- allreduce -----


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
        op: Average (default), Sum, Min, Max, Product or Adasum.
        prescale_factor: multiplies each rank's input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks taking part.

    Returns:
        A handle for ``poll`` and ``synchronize`` (which returns the reduced array).
    """
    return binding.allreduce_async(
        _ADAPTER, [tensor], average, name, op, prescale_factor, postscale_factor, process_set, False, False
    )


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
    return binding.allreduce_async(
        _ADAPTER, [tensor], average, name, op, prescale_factor, postscale_factor, process_set, True, False
    )


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
    return binding.allreduce_async(
        _ADAPTER, tensors, average, name, op, prescale_factor, postscale_factor, process_set, False, True
    )


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
    return binding.allreduce_async(
        _ADAPTER, tensors, average, name, op, prescale_factor, postscale_factor, process_set, True, True
    )


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
    return binding.allgather_async(_ADAPTER, [tensor], name, process_set, False)


def allgather(tensor: np.ndarray, name: str | None = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenates every rank's ``tensor`` along dimension 0, in rank order."""
    return synchronize(allgather_async(tensor, name, process_set))  # type: ignore[no-any-return]


def grouped_allgather_async(
    tensors: Sequence[np.ndarray], name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts an allgather of each tensor, negotiated as one group."""
    return binding.allgather_async(_ADAPTER, tensors, name, process_set, True)


def grouped_allgather(
    tensors: Sequence[np.ndarray], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[np.ndarray]:
    """Allgathers every tensor of the list; returns the results in order."""
    return synchronize(grouped_allgather_async(tensors, name, process_set))  # type: ignore[no-any-return]


# ----- broadcast -----


def broadcast_async(
    tensor: np.ndarray, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts copying ``root_rank``'s ``tensor`` to every rank (into a new array)."""
    return binding.broadcast_async(_ADAPTER, tensor, root_rank, name, process_set, False)


def broadcast_async_(
    tensor: np.ndarray, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts copying ``root_rank``'s ``tensor`` into ``tensor`` on every rank."""
    return binding.broadcast_async(_ADAPTER, tensor, root_rank, name, process_set, True)


def broadcast(
    tensor: np.ndarray, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> np.ndarray:
    """Returns ``root_rank``'s ``tensor`` on every rank of the set (``root_rank`` is a global
    rank, as in Horovod, also inside a process set)."""
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
    return binding.alltoall_async(_ADAPTER, tensor, splits, name, process_set)


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
    return binding.reducescatter_async(
        _ADAPTER, [tensor], name, op, process_set, prescale_factor, postscale_factor, False
    )


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
    return binding.reducescatter_async(
        _ADAPTER, tensors, name, op, process_set, prescale_factor, postscale_factor, True
    )


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
