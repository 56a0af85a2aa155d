"""``import hora.keras as hvd``: Horovod's ``horovod.keras`` API.

Keras 3 *is* ``tf.keras`` on TensorFlow 2.16 and later, so this is ``hora.tensorflow.keras``
(with the same choice between Keras 3 and tf_keras through ``TF_USE_LEGACY_KERAS``), with
the signatures that differ in Horovod kept as ``horovod.keras`` has them:
``DistributedOptimizer`` takes ``num_groups`` and ``groups`` right after ``op`` (the
arguments only ``horovod.tensorflow.keras`` has follow them), ``allreduce`` defaults to
``average=True`` (so, as in Horovod, passing ``op`` as well raises ``ValueError``), and
``callbacks.BestModelCheckpoint`` has no ``save_weights_only``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hora.tensorflow.keras import *  # noqa: F403 - the same API
from hora.tensorflow.keras import __all__ as _all
from hora.tensorflow.keras import elastic
from hora.collectives.reduce import AVERAGE
from hora.compression import Compressor
from hora.core.process_sets import ProcessSet, global_process_set
import hora.keras.callbacks as callbacks  # type: ignore[no-redef] # replaces the star import's: horovod.keras's own
from hora.tensorflow import keras as _tf_keras
from hora.tensorflow.compression import Compression


def DistributedOptimizer(  # type: ignore[no-redef] # noqa: N802 - horovod.keras's order, replacing the star import's
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = AVERAGE,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[Any]] | None = None,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """``horovod.keras.DistributedOptimizer``: ``hora.tensorflow.keras.DistributedOptimizer``
    with ``horovod.keras``'s order of parameters (see there for each)."""
    return _tf_keras.DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense, gradient_predivide_factor, op,
        backward_passes_per_step, average_aggregated_gradients, num_groups, groups, process_set, scale_local_gradients,
    )  # fmt: skip


def allreduce(  # type: ignore[no-redef] # horovod.keras's default, replacing the star import's
    value: Any,
    name: str | None = None,
    average: bool | None = True,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: int | None = None,
    compression: type[Compressor] = Compression.none,
) -> Any:
    """``horovod.keras.allreduce``: ``hora.tensorflow.keras.allreduce`` with ``average=True``
    by default, as ``horovod.keras`` has it (a deprecation warning unless ``average=None``)."""
    return _tf_keras.allreduce(value, name, average, prescale_factor, postscale_factor, op, compression)


__all__ = list(_all)
