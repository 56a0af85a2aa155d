"""Everything ``horovod.mxnet.mpi_ops`` offers: the basics, the op constants and the collectives on NDArrays.

Names, signatures and defaults are Horovod 0.28.1's. Each collective returns once its
result is in place: in a new NDArray, or for the ``_`` functions in the input NDArray's
own memory (see ``tensors`` for the zero-copy staging and MXNet's engine). Horovod's
MXNet collectives return at once and let MXNet's engine wait for the result instead;
either way every MXNet operation issued afterwards sees it.

``priority`` is accepted for Horovod's signatures and not used: hora's engine runs the
collectives of all ranks in one agreed order.

Example, on 2 ranks::

    x = mx.nd.array([1.0, 2.0]) * (hvd.rank() + 1)
    hvd.allreduce(x, op=hvd.Sum)       # both ranks: [3. 6.]
    hvd.allreduce_(x)                  # both ranks: x is now [1.5 3.], in its own memory
    hvd.allgather(mx.nd.full((hvd.rank() + 1, 2), hvd.rank()))
    # both ranks: [[0. 0.] [1. 1.] [1. 1.]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from mxnet.base import MXNetError
from mxnet.ndarray import NDArray

from hora.collectives.reduce import AVERAGE
from hora.core import basics as _basics
from hora.core import binding
from hora.core.api import synchronize
from hora.core.basics import *  # noqa: F403 - Horovod's basics, declared once
from hora.core.process_sets import ProcessSet, global_process_set
from hora.errors import CollectiveMismatchError
from hora.mxnet.tensors import ADAPTER

Collective = TypeVar("Collective", bound=Callable[..., Any])


class InvalidArgument(ValueError, MXNetError):  # type: ignore[misc]
    """A collective's arguments refused on this rank (on every rank of the collective):
    hora's ``ValueError`` and the ``MXNetError`` Horovod's MXNet ops raise."""


class MismatchError(CollectiveMismatchError, MXNetError):  # type: ignore[misc]
    """A collective the ranks disagree about: hora's ``CollectiveMismatchError`` and the
    ``MXNetError`` Horovod's MXNet ops raise."""


def _mxnet_errors(collective: Collective) -> Collective:
    """Raises the collective's refusals and disagreements as ``MXNetError`` s too
    (``InvalidArgument``, ``MismatchError``), so a Horovod program's ``except`` catches them."""

    @functools.wraps(collective)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return collective(*args, **kwargs)
        except MXNetError:
            raise
        except CollectiveMismatchError as exc:
            raise MismatchError(str(exc)) from None
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None

    return run  # type: ignore[return-value]


# ----- allreduce -----


def allreduce_async(
    tensors: Sequence[NDArray],
    average: bool | None,
    name: str | None,
    op: int | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    inplace: bool,
    grouped: bool,
) -> int:
    """Queues an allreduce (or a grouped one) and returns its handle id, for ``synchronize``.

    Not part of Horovod's MXNet API: the optimizer and the trainer queue every gradient
    with it before waiting for any, so the reductions overlap.
    """
    return binding.allreduce_async(
        ADAPTER, tensors, average, name, op, prescale_factor, postscale_factor, process_set, inplace, grouped
    )


@_mxnet_errors
def allreduce(
    tensor: NDArray,
    average: bool | None = None,
    name: str | None = None,
    priority: int = 0,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    op: int | None = None,
) -> NDArray:
    """Reduces ``tensor`` over the ranks of the set into a new NDArray; the input is not modified.

    Args:
        tensor: the NDArray to reduce (same shape and dtype on every rank).
        average: deprecated; use ``op``.
        name: a name unique among this rank's unfinished collectives; ranks match
            tensors by name (unnamed ones by their order).
        priority: accepted for Horovod's signature; not used.
        prescale_factor: multiplies each rank's input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks taking part.
        op: Average (default), Sum, Min, Max, Product or Adasum.

    Returns:
        A new NDArray of the same shape, dtype and context.

    Raises:
        ValueError: an unsupported dtype or op, a name already in flight, or this rank
            is not in ``process_set``.
        CollectiveMismatchError: the ranks disagree (shape, dtype, op, ...), on every rank.
    """
    handle = allreduce_async([tensor], average, name, op, prescale_factor, postscale_factor, process_set, False, False)
    return synchronize(handle)


@_mxnet_errors
def allreduce_(
    tensor: NDArray,
    average: bool | None = None,
    name: str | None = None,
    priority: int = 0,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    op: int | None = None,
) -> NDArray:
    """Reduces ``tensor`` over the ranks of the set in place and returns it (see ``allreduce``)."""
    handle = allreduce_async([tensor], average, name, op, prescale_factor, postscale_factor, process_set, True, False)
    return synchronize(handle)


