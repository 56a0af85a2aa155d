"""The kernels: each collective as a Python function on eager tensors.

A kernel takes eager tensors, hands zero-copy views of them to the core (``hora.ops``),
waits for the results and returns eager tensors. ``bridge.run`` calls it directly
when eager, or as a ``tf.py_function`` op inside ``tf.function``. Names of unnamed
collectives are drawn when the kernel *runs*, so they follow execution order, which
every rank shares.

A kernel validates every input before it submits any, so a local error never
leaves part of a group in flight; it then waits for every handle it submitted before
raising the first error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf  # type: ignore[import-untyped]

from hora import ops
from hora.api import current
from hora.engine.handles import Handle
from hora.process_sets import ProcessSet
from hora.tensorflow import bridge
from hora.tensorflow.bridge import Kernel


def _names(op: str, name: str | None, count: int, grouped: bool, process_set: ProcessSet) -> tuple[list[str], str]:
    base = ops.full_name(current(), f"grouped_{op}" if grouped else op, name, process_set)
    return (bridge.group_names(base, count) if grouped else [base]), base


def allreduce(
    name: str | None, op: int, prescale: float, postscale: float, process_set: ProcessSet, grouped: bool
) -> Kernel:
    """Kernel: reduces each input over the set; outputs keep the inputs' shapes and dtypes."""

    def kernel(*tensors: Any) -> list[Any]:
        runtime = current()
        wires = [bridge.view(t) for t in tensors]
        names, base = _names("allreduce", name, len(tensors), grouped, process_set)
        group = (base, len(tensors)) if grouped else ("", 0)
        outputs = [bridge.empty(w.data.size, w.data.dtype) for w in wires]
        handles = [
            ops.allreduce(runtime, w, out, full, op, prescale, postscale, process_set, group)
            for w, out, full in zip(wires, outputs, names)
        ]
        bridge.wait_all(handles)
        return [bridge.wrap(out, w.shape, t.dtype) for out, w, t in zip(outputs, wires, tensors)]

    return kernel


def allgather(name: str | None, process_set: ProcessSet, grouped: bool) -> Kernel:
    """Kernel: concatenates each input over the set along dimension 0, in set-rank order."""

    def kernel(*tensors: Any) -> list[Any]:
        runtime = current()
        wires = [bridge.view(t) for t in tensors]
        names, base = _names("allgather", name, len(tensors), grouped, process_set)
        group = (base, len(tensors)) if grouped else ("", 0)
        handles = [ops.allgather(runtime, w, full, process_set, group) for w, full in zip(wires, names)]
        results = bridge.wait_all(handles)
        return [bridge.wrap(r, r.shape, t.dtype) for r, t in zip(results, tensors)]

    return kernel


def broadcast(name: str | None, root_rank: int, process_set: ProcessSet, grouped: bool) -> Kernel:
    """Kernel: every input takes the root's value."""

    def kernel(*tensors: Any) -> list[Any]:
        runtime = current()
        wires = [bridge.view(t) for t in tensors]
        names, _ = _names("broadcast", name, len(tensors), grouped, process_set)
        outputs = [bridge.empty(w.data.size, w.data.dtype) for w in wires]
        handles = [
            ops.broadcast(runtime, w, out, root_rank, full, process_set) for w, out, full in zip(wires, outputs, names)
        ]
        bridge.wait_all(handles)
        return [bridge.wrap(out, w.shape, t.dtype) for out, w, t in zip(outputs, wires, tensors)]

    return kernel


def alltoall(name: str | None, process_set: ProcessSet) -> Kernel:
    """Kernel on (tensor, splits): returns (received rows, rows received from each rank).

    An empty ``splits`` tensor means "split evenly".
    """

    def kernel(tensor: Any, splits: Any) -> list[Any]:
        runtime = current()
        wire = bridge.view(tensor)
        split_list = splits.numpy().reshape(-1) if int(tf.size(splits)) else None
        (full,), _ = _names("alltoall", name, 1, False, process_set)
        handle = ops.alltoall(runtime, wire, split_list, full, process_set)
        result, received = bridge.wait_all([handle])[0]
        return [bridge.wrap(result, result.shape, tensor.dtype), tf.constant(np.asarray(received, dtype=np.int32))]

    return kernel


def reducescatter(
    name: str | None, op: int, prescale: float, postscale: float, process_set: ProcessSet, grouped: bool
) -> Kernel:
    """Kernel: reduces each input over the set; each rank keeps its rows of dimension 0."""

    def kernel(*tensors: Any) -> list[Any]:
        runtime = current()
        wires = [bridge.view(t) for t in tensors]
        names, base = _names("reducescatter", name, len(tensors), grouped, process_set)
        group = (base, len(tensors)) if grouped else ("", 0)
        handles: list[Handle] = [
            ops.reducescatter(runtime, w, full, op, prescale, postscale, process_set, group)
            for w, full in zip(wires, names)
        ]
        results = bridge.wait_all(handles)
        return [bridge.wrap(r, r.shape, t.dtype) for r, t in zip(results, tensors)]

    return kernel


def scalar(value: Any) -> Kernel:
    """Kernel: an int32 scalar computed when the op runs (rank, size, ...)."""

    def kernel() -> list[Any]:
        return [tf.constant(int(value()), dtype=tf.int32)]

    return kernel
