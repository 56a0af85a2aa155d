"""Averaging gradients across ranks: ``DistributedGradientTape`` and the reducer it
shares with Keras' ``DistributedOptimizer``.

The reducer sends all dense gradients of a step as one grouped allreduce (one
``tf.py_function`` op inside ``tf.function``), which the engine negotiates once and
fuses; ``groups`` splits them into several such groups. ``tf.IndexedSlices``
gradients (embeddings) travel as allgathers of their values and indices, unless
``sparse_as_dense``. With a single rank in the set, gradients pass unchanged.

Example::

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)  # averaged over ranks
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import tensorflow as tf  # type: ignore[import-untyped]

from hora.collectives.reduce import ADASUM, AVERAGE, OP_NAMES, SUM
from hora.compression import Compressor, NoneCompressor
from hora.core.process_sets import ProcessSet, global_process_set
from hora.tensorflow.basics import size_op
from hora.tensorflow.collectives import allreduce, grouped_allreduce


def _split(items: list[int], count: int) -> list[list[int]]:
    """Splits ``items`` into ``count`` contiguous runs of nearly equal length."""
    per, extra = divmod(len(items), count)
    return [items[i * per + min(i, extra) : (i + 1) * per + min(i + 1, extra)] for i in range(count)]


class GradientReducer:
    """Reduces a step's gradients across the ranks of a process set.

    Args:
        name: the base name of the collectives (the same on every rank).
        compression: ``Compression.fp16`` sends floating-point gradients as float16.
        sparse_as_dense: reduce ``tf.IndexedSlices`` as dense tensors.
        op: Average (default), Sum or Adasum.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        groups: an int (split the gradients into that many fused groups) or a list of
            lists of variables (each list one group; the rest one group each).
        process_set: the ranks taking part.
        scale_local_gradients: divide gradients of local variables by the set size.

    Raises:
        ValueError: invalid arguments, saying which.
    """

    def __init__(
        self,
        name: str,
        compression: type[Compressor] = NoneCompressor,
        sparse_as_dense: bool = False,
        op: int = AVERAGE,
        gradient_predivide_factor: float = 1.0,
        groups: int | Sequence[Sequence[Any]] | None = None,
        num_groups: int = 0,
        process_set: ProcessSet = global_process_set,
        scale_local_gradients: bool = True,
    ) -> None:
        if op not in (AVERAGE, SUM, ADASUM):
            raise ValueError(f"{name}: op must be Average, Sum or Adasum; got {OP_NAMES.get(op, op)}")
        if gradient_predivide_factor != 1.0 and op != AVERAGE:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if num_groups:
            warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in a future release.", DeprecationWarning, stacklevel=3)
            groups = num_groups if groups is None else groups
        if groups is not None:
            lists_ok = isinstance(groups, (list, tuple)) and all(isinstance(g, (list, tuple)) for g in groups)
            if not lists_ok and not (isinstance(groups, int) and groups >= 0):
                raise ValueError("groups should be a non-negative integer or a list of lists of variables")
        self.name = name
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.prescale, self.postscale = (1.0 / gradient_predivide_factor, gradient_predivide_factor) if op == AVERAGE else (1.0, 1.0)
        self.local: set[int] = set()  # ids of variables whose gradients stay local

    def register_local(self, variables: Iterable[Any]) -> None:
        """Marks variables whose gradients are not reduced (``PartialDistributed*``)."""
        self.local.update(id(v) for v in variables)

    def _plan(self, dense: list[int], variables: Sequence[Any] | None) -> list[list[int]]:
        if not self.groups:
            return [dense] if dense else []
        if isinstance(self.groups, int):
            return [g for g in _split(dense, self.groups) if g]
        if variables is None:
            raise ValueError(f"{self.name}: groups of variables need the variables the gradients belong to")
        position = {id(variables[i]): i for i in dense}
        plan = []
        for group in self.groups:
            members = [position.pop(id(v)) for v in group if id(v) in position]
            if members:
                plan.append(members)
        plan.extend([i] for i in dense if i in position.values())
        return plan

    def __call__(self, grads: Sequence[Any], variables: Sequence[Any] | None = None) -> list[Any]:
        """Returns the reduced gradients, in order (None stays None).

        Args:
            grads: the gradients (``tf.Tensor``, ``tf.IndexedSlices`` or None).
            variables: the variables they belong to, aligned with ``grads`` (needed for
                ``groups`` given as variables and for local variables).
        """
        out = list(grads)
        if not self.process_set.included():
            return out
        # In a graph the size is read when the step runs, not when it is traced: an elastic
        # job's tf.function outlives the world it was traced in (Horovod reads size_op()).
        eager = tf.executing_eagerly()
        if eager and (self.process_set.size() or 1) == 1:
            return out
        local = self.local if variables is not None else set()
        dense: list[int] = []
        for i, grad in enumerate(out):
            if grad is None:
                continue
            if variables is not None and id(variables[i]) in local:
                if self.scale_local_gradients:
                    out[i] = _scale(grad, self._size(eager))
                continue
            if isinstance(grad, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    out[i] = allreduce(
                        grad, op=self.op, prescale_factor=self.prescale, postscale_factor=self.postscale,
                        name=f"{self.name}.sparse.{i}", process_set=self.process_set, ignore_name_scope=True,
                    )  # fmt: skip
                    continue
                out[i] = tf.convert_to_tensor(grad)
            dense.append(i)
        for number, members in enumerate(self._plan(dense, variables)):
            reduced = grouped_allreduce(
                [out[i] for i in members], compression=self.compression, op=self.op,
                prescale_factor=self.prescale, postscale_factor=self.postscale, process_set=self.process_set,
                name=f"{self.name}.{number}", ignore_name_scope=True,
            )  # fmt: skip
            for i, value in zip(members, reduced):
                out[i] = value
        return out


    def _size(self, eager: bool) -> Any:
        """The set's size: a number eagerly, an op read when the step runs in a graph."""
        if eager:
            return self.process_set.size() or 1
        return size_op(self.process_set.process_set_id or 0)


