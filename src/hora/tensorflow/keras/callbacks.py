"""Horovod's Keras callbacks, for the Keras that ``tf.keras`` resolves to.

That is Keras 3, or tf_keras (Keras 2) when ``TF_USE_LEGACY_KERAS=1`` is set before
TensorFlow is imported. Put ``BroadcastGlobalVariablesCallback`` and
``MetricAverageCallback`` first in the list, before callbacks that read the metrics
(checkpoints, early stopping, learning-rate schedules on plateaus).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import tensorflow as tf  # type: ignore[import-untyped]

from hora.core import api
from hora.collectives.reduce import AVERAGE
from hora.core.process_sets import global_process_set
from hora.tensorflow.collectives import broadcast_, grouped_allreduce

log = logging.getLogger(__name__)
_keras: Any = tf.keras
_Callback: Any = _keras.callbacks.Callback
_ModelCheckpoint: Any = _keras.callbacks.ModelCheckpoint


def _optimizer_variables(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    variables = getattr(optimizer, "variables", [])
    return list(variables() if callable(variables) else variables)  # legacy optimizers: a method


def _model_variables(model: Any) -> list[Any]:
    """A model's variables; none while it is not built (Keras 2 raises for those)."""
    try:
        return list(model.variables)
    except ValueError:  # tf_keras: "Weights for model ... have not yet been created"
        return []


def turn_off_xla(model: Any) -> None:
    """Rebuilds a model's compiled functions without XLA, which cannot run hora's collectives."""
    if getattr(model, "jit_compile", False) is not True or getattr(model, "run_eagerly", False):
        return
    model.jit_compile = False
    model.make_train_function(force=True)
    for attribute in ("test_function", "predict_function"):
        if getattr(model, attribute, None) is not None:
            setattr(model, attribute, None)
    log.warning(
        "turned XLA off for model.fit (jit_compile=False): hora's collectives run in Python and XLA cannot "
        "compile them. Pass jit_compile=False to model.compile() to silence this."
    )


class BroadcastGlobalVariablesCallback(_Callback):  # type: ignore[misc]
    """Makes every rank start from ``root_rank``'s model and optimizer state.

    Broadcasts the model's variables when training begins (and the optimizer's, if it
    has any yet); a model built by its first step, and an optimizer that creates its
    variables in the first step (Keras 3), have them broadcast after that step, when
    Horovod broadcasts everything. It also turns XLA off for ``model.fit`` (with a
    warning), since hora's collectives cannot run under XLA.

    Args:
        root_rank: the rank whose values everyone takes.
        device: accepted for Horovod compatibility.
        local_variables: variables to leave alone (each rank keeps its own).
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Iterable[Any] | None = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self._local = {id(v) for v in local_variables or ()}
        self.broadcast_done = False
        self._model_done = False

    def _broadcast(self, variables: Iterable[Any]) -> None:
        targets = [v for v in variables if id(v) not in self._local]
        if targets and (global_process_set.size() or 1) > 1:
            broadcast_(targets, self.root_rank, name="BroadcastGlobalVariablesCallback")

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        turn_off_xla(self.model)
        variables = _model_variables(self.model)  # a model built by its first step has none yet
        if variables:
            self._broadcast(variables)
            self._model_done = True
            optimizer_variables = _optimizer_variables(getattr(self.model, "optimizer", None))
            if optimizer_variables:
                self._broadcast(optimizer_variables)
                self.broadcast_done = True

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.broadcast_done:
            return
        if not self._model_done:
            self._broadcast(self.model.variables)
        self._broadcast(_optimizer_variables(getattr(self.model, "optimizer", None)))
        self.broadcast_done = True


class MetricAverageCallback(_Callback):  # type: ignore[misc]
    """Averages the epoch's metrics (training and validation) over all ranks.

    Each rank sees only its shard of the data; after this callback the logs that later
    callbacks (and ``History``) see hold the averages. Every rank must report the same
    metric names.
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not logs or (global_process_set.size() or 1) == 1:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        if not names:
            return
        values = [tf.constant(float(logs[k]), dtype=tf.float64) for k in names]
        averaged = grouped_allreduce(values, op=AVERAGE, name="MetricAverageCallback", ignore_name_scope=True)
        for key, value in zip(names, averaged):
            logs[key] = float(value.numpy())


def _value(variable: Any) -> float:
    return float(np.asarray(variable))


class LearningRateScheduleCallback(_Callback):  # type: ignore[misc]
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` between two epochs.

    Args:
        initial_lr: the base learning rate (usually scaled by ``hvd.size()``).
        multiplier: a constant, or a function of the (fractional, unless
            ``staircase``) epoch.
        start_epoch, end_epoch: the schedule applies to epochs in [start, end).
        staircase: change once per epoch (else every batch, with a fractional epoch).
        momentum_correction: scale the momentum with the learning rate change for the
            step of the change (optimizers whose momentum is a variable: tf_keras'
            legacy ones; in Keras 3 momentum is a constant of the compiled step).
        steps_per_epoch: batches per epoch; detected from ``model.fit`` when not given.
    """

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self.restore_momentum: float | None = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            constant = float(multiplier)
            self.staircase = True
            self.multiplier = lambda epoch: constant

    def _autodetect_steps_per_epoch(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            return int(params["steps"])
        if params.get("samples") and params.get("batch_size"):
            return int(params["samples"]) // int(params["batch_size"])
        raise ValueError(
            f"Could not autodetect the number of steps per epoch. Please pass steps_per_epoch to {type(self).__name__}()."
        )

    def _adjust_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = _value(optimizer.learning_rate)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign") and old_lr:
            self.restore_momentum = _value(momentum)
            optimizer.momentum = self.restore_momentum * new_lr / old_lr

    def _restore_momentum_if_needed(self) -> None:
        if self.restore_momentum is not None:
            self.model.optimizer.momentum = self.restore_momentum
            self.restore_momentum = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / float(self.steps_per_epoch or 1))

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = _value(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from ``initial_lr / size`` up to ``initial_lr`` over
    ``warmup_epochs`` (Goyal et al., 2017), changing it every batch.

    At fractional epoch ``e`` the rate is ``initial_lr / size * (e' * (size - 1) / warmup_epochs + 1)``
    with ``e' = e + 1 / steps_per_epoch``, reaching ``initial_lr`` at the end of the warmup.
    """

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        def multiplier(epoch: float) -> float:
            epoch += 1.0 / float(self.steps_per_epoch or 1)
            size = api.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
            momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch,
        )  # fmt: skip
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if self.end_epoch is not None and epoch == self.end_epoch - 1 and self.verbose > 0:
            lr = _value(self.model.optimizer.learning_rate)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


class BestModelCheckpoint(_ModelCheckpoint):  # type: ignore[misc]
    """Saves the model whenever the monitored metric improves, on rank 0 only.

    Horovod's callback leaves the path to be set later (``set_filepath``); hora also
    takes it as ``filepath=``. Average the metric first (``MetricAverageCallback``).
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        *,
        filepath: str | None = None,
    ) -> None:
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(
            filepath=filepath or placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
            save_weights_only=save_weights_only, mode=mode, save_freq=save_freq,
        )  # fmt: skip
        self.filepath = filepath

    def set_filepath(self, filepath: str) -> None:
        self.filepath = filepath

    def _save_model(self, *args: Any, **kwargs: Any) -> None:
        if api.rank() != 0:
            return
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint has no file path: pass filepath= or call set_filepath() first")
        super()._save_model(*args, **kwargs)
