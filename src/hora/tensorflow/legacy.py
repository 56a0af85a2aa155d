"""Horovod's TF1 pieces: ``DistributedOptimizer`` for ``tf.compat.v1.train`` optimizers
and ``BroadcastGlobalVariablesHook`` for ``tf.compat.v1.train.MonitoredTrainingSession``.

TF1 programs build a graph and run it in a Session: ``opt.minimize(loss)`` calls the
optimizer's ``compute_gradients`` and ``apply_gradients``. ``LegacyDistributedOptimizer``
is an optimizer of its own (as Horovod's ``_DistributedOptimizer`` is) that wraps the
user's: its ``compute_gradients`` averages the gradients across ranks
(``GradientReducer``, the same as ``DistributedGradientTape``), and ``apply_gradients``
is the wrapped optimizer's. With ``backward_passes_per_step = n > 1`` (graph mode only,
as Horovod), gradients are summed in variables; every n-th run reduces the sums and
applies them, the other runs apply nothing.

Eagerly (TF2 with a ``tf.compat.v1.train`` optimizer and a callable loss) the same
optimizer works with ``backward_passes_per_step = 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf  # type: ignore[import-untyped]

from hora.collectives.reduce import ADASUM, AVERAGE
from hora.compression import Compressor, NoneCompressor
from hora.core.process_sets import ProcessSet, global_process_set
from hora.tensorflow.functions import broadcast_global_variables
from hora.tensorflow.gradient_tape import GradientReducer

EAGER_PASSES_MESSAGE = "backward_passes_per_step > 1 is not yet supported for _LegacyOptimizer with eager execution."


class LegacyDistributedOptimizer(tf.compat.v1.train.Optimizer):  # type: ignore[misc]
    """A ``tf.compat.v1.train.Optimizer`` that averages the gradients of another across
    ranks before that one applies them (what ``hvd.DistributedOptimizer`` returns for one).

    Args: those of ``hvd.DistributedOptimizer``; see ``GradientReducer``.

    Raises:
        NotImplementedError: ``op=Adasum`` (Horovod's TF1 Adasum optimizer combines weight
            changes, not gradients; hora does not provide it).
        ValueError: invalid arguments; ``backward_passes_per_step > 1`` eagerly.
    """

    def __init__(
        self,
        optimizer: Any,
        name: str | None = None,
        use_locking: bool = False,
        compression: type[Compressor] = NoneCompressor,
        sparse_as_dense: bool = False,
        op: int = AVERAGE,
        gradient_predivide_factor: float = 1.0,
        backward_passes_per_step: int = 1,
        average_aggregated_gradients: bool = False,
        groups: int | Sequence[Sequence[Any]] | None = None,
        num_groups: int = 0,
        process_set: ProcessSet = global_process_set,
        scale_local_gradients: bool = True,
    ) -> None:
        name = name or f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        if op == ADASUM:
            raise NotImplementedError(
                "hora.tensorflow.DistributedOptimizer: op=Adasum with a tf.compat.v1.train optimizer is not provided "
                "(Horovod's combines weight changes, not gradients); use op=Average, or a Keras optimizer with "
                "hvd.DistributedGradientTape(op=hvd.Adasum)"
            )
        passes = int(backward_passes_per_step)
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be > 0; got {backward_passes_per_step}")
        if passes > 1 and tf.executing_eagerly():
            raise ValueError(EAGER_PASSES_MESSAGE)
        self._optimizer = optimizer
        self._reducer = GradientReducer(
            name, compression, sparse_as_dense, op, gradient_predivide_factor, groups, num_groups, process_set,
            scale_local_gradients,
        )  # fmt: skip
        self._passes = passes
        self._average_passes = average_aggregated_gradients
        self._counter: Any = None  # backward passes summed since the last reduction (passes > 1)
        self._sums: list[Any] = []  # the summed gradients, one variable per gradient (None for None)
        self.process_set = process_set

    def register_local_var(self, var: Any) -> None:
        """Keeps ``var``'s gradient local: it is not reduced across ranks (divided by the
        set size when ``scale_local_gradients``)."""
        self._reducer.register_local([var])

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's gradients, averaged across ranks (with
        ``backward_passes_per_step > 1``: the sums, reduced on every n-th run)."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        reduced = self._reducer(grads, variables) if self._passes == 1 else self._sum_passes(grads, variables)
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: str | None = None) -> Any:
        """The wrapped optimizer's ``apply_gradients``; with ``backward_passes_per_step > 1``
        only on runs that reduced (the sums are then cleared), while ``global_step`` counts
        every run, as Horovod's."""
        if self._passes == 1:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        pairs = list(grads_and_vars)

        def apply() -> Any:
            with tf.control_dependencies([self._optimizer.apply_gradients(pairs, name=name)]):
                return tf.group(*[s.assign(tf.zeros_like(s)) for s in self._sums if s is not None])

        # The count is read once this run's gradients exist: the run that reduced reset it.
        with tf.control_dependencies([g for g, _ in pairs if g is not None]):
            reduced = tf.equal(self._counter.read_value(), 0)
        step = tf.cond(reduced, apply, tf.no_op)
        if global_step is None:
            return step
        # Outside tf.cond: a program's global step may be a reference variable, which
        # TensorFlow 2's branches cannot assign.
        with tf.control_dependencies([step]):
            return tf.group(tf.compat.v1.assign_add(global_step, tf.ones((), global_step.dtype.base_dtype)))

    def _sum_passes(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """Adds ``grads`` to the sums; on every n-th run returns the sums reduced (and
        resets the count), else the sums as they are (``apply_gradients`` skips them)."""
        if self._counter is None:
            # Outside any control flow being built; resource variables whatever the program
            # chose (a reference variable cannot be assigned inside tf.cond's branches).
            with tf.init_scope():
                self._counter = _variable(tf.zeros((), tf.int32), "hora_backward_passes")
                self._sums = [
                    None if g is None else _variable(tf.zeros(v.shape, g.dtype), "hora_sum")
                    for g, v in zip(grads, variables)
                ]
        if len(self._sums) != len(grads):
            raise ValueError(f"backward_passes_per_step: got {len(grads)} gradients after {len(self._sums)} before")
        present = [i for i, total in enumerate(self._sums) if total is not None]
        adds = [self._sums[i].assign_add(tf.convert_to_tensor(grads[i])) for i in present]
        with tf.control_dependencies(adds):
            count = self._counter.assign_add(1)

        def reduce() -> list[Any]:
            scale = 1.0 / self._passes if self._average_passes else 1.0
            sums = [self._sums[i].read_value() for i in present]
            reduced = self._reducer(sums, [variables[i] for i in present])
            with tf.control_dependencies(reduced):
                reset = self._counter.assign(0)
            with tf.control_dependencies([reset]):
                return [r * tf.constant(scale, r.dtype) for r in reduced]

        def keep() -> list[Any]:
            return [self._sums[i].read_value() for i in present]

        values = tf.cond(tf.equal(count, self._passes), reduce, keep) if present else []
        out: list[Any] = [None] * len(grads)
        for i, value in zip(present, values):
            out[i] = value
        return out

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``get_slot``."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``get_slot_names``."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``variables``."""
        return self._optimizer.variables(*args, **kwargs)


def _variable(initial: Any, name: str) -> Any:
    return tf.compat.v1.Variable(initial, trainable=False, name=name, use_resource=True)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):  # type: ignore[misc]
    """A ``SessionRunHook`` that broadcasts every global variable from ``root_rank`` once
    the session is created (and its variables initialized or restored), so every rank
    starts from the same weights. For ``tf.compat.v1.train.MonitoredTrainingSession``.

    Args:
        root_rank: the rank whose values everyone takes.
        device: accepted for Horovod compatibility (hora's collectives run on the host).
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op: Any = None
        self.device = device

    def begin(self) -> None:
        """Builds the broadcast op in the graph being finalized (again for a new graph)."""
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        """Runs the broadcast in the new session."""
        session.run(self.bcast_op)
