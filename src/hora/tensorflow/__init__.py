"""hora's binding for TensorFlow 2: Horovod's ``horovod.tensorflow`` API.

``import hora.tensorflow as hvd`` gives Horovod's functions with its names,
signatures and defaults. Collectives take ``tf.Tensor``/``tf.Variable`` (allreduce
also ``tf.IndexedSlices``), work eagerly and inside ``tf.function`` (as
``tf.py_function`` ops with static shapes and registered gradients), but not in
functions compiled by XLA (``jit_compile=True``), where they raise with the fix.

    import hora.tensorflow as hvd
    hvd.init()
    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)

Keras: ``hora.tensorflow.keras`` (``DistributedOptimizer``, callbacks, ``load_model``).
Elastic training: ``hvd.elastic`` (``run``, ``TensorFlowKerasState``, ``TensorFlowState``).
"""

from __future__ import annotations

import os as _os
from collections.abc import Sequence
from typing import Any

import tensorflow as tf  # type: ignore[import-untyped]

from hora.core import basics as _basics
from hora.core.basics import *  # noqa: F403 - Horovod's basics, declared once
from hora.core.api import gpu_available, is_homogeneous
from hora.compression import Compressor
from hora.tensorflow import bridge as _bridge
from hora.tensorflow import elastic
from hora.tensorflow import optimizer as _optimizer
from hora.tensorflow.basics import (
    barrier,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)
from hora.tensorflow.collectives import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from hora.tensorflow.compression import Compression, for_tensorflow
from hora.tensorflow.functions import (
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from hora.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from hora.tensorflow.legacy import BroadcastGlobalVariablesHook, LegacyDistributedOptimizer


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[Any]] | None = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """Makes an optimizer average gradients across ranks before it applies them.

    Takes optimizers of Keras 3 and of tf_keras (new and legacy): the optimizer itself is
    wrapped and returned (see ``hora.tensorflow.optimizer``). A TF1
    ``tf.compat.v1.train.Optimizer`` is wrapped in a new optimizer, as Horovod's
    (``hora.tensorflow.legacy``).

    Args:
        optimizer: the Keras or ``tf.compat.v1.train`` optimizer.
        name: base name of its collectives (default ``Distributed<class name>``).
        use_locking: the TF1 optimizer's ``use_locking``.
        device_dense, device_sparse: accepted for Horovod compatibility.
        compression: ``Compression.fp16`` sends gradients as float16.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
        backward_passes_per_step: apply (and communicate) every n-th call, summing locally.
        op: Average (default), Sum or Adasum.
        gradient_predivide_factor: with Average, divide before the sum by this factor
            and after it by ``size / factor``.
        average_aggregated_gradients: divide locally summed gradients by ``backward_passes_per_step``.
        num_groups: deprecated; use ``groups``.
        groups: an int (that many fused groups) or lists of variables (one group each).
        process_set: the ranks taking part.
        scale_local_gradients: divide the gradients of local variables (``register_local_var``) by the set size.

    Raises:
        TypeError: not a Keras or TF1 optimizer.
        ValueError: invalid arguments.
        NotImplementedError: ``op=Adasum`` with a TF1 optimizer.
    """
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return LegacyDistributedOptimizer(
            optimizer, name, use_locking, for_tensorflow(compression), sparse_as_dense, op, gradient_predivide_factor,
            backward_passes_per_step, average_aggregated_gradients, groups, num_groups, process_set,
            scale_local_gradients,
        )  # fmt: skip
    return _optimizer.distribute(
        optimizer, name, for_tensorflow(compression), sparse_as_dense, gradient_predivide_factor, op,
        backward_passes_per_step, average_aggregated_gradients, groups, num_groups, process_set,
        scale_local_gradients,
    )  # fmt: skip


def __getattr__(name: str) -> Any:
    # SyncBatchNormalization imports Keras (a second or more): only when asked for.
    if name == "SyncBatchNormalization":
        from hora.tensorflow.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_bridge.provide_session_threads(_os.environ)  # before TensorFlow's runtime starts (docs/tensorflow.md)

__all__ = [
    "BroadcastGlobalVariablesHook",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "PartialDistributedGradientTape",
    "SyncBatchNormalization",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "elastic",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "gpu_available",
    "is_homogeneous",
    "join",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "reducescatter",
    "size_op",
]
__all__ += _basics.__all__  # the names every binding offers (hora.core.basics)
