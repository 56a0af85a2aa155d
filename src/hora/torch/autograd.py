"""The out-of-place collectives, as autograd Functions with Horovod's gradients.

Gradients follow Horovod's definitions, so a model that differentiates through a
collective trains the same under hora:

- ``allreduce``: the gradient is the allreduce of the output gradients, with the
  same op and scale factors.
- ``allgather``: the output gradients are averaged over the set and each rank
  takes the rows of its own input.
- ``broadcast``: the output gradients are averaged over the set; the root gets
  them, every other rank gets zeros.
- ``alltoall``: the output gradients go back where the rows came from (an alltoall
  with the received splits).
- ``reducescatter``: the output gradients are allgathered, multiplied by the set
  size for Sum, and by the scale factors.

The grouped variants apply the same rules per tensor, with one grouped collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hora.core import ops
from hora.core.api import current, synchronize
from hora.collectives.reduce import AVERAGE
from hora.compression import Compression, Compressor
from hora.core.process_sets import ProcessSet, global_process_set
from hora.torch import collectives as c
from hora.torch.dynamo import outside_compile


def _apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)``, typed (torch leaves ``apply`` untyped)."""
    return function.apply(*args)  # type: ignore[no-untyped-call]


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce; backward is the same allreduce of the output gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        average: bool | None,
        name: str | None,
        op: int | None,
        prescale_factor: float,
        postscale_factor: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        # Horovod's arguments, in its order (``HorovodAllreduce.apply(tensor, average, name, ...)``).
        ctx.op, ctx.process_set = ops.resolve_op(op, average), process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        handle = c.allreduce_async(tensor, None, name, ctx.op, prescale_factor, postscale_factor, process_set)
        return synchronize(handle)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad = allreduce(
            grad_output, op=ctx.op, prescale_factor=ctx.prescale_factor,
            postscale_factor=ctx.postscale_factor, process_set=ctx.process_set,
        )  # fmt: skip
        return grad, None, None, None, None, None, None


@outside_compile
def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduces ``tensor`` over the ranks of the set and returns the result (differentiable).

    Args:
        tensor: the tensor to reduce; it is not modified.
        average: deprecated; use ``op``.
        name: a name unique among this rank's unfinished collectives.
        compression: compresses the data in transit (``Compression.fp16`` halves floats).
        op: Average (default), Sum, Min, Max, Product or Adasum.
        prescale_factor: multiplies each rank's input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks taking part.

    Returns:
        A new tensor of the same shape and dtype, the same on every rank.

    Example, on 2 ranks::

        hvd.allreduce(torch.tensor([1.0, 2.0]) * (hvd.rank() + 1))
        # rank 0: tensor([1.5000, 3.0000])   rank 1: tensor([1.5000, 3.0000])
    """
    op = ops.resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _apply(HorovodAllreduce, compressed, None, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)  # type: ignore[no-any-return]


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce; backward is the same grouped allreduce of the output gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        average: bool | None,
        name: str | None,
        op: int | None,
        prescale_factor: float,
        postscale_factor: float,
        process_set: ProcessSet,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        # Horovod's arguments, in its order (``HorovodGroupedAllreduce.apply(average, name, ..., *tensors)``).
        ctx.op, ctx.process_set = ops.resolve_op(op, average), process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        handle = c.grouped_allreduce_async(
            list(tensors), None, name, ctx.op, prescale_factor, postscale_factor, process_set
        )
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        grads = grouped_allreduce(
            list(grad_outputs), op=ctx.op, prescale_factor=ctx.prescale_factor,
            postscale_factor=ctx.postscale_factor, process_set=ctx.process_set,
        )  # fmt: skip
        return (None, None, None, None, None, None, *grads)


@outside_compile
def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduces every tensor of the list as one group (differentiable); returns the results in order."""
    op = ops.resolve_op(op, average)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _apply(
        HorovodGroupedAllreduce, None, name, op, prescale_factor, postscale_factor, process_set, *[p[0] for p in pairs]
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


def _offsets(rows: torch.Tensor, process_set: ProcessSet) -> list[int]:
    """Row offset of this rank's input in an allgather result, per tensor; ``rows`` is (size, k)."""
    me = process_set.rank() or 0
    return [int(v) for v in rows[:me].sum(dim=0).tolist()]


class HorovodAllgather(torch.autograd.Function):
    """Allgather; backward averages the output gradients and keeps this rank's rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.dim, ctx.process_set = int(tensor.shape[0]) if tensor.dim() else 0, process_set
        return synchronize(c.allgather_async(tensor, name, process_set))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad = allreduce(grad_output, op=AVERAGE, process_set=ctx.process_set)
        rows = allgather(torch.tensor([[ctx.dim]], dtype=torch.int64), process_set=ctx.process_set)
        return grad.narrow(0, _offsets(rows, ctx.process_set)[0], ctx.dim), None, None


@outside_compile
def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` along dimension 0, in rank order (differentiable).

    The tensors must agree in every dimension but the first.

    Example, on 2 ranks::

        hvd.allgather(torch.full((hvd.rank() + 1,), hvd.rank()))
        # both ranks: tensor([0, 1, 1])
    """
    return _apply(HorovodAllgather, tensor, name, process_set)  # type: ignore[no-any-return]


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather; backward as for allgather, per tensor."""

    @staticmethod
    def forward(
        ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.dims, ctx.process_set = [int(t.shape[0]) if t.dim() else 0 for t in tensors], process_set
        return tuple(synchronize(c.grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        grads = grouped_allreduce(list(grad_outputs), op=AVERAGE, process_set=ctx.process_set)
        rows = allgather(torch.tensor([ctx.dims], dtype=torch.int64), process_set=ctx.process_set)
        offsets = _offsets(rows, ctx.process_set)
        return (None, None, *[g.narrow(0, o, d) for g, o, d in zip(grads, offsets, ctx.dims)])


@outside_compile
def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[torch.Tensor]:
    """Allgathers every tensor of the list as one group (differentiable); returns the results in order."""
    return list(_apply(HorovodGroupedAllgather, name, process_set, *tensors))


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast; backward averages the output gradients onto the root (zeros elsewhere)."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(c.broadcast_async(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad = allreduce(grad_output, op=AVERAGE, process_set=ctx.process_set)
        if current().rank != ctx.root_rank:  # root_rank is a global rank
            grad = grad * 0  # as Horovod: a NaN or Inf gradient stays NaN
        return grad, None, None, None


@outside_compile
def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Returns ``root_rank``'s tensor on every rank of the set (differentiable); the input is not modified.

    ``root_rank`` is a global rank (a member of the set), as in Horovod.
    """
    return _apply(HorovodBroadcast, tensor, root_rank, name, process_set)  # type: ignore[no-any-return]


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall; backward sends the output gradients back with the received splits."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, splits: c.Splits, name: str | None, process_set: ProcessSet
    ) -> Any:
        output, received = synchronize(c.alltoall_async(tensor, splits, name, process_set))
        ctx.process_set, ctx.received = process_set, received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        grad, _received = alltoall(grad_output, splits=ctx.received, process_set=ctx.process_set)
        return grad, None, None, None