def _scale(grad: Any, size: Any) -> Any:
    """``grad / size`` (``size`` a number or an int32 op)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(size, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad / tf.cast(size, grad.dtype)


class DistributedGradientTape(tf.GradientTape):  # type: ignore[misc]
    """A ``tf.GradientTape`` whose ``gradient()`` averages the gradients across ranks.

    Wrap a tape after recording (``tape = hvd.DistributedGradientTape(tape)``) or
    before entering it (``with hvd.DistributedGradientTape(tf.GradientTape()) as tape``).
    Arguments are Horovod's (``device_*`` accepted and ignored); see ``GradientReducer``.
    """

    def __init__(
        self,
        gradtape: Any,
        device_dense: str = "",
        device_sparse: str = "",
        compression: type[Compressor] = NoneCompressor,
        sparse_as_dense: bool = False,
        op: int = AVERAGE,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: int | Sequence[Sequence[Any]] | None = None,
        process_set: ProcessSet = global_process_set,
        scale_local_gradients: bool = True,
    ) -> None:
        super().__init__(persistent=gradtape._persistent, watch_accessed_variables=gradtape._watch_accessed_variables)
        self._tape = gradtape._tape  # take over what the wrapped tape recorded
        self._watched_variables = gradtape._watched_variables
        self._hora = GradientReducer(
            "DistributedGradientTape", compression, sparse_as_dense, op, gradient_predivide_factor,
            groups, num_groups, process_set, scale_local_gradients,
        )  # fmt: skip
        self.process_set = process_set

    def register_local_source(self, source: Any) -> None:
        """Keeps the gradient of ``source`` (a variable) local: it is not reduced across ranks."""
        self._hora.register_local([source])

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
        *,
        use_generic_names: bool = False,
    ) -> Any:
        """Computes the gradients as ``tf.GradientTape`` does, then reduces them across ranks."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = self._hora(tf.nest.flatten(grads), tf.nest.flatten(sources))
        return tf.nest.pack_sequence_as(grads, flat)


def PartialDistributedGradientTape(  # noqa: N802 - Horovod's name
    gradtape: Any,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = NoneCompressor,
    sparse_as_dense: bool = False,
    op: int = AVERAGE,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[Any]] | None = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> DistributedGradientTape:
    """A ``DistributedGradientTape`` that keeps the gradients of ``local_layers`` local.

    Args:
        local_layers: a Keras layer or a list of them; their trainable weights are
            trained on each rank alone (gradients divided by the set size when
            ``scale_local_gradients``).
    """
    tape = DistributedGradientTape(
        gradtape, device_dense, device_sparse, compression, sparse_as_dense, op, gradient_predivide_factor,
        num_groups, groups, process_set, scale_local_gradients,
    )  # fmt: skip
    layers = [] if local_layers is None else local_layers if isinstance(local_layers, (list, tuple)) else [local_layers]
    for layer in layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape
