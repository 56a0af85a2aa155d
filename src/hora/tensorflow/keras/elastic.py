"""Elastic training with Keras (``horovod.tensorflow.keras.elastic``): ``run``,
``KerasState`` and the callbacks that keep it current during ``model.fit``.

    import hora.tensorflow.keras as hvd

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=...)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(dataset, steps_per_epoch=steps, epochs=epochs - state.epoch,
                        callbacks=callbacks, verbose=1 if hvd.rank() == 0 else 0)

    train(state)

Put ``CommitStateCallback`` after the two others so that a commit holds the counters
they updated. Works with the Keras that ``tf.keras`` is (Keras 3, or tf_keras with
``TF_USE_LEGACY_KERAS=1``).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf  # type: ignore[import-untyped]

from hora.elastic import State
from hora.tensorflow.elastic import TensorFlowKerasState, run

_Callback: Any = tf.keras.callbacks.Callback


class KerasState(TensorFlowKerasState):
    """``TensorFlowKerasState`` with Keras' backend: a model, its optimizer and plain
    objects (for example ``batch=0, epoch=0`` for the callbacks).

    Args:
        model: a built Keras model.
        optimizer: its optimizer; by default ``model.optimizer``.
        **kwargs: more objects to track, by attribute name.
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=tf.keras.backend, **kwargs)


class CommitStateCallback(_Callback):  # type: ignore[misc]
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of every
    epoch. The count restarts when training (re)starts, so every rank commits at the
    same batches.

    Args:
        state: the elastic state to commit.
        batches_per_commit: batches between commits (default 1: every batch).
    """

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.backend = tf.keras.backend
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.commit()

    def commit(self) -> None:
        """Commits the state (``state.commit()``)."""
        self.state.commit()


class UpdateBatchStateCallback(_Callback):  # type: ignore[misc]
    """Keeps ``state.batch`` at the number of the last batch finished in this epoch
    (0 again after each epoch). At the start of an epoch resumed after a reset it
    lowers ``params['steps']`` by ``state.batch``, as Horovod does (what Keras shows as
    the epoch's length).

    Args:
        state: the elastic state, with a ``batch`` attribute.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.backend = tf.keras.backend
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        params = self.params if isinstance(self.params, dict) else None
        if params and params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = params.get("steps")
            params["steps"] = self.steps_per_epoch - self.state.batch  # type: ignore[attr-defined]

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = batch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = 0  # type: ignore[attr-defined]


class UpdateEpochStateCallback(_Callback):  # type: ignore[misc]
    """Keeps ``state.epoch`` at the number of epochs finished, counted across resets:
    Keras numbers the epochs of each ``fit`` from 0, so the epoch the state held when
    training (re)started is added, plus one (the epoch just finished).

    Args:
        state: the elastic state, with an ``epoch`` attribute.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.backend = tf.keras.backend
        self.state = state
        self.initial_epoch: int = state.epoch  # type: ignore[attr-defined]

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.initial_epoch = self.state.epoch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1  # type: ignore[attr-defined]


__all__ = [
    "CommitStateCallback",
    "KerasState",
    "TensorFlowKerasState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]
