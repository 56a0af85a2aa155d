"""The collectives every framework binding offers, written once against an ``Adapter``.

A binding (``hora.numpy``, ``hora.torch``, ``hora.tensorflow``) supplies an adapter that
turns its tensors into the core's flat wire buffers and the core's result arrays back
into tensors; the functions here do the rest: name the call's tensors, run the local
checks, stage every tensor of a group before any of it reaches the engine (so a bad
tensor leaves nothing half-submitted), queue, and say how the results become the call's
result.

Two layers:

* ``*_submit`` queue a call and return ``Queued``: its handles and its ``finish``. The
  TensorFlow kernels use these directly and wait for every handle themselves.
* ``*_async`` submit and file the handles under an id for ``poll``/``synchronize``;
  ``hora.numpy`` and ``hora.torch`` only fix Horovod's signatures and call these.

Names (one rule for every framework, ``full_name``): a named tensor is ``<op>.<name>``;
an unnamed one ``<op>.noname.<set id>.<key>``, where the key is either drawn by the
caller (a TensorFlow graph draws one per op when the graph is built, so it does not
depend on the order TensorFlow runs ops in) or, when the caller has none, the count of
unnamed ``<op>`` calls this rank made in the set (``ops.full_name``). A grouped call's
tensors are ``<base>_0``, ``<base>_1``, ... (``ops.group_names``).

All or nothing: a check that fails on this rank for any tensor of a call (its
``ops.refusal`` block) raises here and is sent to the coordinator under every name of
the call, so every rank fails the whole call naming this rank, and no tensor of a
group reaches the engine unless all of them do (``Runtime.batch``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from hora.core import ops
from hora.core.api import current
from hora.collectives.reduce import ADASUM
from hora.engine.handles import Handle
from hora.engine.messages import RequestType, tensor_label
from hora.core.process_sets import ProcessSet
from hora.core.runtime import Runtime

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


@dataclasses.dataclass(frozen=True)
class Queued:
    """The collectives one call queued.

    Attributes:
        handles: one per tensor of the call, in the call's order.
        finish: turns the handles' results (in the same order) into the call's result:
            one tensor for a single-tensor call, a list for a grouped one.
    """

    handles: list[Handle]
    finish: Callable[[list[Any]], Any]


# What queues one tensor of a call: (tensor, its full name, the group on the wire) ->
# its handle and what turns the handle's result into the framework's result.
SubmitOne = Callable[[Any, str, tuple[str, int]], tuple[Handle, Callable[[Any], Any]]]


def full_name(runtime: Runtime, op: str, name: str | None, process_set: ProcessSet, key: str | None = None) -> str:
    """The name of a call's tensor, or of a grouped call the base of its tensors' names.

    Args:
        op: the operation as names spell it (``allreduce``, ``grouped_allreduce``, ...).
        name: the name the program gave, or None.
        key: for an unnamed tensor, the key its caller drew (the same on every rank);
            None: numbered now, by this rank's count of unnamed ``op`` calls in the set.

    Returns:
        ``<op>.<name>``, ``<op>.noname.<set id>.<key>`` or ``<op>.noname.<set id>.<n>``.
    """
    if name is not None or key is None:
        return ops.full_name(runtime, op, name, process_set)
    return f"{op}.noname.{process_set.process_set_id or 0}.{key}"


def call_names(
    runtime: Runtime,
    op: str,
    name: str | None,
    process_set: ProcessSet,
    grouped: bool,
    count: int,
    key: str | None,
    wire_group: bool = True,
) -> tuple[str, list[str], tuple[str, int]]:
    """The names of one call's tensors (see the module) and its group on the wire.

    Args:
        op: the operation as names spell it without ``grouped_`` (``allreduce``, ...).
        count: how many tensors the call has.
        wire_group: False for calls whose tensors travel as collectives of their own.

    Returns:
        ``(base, names, group)``: the call's base name, one name per tensor, and
        ``(base, count)`` for a group on the wire, else ``("", 0)``.
    """
    base = full_name(runtime, f"grouped_{op}" if grouped else op, name, process_set, key)
    names = ops.group_names(base, count) if grouped else [base]
    return base, names, ((base, count) if grouped and wire_group else ("", 0))


def _queue(
    kind: RequestType,
    op: str,
    tensors: Sequence[Any],
    name: str | None,
    process_set: ProcessSet,
    grouped: bool,
    key: str | None,
    submit: SubmitOne,
    wire_group: bool = True,
) -> Queued:
    """Names a call's tensors and queues each with ``submit``; all or nothing (see the module).

    ``wire_group=False`` queues a grouped call's tensors at once under a group's names
    but as collectives of their own (broadcast: Horovod has no grouped broadcast).
    """
    runtime = current()
    base, names, group = call_names(runtime, op, name, process_set, grouped, len(tensors), key, wire_group)
    with ops.refusal(runtime, kind, names, process_set, group):
        if not grouped:
            handle, finish_one = submit(tensors[0], base, group)
            return Queued([handle], lambda results: finish_one(results[0]))
        # Staging happens inside the batch: a tensor that cannot be staged leaves
        # nothing of the group queued.
        with runtime.batch():
            queued = [submit(tensor, full, group) for tensor, full in zip(tensors, names)]
    finishers = [finish for _, finish in queued]
    return Queued([handle for handle, _ in queued], lambda results: [f(r) for f, r in zip(finishers, results)])


def _register(queued: Queued) -> int:
    runtime = current()
    return runtime.register(runtime.next_id(), queued.handles, queued.finish)


def _staged_pair(adapter: Adapter, tensor: Any, what: str, inplace: bool) -> tuple[ops.Tensor, np.ndarray, Finish]:
    """Stages a tensor for an allreduce or broadcast: its wire view, the output view, the finish."""
    wire, done = adapter.stage(tensor, inplace, what)
    if inplace:
        return wire, wire.data, done
    output, finish = adapter.output(tensor, wire)
    return wire, output, finish


# ----- allreduce -----


def allreduce_submit(
    adapter: Adapter,
    tensors: Sequence[Any],
    name: str | None,
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    inplace: bool,
    grouped: bool,
    key: str | None = None,
) -> Queued:
    """Queues an allreduce of one tensor, or a grouped allreduce of several.

    Args:
        op: the reduce op, resolved already (``ops.resolve_op``).
        key: for an unnamed call, the key drawn by the caller (see ``full_name``).

    Raises:
        ValueError: a local check failed (also sent to the other ranks: see the module).
    """
    runtime = current()
    kind = RequestType.ADASUM if op == ADASUM else RequestType.ALLREDUCE

    def submit(tensor: Any, full: str, group: tuple[str, int]) -> tuple[Handle, Callable[[Any], Any]]:
        label = tensor_label("allreduce", full)
        wire, output, finish = _staged_pair(adapter, tensor, label, inplace)
        handle = ops.allreduce(
            runtime, wire, output, full, op, prescale_factor, postscale_factor, process_set, group, label
        )
        return handle, lambda _: finish()

    return _queue(kind, "allreduce", tensors, name, process_set, grouped, key, submit)


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
    resolved = ops.resolve_op(op, average)
    return _register(
        allreduce_submit(
            adapter, tensors, name, resolved, prescale_factor, postscale_factor, process_set, inplace, grouped
        )
    )


# ----- allgather -----


def allgather_submit(
    adapter: Adapter,
    tensors: Sequence[Any],
    name: str | None,
    process_set: ProcessSet,
    grouped: bool,
    key: str | None = None,
) -> Queued:
    """Queues an allgather of one tensor, or of several as one group (see ``allreduce_submit``)."""
    runtime = current()

    def submit(tensor: Any, full: str, group: tuple[str, int]) -> tuple[Handle, Callable[[Any], Any]]:
        wire, _ = adapter.stage(tensor, False, tensor_label("allgather", full))
        handle = ops.allgather(runtime, wire, full, process_set, group)
        return handle, lambda result: adapter.wrap(result, tensor)

    return _queue(RequestType.ALLGATHER, "allgather", tensors, name, process_set, grouped, key, submit)


def allgather_async(adapter: Adapter, tensors: Sequence[Any], name: str | None, process_set: ProcessSet, grouped: bool) -> int:
    """Queues an allgather of one tensor, or of several as one group; returns the handle id."""
    return _register(allgather_submit(adapter, tensors, name, process_set, grouped))


# ----- broadcast -----


def broadcast_submit(
    adapter: Adapter,
    tensors: Sequence[Any],
    root_rank: int,
    name: str | None,
    process_set: ProcessSet,
    inplace: bool,
    grouped: bool,
    key: str | None = None,
) -> Queued:
    """Queues a broadcast from ``root_rank`` of one tensor, or of several at once.

    Several tensors (``grouped``) take a group's names and reach the engine together,
    but travel as broadcasts of their own: Horovod has no grouped broadcast.
    """
    runtime = current()

    def submit(tensor: Any, full: str, group: tuple[str, int]) -> tuple[Handle, Callable[[Any], Any]]:
        wire, output, finish = _staged_pair(adapter, tensor, tensor_label("broadcast", full), inplace)
        handle = ops.broadcast(runtime, wire, output, root_rank, full, process_set)
        return handle, lambda _: finish()

    return _queue(
        RequestType.BROADCAST, "broadcast", tensors, name, process_set, grouped, key, submit, wire_group=False
    )


def broadcast_async(
    adapter: Adapter, tensor: Any, root_rank: int, name: str | None, process_set: ProcessSet, inplace: bool
) -> int:
    """Queues a broadcast from ``root_rank``; returns the handle id."""
    return _register(broadcast_submit(adapter, [tensor], root_rank, name, process_set, inplace, False))


# ----- alltoall -----


def alltoall_submit(
    adapter: Adapter, tensor: Any, splits: Any, name: str | None, process_set: ProcessSet, key: str | None = None
) -> Queued:
    """Queues an alltoall; its result is ``adapter.alltoall_result``'s."""
    runtime = current()

    def submit(tensor: Any, full: str, group: tuple[str, int]) -> tuple[Handle, Callable[[Any], Any]]:
        wire, _ = adapter.stage(tensor, False, tensor_label("alltoall", full))
        split_list = adapter.splits(splits)
        handle = ops.alltoall(runtime, wire, split_list, full, process_set)

        def finish(result: tuple[np.ndarray, np.ndarray]) -> Any:
            output, received = result
            return adapter.alltoall_result(adapter.wrap(output, tensor), received, split_list is not None)

        return handle, finish

    return _queue(RequestType.ALLTOALL, "alltoall", [tensor], name, process_set, False, key, submit)


