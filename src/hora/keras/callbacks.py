"""Horovod's ``horovod.keras.callbacks``: ``hora.tensorflow.keras.callbacks``'s classes, and
``BestModelCheckpoint`` with ``horovod.keras``'s parameters (no ``save_weights_only``)."""

from __future__ import annotations

from hora.tensorflow.keras import callbacks as _callbacks
from hora.tensorflow.keras.callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)


class BestModelCheckpoint(_callbacks.BestModelCheckpoint):
    """Saves the whole model whenever the monitored metric improves, on rank 0 only (see
    ``hora.tensorflow.keras.callbacks.BestModelCheckpoint``)."""

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        *,
        filepath: str | None = None,
    ) -> None:
        super().__init__(monitor, verbose, False, mode, save_freq, filepath=filepath)


__all__ = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]
