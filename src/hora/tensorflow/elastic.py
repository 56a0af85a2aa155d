"""Elastic training with TensorFlow (``horovod.tensorflow.elastic``): ``run``,
``TensorFlowKerasState``, ``TensorFlowState``.

    import hora.tensorflow as hvd

    hvd.init()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for x, y in batches:
                train_step(x, y)  # DistributedGradientTape, optimizer.apply_gradients
            state.commit()

    train(state)

Committed values live in host memory (NumPy copies). A reset re-initializes hora
(``shutdown()`` then ``init()``); hora has no elastic driver yet, so today that is the
same world again.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf  # type: ignore[import-untyped]

from hora import elastic as _elastic
from hora.core.api import rank
from hora.elastic import ObjectState
from hora.errors import HoraInternalError
from hora.tensorflow.collectives import broadcast
from hora.tensorflow.functions import broadcast_object, broadcast_variables

R = TypeVar("R")

# A hora collective's node in TensorFlow's message (``[[{{node HoraAllreduce}}]]``,
# ``{{node train_step/HoraGroupedAllreduce_2}}``): bridge.draw_key names them ``Hora<Op>``.
_HORA_NODE = re.compile(r"\{\{node (?:[^}]*/)?Hora[A-Z]")


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Decorates an elastic training function (``func(state, *args, **kwargs)``).

    The state is synchronized from rank 0 before ``func`` runs (so ``func`` must not
    start with a collective). When a collective fails, the last commit is restored,
    hora is reset (``shutdown()``, ``init()``) and ``func`` runs again; see
    ``hora.elastic.run_fn``. Inside ``tf.function`` (and ``model.fit``) a failed
    collective arrives as ``tf.errors.UnknownError``; one that names a hora collective
    op counts as ``HoraInternalError``, as Horovod does for its ops.

    Args:
        func: the training function; its first parameter is the state.

    Returns:
        The wrapped function.
    """

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> R:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.UnknownError as exc:
            if _HORA_NODE.search(exc.message or ""):
                raise HoraInternalError(exc.message) from exc
            raise

    return _elastic.run(wrapper)


def _variables(holder: Any) -> list[Any]:
    """A model's or optimizer's variables (legacy Keras optimizers: a method)."""
    if holder is None:
        return []
    variables = getattr(holder, "variables", [])
    return list(variables() if callable(variables) else variables)


def _host_copy(variable: Any) -> np.ndarray:
    return np.array(variable.numpy(), copy=True)


def _broadcast_object(obj: Any) -> Any:
    return broadcast_object(obj, root_rank=0)


class TensorFlowKerasState(ObjectState):
    """The state of a Keras model and its optimizer, plus plain objects.

    A commit copies the values of ``model.variables`` and of the optimizer's variables
    to host memory; ``restore`` assigns them back; ``sync`` broadcasts both from rank 0
    (``broadcast_variables``) and commits the result. A Keras 3 optimizer that has not
    created its slot variables yet (they appear at the first step) is built for the
    model's trainable variables before a sync, so every rank broadcasts the same list.
    Works with Keras 3 and tf_keras (new and legacy optimizers), eagerly (TF2).

    Args:
        model: a built Keras model.
        optimizer: its optimizer; by default ``model.optimizer`` (compiled in).
        backend: Keras' backend, which Horovod uses for TF1 sessions; accepted and not
            needed eagerly.
        **kwargs: more objects to track, by attribute name (as ``ObjectState``).

    Raises:
        ValueError: the model is not built.
        NotImplementedError: TF1 graph mode (not executing eagerly).
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not tf.executing_eagerly():
            raise NotImplementedError(
                "hora's TensorFlowKerasState needs eager execution (TF2): Keras in TF1 graph mode "
                "(backend.get_session()) is not supported; track tf.Variables with TensorFlowState(variables, session)"
            )
        self.model = model
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        self._saved_model_state: list[tuple[Any, np.ndarray]] = []
        self._saved_optimizer_state: list[tuple[Any, np.ndarray]] = []
        self._save_model()
        super().__init__(bcast_object=_broadcast_object, get_rank=rank, **kwargs)

    def save(self) -> None:
        """Copies the model's and optimizer's variables to host memory, then the objects."""
        self._save_model()
        super().save()

    def restore(self) -> None:
        """Assigns the committed values back to the variables, and the objects."""
        for variable, value in self._saved_model_state + self._saved_optimizer_state:
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        """Makes every rank's model, optimizer and objects rank 0's, and commits them
        (collectives).

        Raises:
            HoraInternalError: a broadcast failed.
        """
        self._build_optimizer()
        broadcast_variables(_variables(self.model), root_rank=0)
        broadcast_variables(_variables(self.optimizer), root_rank=0)
        self._save_model()
        super().sync()

    def _build_optimizer(self) -> None:
        optimizer = self.optimizer
        if optimizer is not None and getattr(optimizer, "built", True) is False and hasattr(optimizer, "build"):
            optimizer.build(self.model.trainable_variables)

    def _save_model(self) -> None:
        self._saved_model_state = [(v, _host_copy(v)) for v in _variables(self.model)]
        self._saved_optimizer_state = [(v, _host_copy(v)) for v in _variables(self.optimizer)]


class TensorFlowState(ObjectState):
    """The state of a list of ``tf.Variable`` objects, plus plain objects.

    Eagerly (TF2) a commit copies the variables' values to host memory, ``restore``
    assigns them back and ``sync`` broadcasts them from rank 0. In a TF1 graph (not
    executing eagerly) the same goes through ``session``: the broadcast op is built
    here, in the variables' graph, and run by ``sync``; values are read with
    ``session.run`` and written back with ``Variable.load``.

    Args:
        variables: the variables; by default the graph's global variables (TF1; none
            eagerly, as in Horovod).
        session: the TF1 session (default: the default session); unused eagerly.
        **kwargs: more objects to track, by attribute name (as ``ObjectState``).

    Raises:
        ValueError: in a TF1 graph with no session given and no default session.
    """

    def __init__(self, variables: Sequence[Any] | None = None, session: Any = None, **kwargs: Any) -> None:
        self._eager = tf.executing_eagerly()
        if variables is None:
            variables = [] if self._eager else tf.compat.v1.global_variables()
        self.variables = list(variables)
        self.session: Any = None if self._eager else session or tf.compat.v1.get_default_session()
        self._bcast_op: Any = None
        if not self._eager:
            if self.session is None:
                raise ValueError(
                    "TensorFlowState in a TF1 graph needs a session: pass session= or run it in `with session:`"
                )
            ops = [v.assign(broadcast(v, root_rank=0)) for v in self.variables]
            self._bcast_op = tf.group(*ops) if ops else None
        self._values: list[np.ndarray] = []
        self._save_model()
        super().__init__(bcast_object=_broadcast_object, get_rank=rank, **kwargs)

    def save(self) -> None:
        """Copies the variables' values to host memory, then the objects."""
        self._save_model()
        super().save()

    def restore(self) -> None:
        """Writes the committed values back into the variables, and the objects."""
        for variable, value in zip(self.variables, self._values):
            if self._eager:
                variable.assign(value)
            else:
                variable.load(value, self.session)
        super().restore()

    def sync(self) -> None:
        """Makes every rank's variables and objects rank 0's, and commits them
        (collectives).

        Raises:
            HoraInternalError: a broadcast failed (in a TF1 graph: as TensorFlow's error).
        """
        if self._eager:
            broadcast_variables(self.variables, root_rank=0)
        elif self._bcast_op is not None:
            self.session.run(self._bcast_op)
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        if self._eager:
            self._values = [_host_copy(v) for v in self.variables]
        else:
            self._values = [np.array(value, copy=True) for value in self.session.run(self.variables)]


__all__ = ["TensorFlowKerasState", "TensorFlowState", "run"]
