"""The kernels: each collective as a Python function on eager tensors.

A kernel takes eager tensors, hands zero-copy views of them to the core (``hora.ops``),
waits for the results and returns eager tensors. ``bridge.run`` calls it directly
when eager, or as a ``tf.py_function`` op inside ``tf.function``. Names of unnamed
collectives are drawn when the kernel *runs*, so they follow execution order, which
every rank shares.

A kernel names its inputs first, then validates every input before it submits any,
so a local error never leaves part of a group in flight (and is sent to the other
ranks, which fail the collective too: ``ops.refusal``); a group is queued at once. It
then waits for every handle it submitted before raising the first error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf  # type: ignore[import-untyped]

from hora import ops
from hora.api import current
from hora.collectives.reduce import ADASUM
from hora.engine.handles import Handle
from hora.engine.messages import RequestType
from hora.process_sets import ProcessSet
from hora.tensorflow import bridge
from hora.tensorflow.bridge import Kernel


def _names(op: str, name: str | None, count: int, grouped: bool, process_set: ProcessSet) -> tuple[list[str], str]:
    base = ops.full_name(current(), f"grouped_{op}" if grouped else op, name, process_set)
    return (ops.group_names(base, count) if grouped else [base]), base


def _submit(
    kind: RequestType, op: str, name: str | None, tensors: Sequence[Any], grouped: bool, process_set: ProcessSet,
    queue: Callable[[list[ops.Tensor], list[str], tuple[str, int]], list[Handle]],
) -> tuple[list[ops.Tensor], list[Handle]]:  # fmt: skip
    """Names the inputs, views them, and queues them with ``queue(wires, names, group)``:
    a group all at once; a check that fails here fails on every rank (``ops.refusal``).
    Names are drawn first, so an input refused here still uses up its name."""
    runtime = current()
    names, base = _names(op, name, len(tensors), grouped, process_set)
    # Grouped broadcasts carry no group on the wire (see broadcast).
    group = (base, len(tensors)) if grouped and kind != RequestType.BROADCAST else ("", 0)
    with ops.refusal(runtime, kind, names, process_set, group):
        wires = [bridge.view(t) for t in tensors]
        if not grouped:
            return wires, queue(wires, names, group)
        with runtime.batch():  # the whole group reaches the engine at once, or none of it
            handles = queue(wires, names, group)
    return wires, handles


def allreduce(
    name: str | None, op: int, prescale: float, postscale: float, process_set: ProcessSet, grouped: bool
) -> Kernel:
    """Kernel: reduces each input over the set; outputs keep the inputs' shapes and dtypes."""
    kind = RequestType.ADASUM if op == ADASUM else RequestType.ALLREDUCE

    def kernel(*tensors: Any) -> list[Any]:
        outputs: list[np.ndarray] = []

        def queue(wires: list[ops.Tensor], names: list[str], group: tuple[str, int]) -> list[Handle]:
            outputs.extend(bridge.empty(w.data.size, w.data.dtype) for w in wires)
            return [
                ops.allreduce(current(), w, out, full, op, prescale, postscale, process_set, group)
                for w, out, full in zip(wires, outputs, names)
            ]

        wires, handles = _submit(kind, "allreduce", name, tensors, grouped, process_set, queue)
        bridge.wait_all(handles)
        return [bridge.wrap(out, w.shape, t.dtype) for out, w, t in zip(outputs, wires, tensors)]

    return kernel


def allgather(name: str | None, process_set: ProcessSet, grouped: bool) -> Kernel:
    """Kernel: concatenates each input over the set along dimension 0, in set-rank order."""

    def kernel(*tensors: Any) -> list[Any]:
        def queue(wires: list[ops.Tensor], names: list[str], group: tuple[str, int]) -> list[Handle]:
            return [ops.allgather(current(), w, full, process_set, group) for w, full in zip(wires, names)]

        _, handles = _submit(RequestType.ALLGATHER, "allgather", name, tensors, grouped, process_set, queue)
        results = bridge.wait_all(handles)
        return [bridge.wrap(r, r.shape, t.dtype) for r, t in zip(results, tensors)]

    return kernel


def broadcast(name: str | None, root_rank: int, process_set: ProcessSet, grouped: bool) -> Kernel:
    """Kernel: every input takes the root's value."""

    def kernel(*tensors: Any) -> list[Any]:
        outputs: list[np.ndarray] = []

        def queue(wires: list[ops.Tensor], names: list[str], group: tuple[str, int]) -> list[Handle]:
            outputs.extend(bridge.empty(w.data.size, w.data.dtype) for w in wires)
            return [
                ops.broadcast(current(), w, out, root_rank, full, process_set)
                for w, out, full in zip(wires, outputs, names)
            ]

        # A grouped broadcast is a list of broadcasts (no group on the wire), queued at once.
        wires, handles = _submit(RequestType.BROADCAST, "broadcast", name, tensors, grouped, process_set, queue)
        bridge.wait_all(handles)
        return [bridge.wrap(out, w.shape, t.dtype) for out, w, t in zip(outputs, wires, tensors)]

    return kernel


def alltoall(name: str | None, process_set: ProcessSet) -> Kernel:
    """Kernel on (tensor, splits): returns (received rows, rows received from each rank).

    An empty ``splits`` tensor means "split evenly".
    """

    def kernel(tensor: Any, splits: Any) -> list[Any]:
        def queue(wires: list[ops.Tensor], names: list[str], group: tuple[str, int]) -> list[Handle]:
            split_list = splits.numpy().reshape(-1) if int(tf.size(splits)) else None
            return [ops.alltoall(current(), wires[0], split_list, names[0], process_set)]

        _, handles = _submit(RequestType.ALLTOALL, "alltoall", name, [tensor], False, process_set, queue)
        result, received = bridge.wait_all(handles)[0]
        return [bridge.wrap(result, result.shape, tensor.dtype), tf.constant(np.asarray(received, dtype=np.int32))]

    return kernel


def reducescatter(
    name: str | None, op: int, prescale: float, postscale: float, process_set: ProcessSet, grouped: bool
) -> Kernel:
    """Kernel: reduces each input over the set; each rank keeps its rows of dimension 0."""

    def kernel(*tensors: Any) -> list[Any]:
        def queue(wires: list[ops.Tensor], names: list[str], group: tuple[str, int]) -> list[Handle]:
            return [
                ops.reducescatter(current(), w, full, op, prescale, postscale, process_set, group)
                for w, full in zip(wires, names)
            ]

        _, handles = _submit(RequestType.REDUCESCATTER, "reducescatter", name, tensors, grouped, process_set, queue)
        results = bridge.wait_all(handles)
        return [bridge.wrap(r, r.shape, t.dtype) for r, t in zip(results, tensors)]

    return kernel


def scalar(value: Any) -> Kernel:
    """Kernel: an int32 scalar computed when the op runs (rank, size, ...)."""

    def kernel() -> list[Any]:
        return [tf.constant(int(value()), dtype=tf.int32)]

    return kernel
