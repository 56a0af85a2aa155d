"""Topology as ops, join and barrier for TensorFlow.

``rank_op()`` and friends return int32 scalars computed when the op *runs*, so a
``tf.function`` traced once keeps reporting the running job's values. ``join`` and
``barrier`` run eagerly at once and, inside ``tf.function``, in program order.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf  # type: ignore[import-untyped]

from hora.core import api
from hora.core.process_sets import ProcessSet, global_process_set
from hora.tensorflow import bridge, kernels


def _scalar_op(value: Any, what: str) -> Any:
    (out,) = bridge.run(kernels.scalar(value), [], [tf.int32], what)
    out.set_shape([])
    return out


def _members(process_set_id: int) -> tuple[int, ...]:
    members = api.current().engine.sets.get(int(process_set_id))
    if members is None:
        raise ValueError(f"process set {process_set_id} is not registered with the running job")
    return tuple(members)


def rank_op(name: str | None = None) -> Any:
    """An int32 scalar op: this process's rank."""
    return _scalar_op(api.rank, "rank_op")


def local_rank_op(name: str | None = None) -> Any:
    """An int32 scalar op: this process's rank on its host."""
    return _scalar_op(api.local_rank, "local_rank_op")


def size_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """An int32 scalar op: the number of ranks in the process set (default: the job)."""
    return _scalar_op(lambda: len(_members(process_set_id)), "size_op")


def local_size_op(name: str | None = None) -> Any:
    """An int32 scalar op: the number of ranks on this host."""
    return _scalar_op(api.local_size, "local_size_op")


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """An int32 scalar op: 1 if this rank belongs to the process set, else 0."""
    return _scalar_op(lambda: int(api.rank() in _members(process_set_id)), "process_set_included_op")


def join() -> Any:
    """Declares that this rank has no more data; blocks until every rank has joined.

    Until then this rank takes part in other ranks' allreduces with zeros.

    Returns:
        An int32 scalar: the rank that joined last, the same on every rank.
    """
    return _scalar_op(api.join, "join")


def barrier(process_set: ProcessSet = global_process_set, name: str | None = None) -> None:
    """Blocks until every rank of the set has reached the barrier.

    Inside ``tf.function`` it becomes an op that runs in program order (nothing to return).
    """

    def kernel() -> list[Any]:
        api.barrier(process_set)
        return []

    bridge.check_member(process_set, "barrier")
    if tf.executing_eagerly():
        kernel()
        return
    bridge.check_not_xla("barrier")
    tf.py_function(kernel, [], [], name="HoraBarrier")  # stateful: kept and ordered by tf.function
