"""The collectives every framework binding offers, written once against an ``Adapter``.

A binding (``hora.numpy``, ``hora.torch``) supplies an adapter that turns its tensors
into the core's flat wire buffers and the core's result arrays back into tensors; the
functions here do the rest: resolve the op, name the tensor, stage every tensor of a
call before queueing any (so a bad tensor leaves nothing half-submitted), queue, and
file the handle with the conversion that ``synchronize`` applies. The bindings' public
functions only fix Horovod's signatures and call these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from hora import ops
from hora.collectives.reduce import ADASUM
from hora.api import current
from hora.engine.handles import Handle
from hora.engine.messages import RequestType, tensor_label
from hora.process_sets import ProcessSet
from hora.runtime import Runtime

Finish = Callable[[], Any]


class Adapter(Protocol):
    """How one framework's tensors meet the core."""

    def stage(self, tensor: Any, writable: bool, what: str) -> tuple[ops.Tensor, Finish]:
        """Returns the tensor's wire view and what an in-place collective returns once done.

        Raises:
            ValueError: the tensor cannot be moved (type, layout, not contiguous when
                ``writable``), with ``what`` (the operation) in the message.
        """

    def output(self, tensor: Any, wire: ops.Tensor) -> tuple[np.ndarray, Finish]:
        """A new result buffer shaped like ``tensor``: the flat view the core fills, and
        what an out-of-place collective returns once done."""

    def wrap(self, array: np.ndarray, like: Any) -> Any:
        """A result array from the core as a tensor like ``like`` (its dtype and device)."""

    def splits(self, splits: Any) -> Sequence[int] | np.ndarray | None:
        """Alltoall's splits as a sequence of numbers (None: split evenly; ``ops.alltoall``
        checks them).

        Raises:
            ValueError: splits of a kind the framework does not accept.
        """

    def alltoall_result(self, output: Any, received: np.ndarray, splits_given: bool) -> Any:
        """What alltoall's ``synchronize`` returns, from the received rows and splits."""


def _register_group(runtime: Runtime, handle_id: int, handles: list[Handle], finishers: list[Callable[[Any], Any]]) -> int:
    return runtime.register(handle_id, handles, lambda results: [f(r) for f, r in zip(finishers, results)])


def _staged_pair(adapter: Adapter, tensor: Any, what: str, inplace: bool) -> tuple[ops.Tensor, np.ndarray, Finish]:
    """Stages a tensor for an allreduce or broadcast: its wire view, the output view, the finish."""
    wire, done = adapter.stage(tensor, inplace, what)
    if inplace:
        return wire, wire.data, done
    output, finish = adapter.output(tensor, wire)
    return wire, output, finish


def allreduce_async(
    adapter: Adapter,
    tensors: Sequence[Any],
    average: bool | None,
    name: str | None,
    op: int | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    inplace: bool,
    grouped: bool,
) -> int:
    """Queues an allreduce of one tensor, or a grouped allreduce of several; returns the handle id."""
    runtime = current()
    op = ops.resolve_op(op, average)
    kind = RequestType.ADASUM if op == ADASUM else RequestType.ALLREDUCE
    handle_id = runtime.next_id()
    if not grouped:
        full = ops.full_name(runtime, "allreduce", name, process_set)
        with ops.refusal(runtime, kind, [full], process_set):
            wire, output, finish = _staged_pair(adapter, tensors[0], tensor_label("allreduce", full), inplace)
            handle = ops.allreduce(runtime, wire, output, full, op, prescale_factor, postscale_factor, process_set)
        return runtime.register(handle_id, handle, lambda _: finish())
    base = ops.full_name(runtime, "grouped_allreduce", name, process_set)
    names = ops.group_names(base, len(tensors))
    group = (base, len(tensors))
    with ops.refusal(runtime, kind, names, process_set, group):
        prepared = [_staged_pair(adapter, t, tensor_label("allreduce", full), inplace) for t, full in zip(tensors, names)]
        with runtime.batch():  # the whole group reaches the engine at once, or none of it
            handles = [
                ops.allreduce(runtime, wire, output, full, op, prescale_factor, postscale_factor, process_set, group)
                for (wire, output, _), full in zip(prepared, names)
            ]
    return _register_group(runtime, handle_id, handles, [(lambda f: lambda _: f())(f) for _, _, f in prepared])


