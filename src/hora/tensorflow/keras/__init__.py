"""hora's binding for Keras on TensorFlow: Horovod's ``horovod.tensorflow.keras`` API.

Works with the Keras that ``tf.keras`` is: Keras 3, or tf_keras (Keras 2) when
``TF_USE_LEGACY_KERAS=1`` is set before TensorFlow is imported, including tf_keras'
legacy optimizers.

    import hora.tensorflow.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf  # type: ignore[import-untyped]

from hora.core.api import (
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hora.collectives.reduce import ADASUM as Adasum
from hora.collectives.reduce import AVERAGE as Average
from hora.collectives.reduce import SUM as Sum
from hora.compression import Compressor
from hora.errors import HoraInternalError, HorovodInternalError
from hora.core.process_sets import ProcessSet, global_process_set
from hora.tensorflow import collectives as _collectives
from hora.tensorflow import optimizer as _optimizer
from hora.tensorflow.compression import Compression, for_tensorflow
from hora.tensorflow.functions import broadcast_global_variables
from hora.tensorflow.keras import callbacks, elastic


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[Any]] | None = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """Makes a Keras optimizer average gradients across ranks before it applies them.

    The optimizer is wrapped in place and returned; it keeps its class, config and
    state. See ``hora.tensorflow.DistributedOptimizer`` for the arguments.
    """
    return _optimizer.distribute(
        optimizer, name, for_tensorflow(compression), sparse_as_dense, gradient_predivide_factor, op,
        backward_passes_per_step, average_aggregated_gradients, groups, num_groups, process_set,
        scale_local_gradients,
    )  # fmt: skip


def PartialDistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: int | Sequence[Sequence[Any]] | None = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """A ``DistributedOptimizer`` that keeps the gradients of ``local_layers`` local
    (divided by the set size when ``scale_local_gradients``)."""
    return _optimizer.distribute(
        optimizer, name, for_tensorflow(compression), sparse_as_dense, gradient_predivide_factor, op,
        backward_passes_per_step, average_aggregated_gradients, groups, 0, process_set,
        scale_local_gradients, local_layers,
    )  # fmt: skip


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: int | None = None,
    compression: type[Compressor] = Compression.none,
) -> Any:
    """Averages (or sums) a tensor-compatible value over all ranks; returns a tensor."""
    return _collectives.allreduce(
        tf.convert_to_tensor(value), average=average, compression=compression, op=op,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor, name=name,
    )  # fmt: skip


def allgather(value: Any, name: str | None = None) -> Any:
    """Concatenates every rank's value along dimension 0; returns a tensor."""
    return _collectives.allgather(tf.convert_to_tensor(value), name=name)


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """Returns ``root_rank``'s value on every rank, as a tensor."""
    return _collectives.broadcast(tf.convert_to_tensor(value), root_rank, name=name)


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> Any:
    """Reduces a value over all ranks; returns this rank's rows of dimension 0."""
    return _collectives.reducescatter(tf.convert_to_tensor(value), op=op, name=name)


def load_model(
    filepath: Any,
    custom_optimizers: Sequence[type] | None = None,
    custom_objects: dict[str, Any] | None = None,
    compression: type[Compressor] = Compression.none,
    legacy_opts: bool = False,
) -> Any:
    """Loads a saved Keras model and makes its optimizer a ``DistributedOptimizer``.

    The optimizer keeps the state it was saved with.

    Args:
        filepath: the saved model (``.keras``, or what the Keras in use loads).
        custom_optimizers: optimizer classes the file refers to that Keras does not know.
        custom_objects: other custom objects, as for ``keras.models.load_model``.
        compression: for the distributed optimizer.
        legacy_opts: accepted for Horovod compatibility.
    """
    objects: dict[str, Any] = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects.update(custom_objects or {})
    model = tf.keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, _optimizer.ATTRIBUTE, None) is None:
        DistributedOptimizer(optimizer, compression=compression)
    return model


__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HoraInternalError",
    "HorovodInternalError",
    "PartialDistributedOptimizer",
    "ProcessSet",
    "Sum",
    "add_process_set",
    "allgather",
    "allreduce",
    "broadcast",
    "broadcast_global_variables",
    "callbacks",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_homogeneous",
    "is_initialized",
    "load_model",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
