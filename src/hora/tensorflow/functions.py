"""Broadcasting variables and Python objects, for TensorFlow.

Objects travel as cloudpickles through hora's neutral ``broadcast_object`` /
``allgather_object``, only between authenticated ranks of one job. ``session`` is
accepted for Horovod compatibility (TF1 sessions) and ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import tensorflow as tf  # type: ignore[import-untyped]

from hora.core import api
from hora.core.process_sets import ProcessSet, global_process_set
from hora.tensorflow.collectives import broadcast_


def broadcast_variables(
    variables: Iterable[Any], root_rank: int, process_set: ProcessSet = global_process_set, inplace: bool = False
) -> Any:
    """Overwrites every variable with ``root_rank``'s value, on every rank of the set.

    Every rank must pass the same variables in the same order (shapes are checked
    across ranks). Use it after building a model, and after restoring a checkpoint on
    one rank. ``inplace`` is accepted for Horovod compatibility: hora always assigns
    into the variables (one copy each; TensorFlow offers no way to receive into a
    variable's buffer directly).

    Returns:
        None eagerly (the variables are assigned now) and in ``tf.function`` (where the
        assignments run with the function); in a TF1 graph, the op that assigns them
        (``session.run`` it), as Horovod's.
    """
    targets = list(variables)
    assigned = broadcast_(targets, root_rank, process_set=process_set) if targets else []
    if tf.executing_eagerly() or tf.inside_function():
        return None
    return tf.group(*assigned)


def broadcast_global_variables(root_rank: int) -> Any:
    """Horovod's TF1 call: the op that broadcasts the graph's global variables.

    Returns:
        The op (``broadcast_variables`` of ``tf.compat.v1.global_variables()``).

    Raises:
        RuntimeError: eagerly, where TensorFlow keeps no collection of variables; the
            message says what to call instead.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() needs TF1 graph collections, which eager TensorFlow 2 does not "
            "keep. Broadcast the variables themselves: hvd.broadcast_variables(model.variables, root_rank=0) "
            "(and optimizer.variables), or in Keras pass hvd.callbacks.BroadcastGlobalVariablesCallback(0) to "
            "model.fit."
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Returns ``root_rank``'s picklable object on every rank of the set."""
    return api.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(
    root_rank: int = 0, session: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Callable[[Any], Any]:
    """Returns a function that broadcasts its argument from ``root_rank``."""

    def fn(obj: Any) -> Any:
        return api.broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return fn


def allgather_object(
    obj: Any, session: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Returns every rank's picklable object, in rank order, on every rank of the set."""
    return api.allgather_object(obj, name=name, process_set=process_set)