def allgather_async(adapter: Adapter, tensors: Sequence[Any], name: str | None, process_set: ProcessSet, grouped: bool) -> int:
    """Queues an allgather of one tensor, or of several as one group; returns the handle id."""
    runtime = current()
    handle_id = runtime.next_id()
    kind = RequestType.ALLGATHER
    if not grouped:
        full = ops.full_name(runtime, "allgather", name, process_set)
        with ops.refusal(runtime, kind, [full], process_set):
            wire, _ = adapter.stage(tensors[0], False, tensor_label("allgather", full))
            handle = ops.allgather(runtime, wire, full, process_set)
        return runtime.register(handle_id, handle, lambda result: adapter.wrap(result, tensors[0]))
    base = ops.full_name(runtime, "grouped_allgather", name, process_set)
    names = ops.group_names(base, len(tensors))
    group = (base, len(tensors))
    with ops.refusal(runtime, kind, names, process_set, group):
        wires = [adapter.stage(t, False, tensor_label("allgather", full))[0] for t, full in zip(tensors, names)]
        with runtime.batch():  # the whole group reaches the engine at once, or none of it
            handles = [ops.allgather(runtime, wire, full, process_set, group) for wire, full in zip(wires, names)]
    return _register_group(runtime, handle_id, handles, [(lambda t: lambda r: adapter.wrap(r, t))(t) for t in tensors])


def broadcast_async(
    adapter: Adapter, tensor: Any, root_rank: int, name: str | None, process_set: ProcessSet, inplace: bool
) -> int:
    """Queues a broadcast from ``root_rank`` (a global rank, a member of the set); returns the handle id."""
    runtime = current()
    handle_id = runtime.next_id()
    full = ops.full_name(runtime, "broadcast", name, process_set)
    with ops.refusal(runtime, RequestType.BROADCAST, [full], process_set):
        wire, output, finish = _staged_pair(adapter, tensor, tensor_label("broadcast", full), inplace)
        handle = ops.broadcast(runtime, wire, output, root_rank, full, process_set)
    return runtime.register(handle_id, handle, lambda _: finish())


def alltoall_async(adapter: Adapter, tensor: Any, splits: Any, name: str | None, process_set: ProcessSet) -> int:
    """Queues an alltoall; returns the handle id."""
    runtime = current()
    handle_id = runtime.next_id()
    full = ops.full_name(runtime, "alltoall", name, process_set)
    with ops.refusal(runtime, RequestType.ALLTOALL, [full], process_set):
        wire, _ = adapter.stage(tensor, False, tensor_label("alltoall", full))
        split_list = adapter.splits(splits)
        handle = ops.alltoall(runtime, wire, split_list, full, process_set)

    def finish(result: tuple[np.ndarray, np.ndarray]) -> Any:
        output, received = result
        return adapter.alltoall_result(adapter.wrap(output, tensor), received, split_list is not None)

    return runtime.register(handle_id, handle, finish)


def reducescatter_async(
    adapter: Adapter,
    tensors: Sequence[Any],
    name: str | None,
    op: int,
    process_set: ProcessSet,
    prescale_factor: float,
    postscale_factor: float,
    grouped: bool,
) -> int:
    """Queues a reducescatter of one tensor, or of several as one group; returns the handle id."""
    runtime = current()
    handle_id = runtime.next_id()
    kind = RequestType.REDUCESCATTER
    if not grouped:
        full = ops.full_name(runtime, "reducescatter", name, process_set)
        with ops.refusal(runtime, kind, [full], process_set):
            wire, _ = adapter.stage(tensors[0], False, tensor_label("reducescatter", full))
            handle = ops.reducescatter(runtime, wire, full, int(op), prescale_factor, postscale_factor, process_set)
        return runtime.register(handle_id, handle, lambda result: adapter.wrap(result, tensors[0]))
    base = ops.full_name(runtime, "grouped_reducescatter", name, process_set)
    names = ops.group_names(base, len(tensors))
    group = (base, len(tensors))
    with ops.refusal(runtime, kind, names, process_set, group):
        wires = [adapter.stage(t, False, tensor_label("reducescatter", full))[0] for t, full in zip(tensors, names)]
        with runtime.batch():  # the whole group reaches the engine at once, or none of it
            handles = [
                ops.reducescatter(runtime, wire, full, int(op), prescale_factor, postscale_factor, process_set, group)
                for wire, full in zip(wires, names)
            ]
    return _register_group(runtime, handle_id, handles, [(lambda t: lambda r: adapter.wrap(r, t))(t) for t in tensors])
