"""``DistributedOptimizer`` for Keras optimizers: Keras 3, and Keras 2 (tf_keras) with
its legacy optimizers.

hora does not generate an optimizer subclass. It wraps the one method through which
Keras applies gradients, on the optimizer itself:

* Keras 3: ``apply(grads, trainable_variables)``, which ``apply_gradients`` and
  ``model.fit`` call;
* tf_keras (``tf_keras.optimizers`` and ``tf_keras.optimizers.legacy``):
  ``apply_gradients(grads_and_vars, ...)``, which ``minimize`` and ``model.fit`` call.

The wrapper averages the gradients across ranks (``GradientReducer``) and calls the
original method. The optimizer keeps its class, configuration and state, so it saves
and loads as the plain optimizer, and an optimizer restored with its state (see
``load_model``) keeps it.

With ``backward_passes_per_step = n > 1``, gradients are summed locally (in
variables) and reduced and applied every n-th call; the other calls only advance
``optimizer.iterations``, as Horovod's do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf  # type: ignore[import-untyped]

from hora.collectives.reduce import AVERAGE
from hora.compression import Compressor, NoneCompressor
from hora.core.process_sets import ProcessSet, global_process_set
from hora.tensorflow.gradient_tape import GradientReducer

ATTRIBUTE = "_hora_reducer"


def flavor(optimizer: Any) -> str:
    """``"keras3"`` or ``"tf_keras"``, by the methods the optimizer's class has.

    Raises:
        TypeError: not a Keras optimizer.
    """
    cls = type(optimizer)
    if callable(getattr(cls, "stateless_apply", None)) and callable(getattr(cls, "apply", None)):
        return "keras3"
    if callable(getattr(cls, "apply_gradients", None)) and hasattr(optimizer, "get_config"):
        return "tf_keras"
    raise TypeError(
        f"hora's DistributedOptimizer wraps Keras optimizers (keras.optimizers, tf_keras.optimizers and their "
        f"legacy versions); got {cls.__module__}.{cls.__name__}. For a custom training loop, use "
        "hvd.DistributedGradientTape."
    )


class LocalAggregator:
    """Sums gradients locally over ``passes`` calls, then reduces and applies them once.

    Args:
        passes: backward passes per optimizer step.
        average: divide the sums by ``passes`` (Horovod's ``average_aggregated_gradients``).
    """

    def __init__(self, passes: int, average: bool) -> None:
        self.passes = passes
        self.average = average
        self.counter: Any = None
        self.sums: list[Any] = []

    def _create(self, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        with tf.init_scope():  # created once, outside any tf.function being traced
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hora_backward_passes")
            self.sums = [
                None if g is None else tf.Variable(tf.zeros(v.shape, dtype=g.dtype), trainable=False, name="hora_sum")
                for g, v in zip(grads, variables)
            ]

    def step(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any], apply: Callable[[list[Any]], Any]) -> Any:
        """Adds ``grads``; on every ``passes``-th call runs ``apply(sums)`` and clears the sums."""
        if self.counter is None:
            self._create(grads, variables)
        if len(self.sums) != len(grads):
            raise ValueError(f"backward_passes_per_step: got {len(grads)} gradients after {len(self.sums)} before")
        for total, grad in zip(self.sums, grads):
            if total is not None and grad is not None:
                total.assign_add(tf.convert_to_tensor(grad))
        count = self.counter.assign_add(1)

        def flush() -> Any:
            scale = 1.0 / self.passes if self.average else 1.0
            apply([None if s is None else s.read_value() * tf.constant(scale, dtype=s.dtype) for s in self.sums])
            for total in self.sums:
                if total is not None:
                    total.assign(tf.zeros_like(total))
            self.counter.assign(0)
            return tf.constant(True)

        def skip() -> Any:
            optimizer.iterations.assign_add(1)
            return tf.constant(False)

        return tf.cond(count >= self.passes, flush, skip)


def _attach(optimizer: Any, name: str, value: Any) -> None:
    object.__setattr__(optimizer, name, value)  # bypass Keras' attribute tracking


def distribute(
    optimizer: Any,
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = AVERAGE,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: int | Sequence[Sequence[Any]] | None = None,
    num_groups: int = 0,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
    local_layers: Any = None,
) -> Any:
    """Makes a Keras optimizer average its gradients across ranks before applying them.

    Returns:
        The same optimizer object, now distributed.

    Raises:
        TypeError: not a Keras optimizer.
        ValueError: invalid arguments, or the optimizer is distributed already.
    """
    kind = flavor(optimizer)
    if getattr(optimizer, ATTRIBUTE, None) is not None:
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap each optimizer once")
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be > 0; got {backward_passes_per_step}")
    reducer = GradientReducer(
        name or f"Distributed{type(optimizer).__name__}", compression, sparse_as_dense, op,
        gradient_predivide_factor, groups, num_groups, process_set, scale_local_gradients,
    )  # fmt: skip
    layers = [] if local_layers is None else local_layers if isinstance(local_layers, (list, tuple)) else [local_layers]
    for layer in layers:
        reducer.register_local(layer.trainable_weights)
    aggregator = LocalAggregator(int(backward_passes_per_step), average_aggregated_gradients) if backward_passes_per_step > 1 else None

    if kind == "keras3":
        original_apply = optimizer.apply

        def apply(grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> Any:
            grads = list(grads)
            if trainable_variables is None and not optimizer.built:
                return original_apply(grads, trainable_variables)  # Keras raises its own error
            variables = list(trainable_variables if trainable_variables is not None else optimizer._trainable_variables)
            if aggregator is None:
                return original_apply(reducer(grads, variables), trainable_variables)
            if not optimizer.built:
                optimizer.build(variables)  # before tf.cond: no variables may be created inside it
            return aggregator.step(optimizer, grads, variables, lambda g: original_apply(reducer(g, variables), variables))

        _attach(optimizer, "apply", apply)
    else:
        original_apply_gradients = optimizer.apply_gradients

        def apply_gradients(grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
            pairs = list(grads_and_vars)
            grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
            if aggregator is None:
                return original_apply_gradients(list(zip(reducer(grads, variables), variables)), *args, **kwargs)
            return aggregator.step(
                optimizer, grads, variables,
                lambda g: original_apply_gradients(list(zip(reducer(g, variables), variables)), *args, **kwargs),
            )  # fmt: skip

        _attach(optimizer, "apply_gradients", apply_gradients)
    _attach(optimizer, ATTRIBUTE, reducer)
    _attach(optimizer, "register_local_var", lambda variable: reducer.register_local([variable]))
    return optimizer


def register_local_var(optimizer: Any, variable: Any) -> None:
    """Keeps ``variable``'s gradient local (not reduced) in a distributed optimizer."""
    reducer = getattr(optimizer, ATTRIBUTE, None)
    if reducer is None:
        raise ValueError("register_local_var needs an optimizer made by hvd.DistributedOptimizer")
    reducer.register_local([variable])