@outside_compile
def alltoall(
    tensor: torch.Tensor,
    splits: c.Splits = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Sends slice ``i`` of ``tensor`` (along dimension 0) to rank ``i`` of the set (differentiable).

    Args:
        tensor: rows to distribute, in destination-rank order.
        splits: rows for each rank (a list, or an int32 tensor); None splits evenly.

    Returns:
        The received rows in source-rank order; with ``splits`` given, a tuple of
        (received rows, an int32 tensor of the rows received from each rank).

    Raises:
        ValueError: the splits do not fit the tensor or the set, or are not int32.
    """
    return _apply(HorovodAlltoall, tensor, splits, name, process_set)


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter; backward allgathers the output gradients (times the set size for Sum)."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: int,
        process_set: ProcessSet,
        prescale_factor: float,
        postscale_factor: float,
    ) -> torch.Tensor:
        ctx.scale = ops.reducescatter_grad_scale(op, process_set.size() or 1, prescale_factor, postscale_factor)
        ctx.process_set = process_set
        handle = c.reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor)
        return synchronize(handle)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad = allgather(grad_output * ctx.scale if ctx.scale != 1.0 else grad_output, process_set=ctx.process_set)
        return grad, None, None, None, None, None


@outside_compile
def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduces ``tensor`` over the set and returns this rank's slice of dimension 0 (differentiable).

    With ``q, m = divmod(rows, size)``, rank ``r`` gets ``q + 1`` rows if ``r < m``, else ``q``.

    Example, on 2 ranks::

        hvd.reducescatter(torch.ones(3, 2), op=hvd.Sum)
        # rank 0: tensor([[2., 2.], [2., 2.]])   rank 1: tensor([[2., 2.]])
    """
    compressed, ctx = compression.compress(tensor)
    reduced = _apply(HorovodReducescatter, compressed, name, int(op), process_set, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)  # type: ignore[no-any-return]


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reducescatter; backward as for reducescatter, per tensor."""

    @staticmethod
    def forward(
        ctx: Any,
        name: str | None,
        op: int,
        process_set: ProcessSet,
        prescale_factor: float,
        postscale_factor: float,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.scale = ops.reducescatter_grad_scale(op, process_set.size() or 1, prescale_factor, postscale_factor)
        ctx.process_set = process_set
        handle = c.grouped_reducescatter_async(
            list(tensors), name, op, process_set, prescale_factor, postscale_factor
        )
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        scaled = [g * ctx.scale if ctx.scale != 1.0 else g for g in grad_outputs]
        return (None, None, None, None, None, *grouped_allgather(scaled, process_set=ctx.process_set))


@outside_compile
def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reducescatters every tensor of the list as one group (differentiable); returns this rank's slices."""
    pairs = [compression.compress(t) for t in tensors]
    reduced = _apply(HorovodGroupedReducescatter, 
        name, int(op), process_set, prescale_factor, postscale_factor, *[p[0] for p in pairs]
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