def alltoall_async(adapter: Adapter, tensor: Any, splits: Any, name: str | None, process_set: ProcessSet) -> int:
    """Queues an alltoall; returns the handle id."""
    return _register(alltoall_submit(adapter, tensor, splits, name, process_set))


# ----- reducescatter -----


def reducescatter_submit(
    adapter: Adapter,
    tensors: Sequence[Any],
    name: str | None,
    op: int,
    process_set: ProcessSet,
    prescale_factor: float,
    postscale_factor: float,
    grouped: bool,
    key: str | None = None,
) -> Queued:
    """Queues a reducescatter of one tensor, or of several as one group."""
    runtime = current()

    def submit(tensor: Any, full: str, group: tuple[str, int]) -> tuple[Handle, Callable[[Any], Any]]:
        wire, _ = adapter.stage(tensor, False, tensor_label("reducescatter", full))
        handle = ops.reducescatter(runtime, wire, full, int(op), prescale_factor, postscale_factor, process_set, group)
        return handle, lambda result: adapter.wrap(result, tensor)

    return _queue(RequestType.REDUCESCATTER, "reducescatter", tensors, name, process_set, grouped, key, submit)


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
    return _register(
        reducescatter_submit(adapter, tensors, name, op, process_set, prescale_factor, postscale_factor, grouped)
    )


def wait_all(handles: Sequence[Handle]) -> list[Any]:
    """Waits for every handle (so none stays in flight), then raises the first error."""
    results: list[Any] = []
    error: BaseException | None = None
    for handle in handles:
        try:
            results.append(handle.wait())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others finished
            results.append(None)
            error = error or exc
    if error is not None:
        raise error
    return results


ALIGNMENT = 64  # bytes: what TensorFlow's kernels and JAX's CPU client need to adopt a buffer


def aligned_empty(count: int, dtype: np.dtype[Any]) -> np.ndarray:
    """A flat uninitialised array of ``count`` elements starting on an ``ALIGNMENT``
    boundary, so a framework can adopt it as a tensor's buffer without a copy (NumPy's
    own allocations are 16-byte aligned)."""
    nbytes = count * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + nbytes].view(dtype)
