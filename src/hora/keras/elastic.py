"""Horovod's ``horovod.keras.elastic`` (the same classes as ``hora.tensorflow.keras.elastic``)."""

from hora.tensorflow.keras.elastic import (
    CommitStateCallback,
    KerasState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    run,
)
from hora.tensorflow.elastic import TensorFlowKerasState

__all__ = [
    "CommitStateCallback",
    "KerasState",
    "TensorFlowKerasState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]