@_mxnet_errors
def grouped_allreduce(
    tensors: Sequence[NDArray],
    average: bool | None = None,
    name: str | None = None,
    priority: int = 0,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    op: int | None = None,
) -> list[NDArray]:
    """Reduces every NDArray of the list, negotiated and fused as one group; returns new NDArrays.

    An empty list is returned as it is, as in Horovod.
    """
    if not tensors:
        return tensors  # type: ignore[return-value]  # Horovod returns its argument
    handle = allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set, False, True)
    return synchronize(handle)  # type: ignore[no-any-return]


@_mxnet_errors
def grouped_allreduce_(
    tensors: Sequence[NDArray],
    average: bool | None = None,
    name: str | None = None,
    priority: int = 0,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    op: int | None = None,
) -> list[NDArray]:
    """Reduces every NDArray of the list in place, as one group; returns them."""
    if not tensors:
        return tensors  # type: ignore[return-value]
    handle = allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set, True, True)
    return synchronize(handle)  # type: ignore[no-any-return]


# ----- allgather -----


@_mxnet_errors
def allgather(
    tensor: NDArray, name: str | None = None, priority: int = 0, process_set: ProcessSet = global_process_set
) -> NDArray:
    """Concatenates every rank's ``tensor`` along dimension 0, in rank order (the first
    dimension may differ by rank; the others must agree)."""
    return synchronize(binding.allgather_async(ADAPTER, [tensor], name, process_set, False))


@_mxnet_errors
def grouped_allgather(
    tensors: Sequence[NDArray], name: str | None = None, priority: int = 0, process_set: ProcessSet = global_process_set
) -> list[NDArray]:
    """Allgathers every NDArray of the list, negotiated as one group; returns the results in order."""
    if not tensors:
        return []
    return synchronize(binding.allgather_async(ADAPTER, tensors, name, process_set, True))  # type: ignore[no-any-return]


# ----- broadcast -----


@_mxnet_errors
def broadcast(
    tensor: NDArray,
    root_rank: int,
    name: str | None = None,
    priority: int = 0,
    process_set: ProcessSet = global_process_set,
) -> NDArray:
    """Returns ``root_rank``'s ``tensor`` on every rank of the set, in a new NDArray.

    ``root_rank`` is a global rank (a member of the set), as in Horovod.
    """
    return synchronize(binding.broadcast_async(ADAPTER, tensor, root_rank, name, process_set, False))


@_mxnet_errors
def broadcast_(
    tensor: NDArray,
    root_rank: int,
    name: str | None = None,
    priority: int = 0,
    process_set: ProcessSet = global_process_set,
) -> NDArray:
    """Overwrites ``tensor`` with ``root_rank``'s on every rank of the set and returns it."""
    return synchronize(binding.broadcast_async(ADAPTER, tensor, root_rank, name, process_set, True))


# ----- alltoall -----


@_mxnet_errors
def alltoall(
    tensor: NDArray,
    splits: Sequence[int] | NDArray | None = None,
    name: str | None = None,
    priority: int = 0,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Sends slice ``i`` of ``tensor`` (along dimension 0) to rank ``i`` of the set.

    Args:
        tensor: rows to distribute, in destination-rank order.
        splits: rows for each rank (a list or an integer NDArray); None splits evenly.

    Returns:
        The received rows in source-rank order; with ``splits`` given, a tuple of the
        received rows and the rows received from each rank (an int32 NDArray), as in Horovod.
    """
    return synchronize(binding.alltoall_async(ADAPTER, tensor, splits, name, process_set))


# ----- reducescatter -----


@_mxnet_errors
def reducescatter(
    tensor: NDArray,
    op: int = AVERAGE,
    name: str | None = None,
    priority: int = 0,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> NDArray:
    """Reduces ``tensor`` over the set (Average or Sum); each rank gets its slice of dimension 0.

    With ``q, m = divmod(rows, size)``, rank ``r`` gets ``q + 1`` rows if ``r < m``, else ``q``.
    """
    handle = binding.reducescatter_async(
        ADAPTER, [tensor], name, op, process_set, prescale_factor, postscale_factor, False
    )
    return synchronize(handle)


@_mxnet_errors
def grouped_reducescatter(
    tensors: Sequence[NDArray],
    op: int = AVERAGE,
    name: str | None = None,
    priority: int = 0,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[NDArray]:
    """Reducescatters every NDArray of the list as one group; returns this rank's slices in order."""
    if not tensors:
        return []
    handle = binding.reducescatter_async(
        ADAPTER, tensors, name, op, process_set, prescale_factor, postscale_factor, True
    )
    return synchronize(handle)  # type: ignore[no-any-return]


__all__ = [
    "allgather",
    "allreduce",
    "allreduce_",
    "alltoall",
    "broadcast",
    "broadcast_",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_reducescatter",
    "reducescatter",
]
__all__ += _basics.__all__  # the names every binding offers (hora.core.basics)
