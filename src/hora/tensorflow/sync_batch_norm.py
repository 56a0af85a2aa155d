"""``SyncBatchNormalization``: batch normalization over the batch of every rank together.

In training, each rank computes its batch's per-channel count, mean and mean of
squares; one allreduce (Sum) combines them, weighted by count, into the mean and
variance of the union of all ranks' batches, so N ranks with batch B normalize as
one process with batch N*B would. The allreduce is differentiable, so gradients flow
through the shared statistics. Inference uses the moving averages, as usual.

Works with Keras 3 (``keras.layers.BatchNormalization``) and, when
``TF_USE_LEGACY_KERAS=1``, with tf_keras; the fused kernel is not used.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf  # type: ignore[import-untyped]

from hora.collectives.reduce import SUM
from hora.core.process_sets import global_process_set
from hora.tensorflow.collectives import allreduce

_BatchNormalization: Any = tf.keras.layers.BatchNormalization
_LEGACY = "fused" in _BatchNormalization.__init__.__code__.co_varnames  # tf_keras has a fused kernel


class SyncBatchNormalization(_BatchNormalization):  # type: ignore[misc]
    """Batch normalization with statistics over every rank's batch (see the module docstring).

    Args:
        fused: must be False (or left out): the fused kernel cannot share statistics.
        **kwargs: as ``tf.keras.layers.BatchNormalization``.
    """

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        if _LEGACY:
            kwargs["fused"] = False
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        mean, variance = super()._moments(inputs, *args, **kwargs)
        if (global_process_set.size() or 1) == 1:
            return mean, variance
        dtype = mean.dtype
        count = tf.cast(tf.size(inputs), dtype) / tf.cast(tf.size(mean), dtype)  # elements per channel
        stats = tf.stack([mean * count, (variance + tf.square(mean)) * count, tf.ones_like(mean) * count])
        total = allreduce(stats, op=SUM, name=None)
        group_mean = total[0] / total[2]
        group_variance = tf.maximum(total[1] / total[2] - tf.square(group_mean), 0.0)
        return group_mean, group_variance

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.pop("fused", None)
        return config
