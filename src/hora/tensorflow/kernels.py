"""The kernels: each collective as a Python function on eager tensors.

A kernel is called as ``kernel(key, *tensors)`` (see ``bridge.run``): at once when
eager, or as a ``tf.py_function`` op inside a graph, with the key of its unnamed
collective drawn when the op was built (None when eager: the binding numbers the
collective when it is called). It hands its tensors to the shared binding core
(``hora.core.binding`` with ``bridge.ADAPTER``), which names them, runs the local checks
and queues them, a group all at once or not at all, a failed check failing the
collective on every rank. The kernel then waits for every handle it queued before
raising the first error (``binding.wait_all``), so nothing it queued stays in flight,
and returns eager tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf  # type: ignore[import-untyped]

from hora.core import binding
from hora.core.process_sets import ProcessSet
from hora.tensorflow import bridge
from hora.tensorflow.bridge import ADAPTER, Kernel


def _outputs(queued: binding.Queued, grouped: bool) -> list[Any]:
    """Waits for every handle of a call; its results as the kernel's list of outputs."""
    result = queued.finish(binding.wait_all(queued.handles))
    return list(result) if grouped else [result]


def allreduce(
    name: str | None, op: int, prescale: float, postscale: float, process_set: ProcessSet, grouped: bool
) -> Kernel:
    """Kernel: reduces each input over the set; outputs keep the inputs' shapes and dtypes."""

    def kernel(key: str | None, *tensors: Any) -> list[Any]:
        queued = binding.allreduce_submit(
            ADAPTER, tensors, name, op, prescale, postscale, process_set, False, grouped, key
        )
        return _outputs(queued, grouped)

    return kernel


def allgather(name: str | None, process_set: ProcessSet, grouped: bool) -> Kernel:
    """Kernel: concatenates each input over the set along dimension 0, in set-rank order."""

    def kernel(key: str | None, *tensors: Any) -> list[Any]:
        return _outputs(binding.allgather_submit(ADAPTER, tensors, name, process_set, grouped, key), grouped)

    return kernel


def broadcast(name: str | None, root_rank: int, process_set: ProcessSet, grouped: bool) -> Kernel:
    """Kernel: every input takes the root's value (several inputs: queued at once)."""

    def kernel(key: str | None, *tensors: Any) -> list[Any]:
        queued = binding.broadcast_submit(ADAPTER, tensors, root_rank, name, process_set, False, grouped, key)
        return _outputs(queued, grouped)

    return kernel


def alltoall(name: str | None, process_set: ProcessSet) -> Kernel:
    """Kernel on (tensor, splits): returns (received rows, rows received from each rank).

    An empty ``splits`` tensor means "split evenly".
    """

    def kernel(key: str | None, tensor: Any, splits: Any) -> list[Any]:
        queued = binding.alltoall_submit(ADAPTER, tensor, splits, name, process_set, key)
        received: list[Any] = queued.finish(binding.wait_all(queued.handles))
        return received

    return kernel


def reducescatter(
    name: str | None, op: int, prescale: float, postscale: float, process_set: ProcessSet, grouped: bool
) -> Kernel:
    """Kernel: reduces each input over the set; each rank keeps its rows of dimension 0."""

    def kernel(key: str | None, *tensors: Any) -> list[Any]:
        queued = binding.reducescatter_submit(
            ADAPTER, tensors, name, op, process_set, prescale, postscale, grouped, key
        )
        return _outputs(queued, grouped)

    return kernel


def scalar(value: Callable[[], Any]) -> Kernel:
    """Kernel: an int32 scalar computed when the op runs (rank, size, ...); no collective,
    so it ignores its key."""

    def kernel(key: str | None) -> list[Any]:
        return [tf.constant(int(value()), dtype=tf.int32)]

    return kernel
