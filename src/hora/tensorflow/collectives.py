"""Horovod's TensorFlow collectives, eager and inside ``tf.function``, with gradients.

Each function here checks its arguments at once (process-set membership, the op;
also while tracing), runs its kernel (``kernels.py``) through ``bridge.run``, sets the
static shapes TensorFlow needs, and registers a gradient with ``tf.custom_gradient``.
What depends on this rank's inputs (dtype, rank, the root) is checked so that one
rank's failure fails the collective on every rank: eagerly by the binding core when
the kernel runs, and while a graph is built here, failing the trace at once and the
op's first run on the other ranks (``_prepare``, ``bridge.check_traced``).

Gradients follow Horovod's (each is itself a collective, so every rank must compute
them in the same order, which the same training step does):

* allreduce: the same allreduce of the upstream gradients (op and scale factors);
  for Min/Max the summed upstream gradient flows to the elements that won, for
  Product it is multiplied by ``result / input``.
* allgather: the averaged upstream gradient, then this rank's rows.
* broadcast: the averaged upstream gradient on the root, zeros elsewhere.
* alltoall: the upstream gradient sent back where it came from.
* reducescatter: the allgathered upstream gradient, times the scale factors (and the
  set size for Sum).

Example, on 2 ranks::

    hvd.allreduce(tf.constant([1.0, 2.0]) * (hvd.rank() + 1), op=hvd.Sum)
    # rank 0: [3., 6.]   rank 1: [3., 6.]
    hvd.allgather(tf.fill([hvd.rank() + 1, 2], hvd.rank()))
    # both ranks: [[0, 0], [1, 1], [1, 1]]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf  # type: ignore[import-untyped]

from hora.core import ops
from hora.core.api import current
from hora.collectives.reduce import ADASUM, AVERAGE, OP_NAMES, PRODUCT, SUM
from hora.compression import Compressor, NoneCompressor
from hora.errors import UnsupportedOperationError
from hora.core.ops import RequestType
from hora.core.process_sets import ProcessSet, global_process_set
from hora.tensorflow import basics, bridge, kernels
from hora.tensorflow.compression import for_tensorflow

Backward = Callable[[list[Any], list[Any], list[Any]], list[Any]]


def _differentiable(forward: Callable[..., list[Any]], backward: Backward, inputs: Sequence[Any]) -> list[Any]:
    """Runs ``forward(*inputs)`` and registers ``backward(dys, xs, ys) -> dxs`` as its gradient."""
    from tensorflow.python.eager import record  # type: ignore[import-untyped]

    if tf.executing_eagerly() and not record.could_possibly_record():
        return forward(*inputs)  # no tape can watch this: skip the bookkeeping

    @tf.custom_gradient  # type: ignore[untyped-decorator]
    def op(*xs: Any) -> Any:
        ys = forward(*xs)

        def grad(*dys: Any) -> list[Any]:
            return backward([None if d is None else tf.convert_to_tensor(d) for d in dys], list(xs), list(ys))

        return ys, grad

    return list(op(*inputs))


def _floats(dys: list[Any], xs: list[Any]) -> list[int]:
    """Indices of the inputs that take a gradient (floating inputs with an upstream gradient)."""
    return [i for i, (dy, x) in enumerate(zip(dys, xs)) if dy is not None and bridge.is_float(x.dtype)]


def _shaped_like_inputs(kernel: Any, what: str) -> Callable[..., list[Any]]:
    """The forward of a kernel whose outputs have their inputs' shapes and types."""

    def forward(*xs: Any) -> list[Any]:
        ys = bridge.run(kernel, xs, [x.dtype for x in xs], what)
        for y, x in zip(ys, xs):
            y.set_shape(x.shape)
        return ys

    return forward


def _prepare(
    tensors: Sequence[Any],
    process_set: ProcessSet,
    what: str,
    kind: RequestType,
    name: str | None,
    grouped: bool,
    more: Callable[[list[Any]], None] | None = None,
) -> list[Any]:
    """Converts a collective's inputs and checks them.

    Membership of the set is checked at once (a rank outside it has nobody waiting for
    it). What depends on this rank's inputs (dtypes, and ``more``) is checked while a
    graph is built, failing the op on every rank (``bridge.check_traced``); eagerly the
    binding core checks it when the kernel runs, with the same effect.
    """
    converted = [tf.convert_to_tensor(t) for t in tensors]
    bridge.check_member(process_set, what)

    def checks() -> None:
        for tensor in converted:
            bridge.check_dtype(tensor, what)
        if more is not None:
            more(converted)

    bridge.check_traced(checks, kind, what, name, process_set, grouped, len(converted))
    return converted


def _not_scalar(what: str, needs: str) -> Callable[[list[Any]], None]:
    """A ``_prepare`` check: every input has at least one dimension."""

    def check(tensors: list[Any]) -> None:
        if any(t.shape.rank == 0 for t in tensors):
            raise ValueError(f"hora.tensorflow.{what}: {needs} needs a tensor with at least one dimension; got a scalar")

    return check


def _set_size(process_set: ProcessSet) -> int:
    return int(process_set.size() or 1)


def _set_rank(process_set: ProcessSet) -> int:
    return int(process_set.rank() or 0)


# ----- allreduce -----


def _allreduce(
    tensors: Sequence[Any],
    name: str | None,
    op: int,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
    grouped: bool,
) -> list[Any]:
    what = "grouped_allreduce" if grouped else "allreduce"
    kind = RequestType.ADASUM if op == ADASUM else RequestType.ALLREDUCE
    tensors = _prepare(tensors, process_set, what, kind, name, grouped)
    if op not in OP_NAMES:
        raise ValueError(f"hora.tensorflow.{what}: unknown reduce op {op}")
    if op == ADASUM:  # checked here too, so that tracing fails rather than the first step
        size = _set_size(process_set)
        if process_set.process_set_id != 0 or size & (size - 1):
            raise NotImplementedError(
                f"hora.tensorflow.{what}: Adasum runs on the global process set with a power-of-two number "
                f"of ranks; this set has {size}"
            )
    kernel = kernels.allreduce(name, op, prescale, postscale, process_set, grouped)

    forward = _shaped_like_inputs(kernel, what)

    def backward(dys: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        grads: list[Any] = [None] * len(xs)
        wanted = _floats(dys, xs)
        if not wanted:
            return grads
        upstream = [dys[i] for i in wanted]
        if op in (AVERAGE, SUM, ADASUM):
            reduced = _allreduce(upstream, None, op, prescale, postscale, process_set, True)
        else:
            total = _allreduce(upstream, None, SUM, prescale * postscale, 1.0, process_set, True)
            reduced = []
            for t, i in zip(total, wanted):
                if op == PRODUCT:
                    reduced.append(t * tf.math.divide_no_nan(ys[i], xs[i]))
                else:  # MIN, MAX: the gradient flows to the elements that won
                    reduced.append(t * tf.cast(tf.equal(xs[i], ys[i]), t.dtype))
        for i, g in zip(wanted, reduced):
            grads[i] = g
        return grads

    return _differentiable(forward, backward, tensors)


def _sparse_allreduce(
    tensor: Any, name: str | None, op: int, prescale: float, postscale: float, process_set: ProcessSet
) -> Any:
    """Reduces a ``tf.IndexedSlices`` by gathering its values and indices, as Horovod: Sum,
    or Average (the gathered values divided by the set's size: integer values become
    floating, as TensorFlow's ``/`` makes them), without scale factors."""
    if op not in (AVERAGE, SUM):
        raise NotImplementedError(
            f"hora.tensorflow.allreduce: {OP_NAMES.get(op, op)} is not supported for tf.IndexedSlices "
            "(only Sum and Average); pass sparse_as_dense=True to reduce them as dense tensors"
        )
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError(
            "hora.tensorflow.allreduce: prescale_factor and postscale_factor are not supported for tf.IndexedSlices "
            "(as in Horovod); pass sparse_as_dense=True to reduce them as dense tensors"
        )
    values, indices = _allgather([tensor.values, tensor.indices], name, process_set, True)
    if op == AVERAGE:
        # In a graph the size is read when the op runs: an elastic job's graph outlives its world.
        size = _set_size(process_set) if tf.executing_eagerly() else basics.size_op(process_set.process_set_id or 0)
        values = values / tf.cast(size, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = NoneCompressor,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """Averages (or sums, ...) a tensor over the ranks of the set.

    Args:
        tensor: a ``tf.Tensor``, ``tf.Variable`` or ``tf.IndexedSlices`` (reduced by
            allgathering its values and indices; Sum and Average only).
        average: deprecated; use ``op``.
        device_dense, device_sparse: accepted for Horovod compatibility; hora runs on the CPU.
        compression: ``Compression.fp16`` sends floating-point tensors as float16.
        op: Average (default), Sum, Min, Max, Product or Adasum.
        prescale_factor, postscale_factor: multiply the input before and the result after.
        name: a name shared by every rank; prefixed with the name scope unless ``ignore_name_scope``.
        process_set: the ranks taking part.

    Returns:
        A tensor of the input's shape and dtype (``tf.IndexedSlices`` for one).

    Raises:
        ValueError: a dtype hora does not move, a set this rank is not in, bad op/average.
        CollectiveMismatchError: (eager) the ranks disagreed; inside ``tf.function`` the
            same message arrives as a ``tf.errors.UnknownError``.
    """
    op = ops.resolve_op(op, average)
    name = bridge.scoped_name(name, ignore_name_scope)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, name, op, prescale_factor, postscale_factor, process_set)
    compression = for_tensorflow(compression)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    (reduced,) = _allreduce([compressed], name, op, prescale_factor, postscale_factor, process_set, False)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = NoneCompressor,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[Any]:
    """Reduces every tensor of the list in one negotiated, fused group (see ``allreduce``).

    ``tf.IndexedSlices`` in the list are reduced by allgathers, one each.
    """
    op = ops.resolve_op(op, average)
    name = bridge.scoped_name(name, ignore_name_scope)
    compression = for_tensorflow(compression)
    results: list[Any] = [None] * len(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    for i, tensor in enumerate(tensors):
        if isinstance(tensor, tf.IndexedSlices):
            sparse_name = None if name is None else f"{name}.sparse.{i}"
            results[i] = _sparse_allreduce(tensor, sparse_name, op, prescale_factor, postscale_factor, process_set)
    if dense:
        pairs = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
        reduced = _allreduce([p[0] for p in pairs], name, op, prescale_factor, postscale_factor, process_set, True)
        for i, r, (_, ctx) in zip(dense, reduced, pairs):
            results[i] = compression.decompress(r, ctx)
    return results


# ----- allgather -----


def _allgather(tensors: Sequence[Any], name: str | None, process_set: ProcessSet, grouped: bool) -> list[Any]:
    what = "grouped_allgather" if grouped else "allgather"
    tensors = _prepare(tensors, process_set, what, RequestType.ALLGATHER, name, grouped, _not_scalar(what, "allgather"))
    kernel = kernels.allgather(name, process_set, grouped)
    size = _set_size(process_set)

    def forward(*xs: Any) -> list[Any]:
        ys = bridge.run(kernel, xs, [x.dtype for x in xs], what)
        for y, x in zip(ys, xs):
            y.set_shape(x.shape if size == 1 else tf.TensorShape([None]).concatenate(x.shape[1:]))
        return ys

    def backward(dys: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        grads: list[Any] = [None] * len(xs)
        wanted = _floats(dys, xs)
        if not wanted:
            return grads
        reduced = _allreduce([dys[i] for i in wanted], None, AVERAGE, 1.0, 1.0, process_set, True)
        rows = tf.stack([tf.shape(xs[i], out_type=tf.int64)[0] for i in wanted])
        (everyone,) = _allgather([tf.reshape(rows, [1, -1])], None, process_set, False)
        starts = tf.reduce_sum(everyone[: _set_rank(process_set)], axis=0)
        for k, (i, g) in enumerate(zip(wanted, reduced)):
            grads[i] = g[starts[k] : starts[k] + rows[k]]
        return grads

    return _differentiable(forward, backward, tensors)


def allgather(
    tensor: Any, name: str | None = None, ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set
) -> Any:
    """Concatenates every rank's tensor along dimension 0, in rank order.

    Dimension 0 may differ by rank; the other dimensions must agree. Inside
    ``tf.function`` the result's first dimension is unknown until it runs.
    """
    return _allgather([tensor], bridge.scoped_name(name, ignore_name_scope), process_set, False)[0]


def grouped_allgather(
    tensors: Sequence[Any],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[Any]:
    """Allgathers every tensor of the list as one negotiated group."""
    return _allgather(list(tensors), bridge.scoped_name(name, ignore_name_scope), process_set, True)


# ----- broadcast -----


def _broadcast(
    tensors: Sequence[Any], root_rank: int, name: str | None, process_set: ProcessSet, grouped: bool
) -> list[Any]:
    what = "broadcast"
    root = int(root_rank)  # a global rank, as in Horovod

    def root_is_member(_: list[Any]) -> None:
        ops.check_root(current(), root, process_set, f"hora.tensorflow.{what}")

    tensors = _prepare(tensors, process_set, what, RequestType.BROADCAST, name, grouped, root_is_member)
    kernel = kernels.broadcast(name, root, process_set, grouped)

    forward = _shaped_like_inputs(kernel, what)

    def backward(dys: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        grads: list[Any] = [None] * len(xs)
        wanted = _floats(dys, xs)
        if not wanted:
            return grads
        reduced = _allreduce([dys[i] for i in wanted], None, AVERAGE, 1.0, 1.0, process_set, True)
        is_root = current().rank == root
        for i, g in zip(wanted, reduced):
            # As Horovod: g * 0, which keeps the allreduce in the graph (TensorFlow folds
            # zeros_like(g) of a known shape to a constant, so a TF1 Session would prune the
            # allreduce on the other ranks and the root would wait for it for ever), and a
            # NaN or Inf gradient stays NaN.
            grads[i] = g if is_root else g * 0
        return grads

    return _differentiable(forward, backward, tensors)


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Returns ``root_rank``'s tensor on every rank (``root_rank`` is a global rank, a member of the set)."""
    return _broadcast([tensor], root_rank, bridge.scoped_name(name, ignore_name_scope), process_set, False)[0]


def broadcast_(
    variables: Any, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Overwrites each variable with ``root_rank``'s value.

    Takes one variable or a list; all are broadcast as one batch of collectives.

    Returns:
        Eagerly and in ``tf.function``, the variables. In a TF1 graph, what each
        assignment returns (the variable's new value: evaluating it runs the broadcast,
        as Horovod's in-place op does).
    """
    single = not isinstance(variables, (list, tuple))
    targets = [variables] if single else list(variables)
    if not targets:
        return variables
    values = _broadcast([tf.convert_to_tensor(v) for v in targets], root_rank, name, process_set, True)
    assigned = [variable.assign(value) for variable, value in zip(targets, values)]
    if tf.executing_eagerly() or tf.inside_function():
        return variables
    return assigned[0] if single else assigned


# ----- alltoall -----


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Sends slice ``i`` of ``tensor`` (along dimension 0) to rank ``i`` of the set.

    Args:
        splits: rows for each rank; None splits evenly.

    Returns:
        The received rows in rank order; with ``splits`` given, a tuple of (received
        rows, int32 tensor of rows received from each rank).
    """
    name = bridge.scoped_name(name, ignore_name_scope)
    split_tensor = tf.constant([], dtype=tf.int32) if splits is None else tf.convert_to_tensor(splits)

    def checks(tensors: list[Any]) -> None:
        _not_scalar("alltoall", "alltoall")(tensors)
        if not split_tensor.dtype.is_integer:
            raise ValueError(f"hora.tensorflow.alltoall: splits must be integers; got {split_tensor.dtype.name}")

    (tensor,) = _prepare([tensor], process_set, "alltoall", RequestType.ALLTOALL, name, False, checks)
    kernel = kernels.alltoall(name, process_set)
    size = _set_size(process_set)

    def forward(x: Any, s: Any) -> list[Any]:
        y, received = bridge.run(kernel, [x, s], [x.dtype, tf.int32], "alltoall")
        y.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        received.set_shape([size])
        return [y, received]

    def backward(dys: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        if not _floats(dys[:1], xs[:1]):
            return [None, None]
        back, _ = alltoall(dys[0], splits=ys[1], process_set=process_set)
        missing = tf.shape(xs[0])[0] - tf.shape(back)[0]  # rows past the splits were not sent
        padding = tf.zeros(tf.concat([[missing], tf.shape(back)[1:]], 0), back.dtype)
        return [tf.concat([back, padding], 0), None]

    output, received = _differentiable(forward, backward, [tensor, split_tensor])
    return output if splits is None else (output, received)


# ----- reducescatter -----


def _reducescatter(
    tensors: Sequence[Any],
    name: str | None,
    op: int,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
    grouped: bool,
) -> list[Any]:
    what = "grouped_reducescatter" if grouped else "reducescatter"
    if op not in OP_NAMES:
        raise ValueError(f"hora.tensorflow.{what}: {op!r} is not a reduce op (use hvd.Average or hvd.Sum)")
    if op not in (AVERAGE, SUM):  # Horovod's reducescatter has Average and Sum alone
        raise UnsupportedOperationError(f"hora.tensorflow.{what}: reduce op {OP_NAMES[op]} is not supported (use Average or Sum)")
    tensors = _prepare(
        tensors, process_set, what, RequestType.REDUCESCATTER, name, grouped, _not_scalar(what, "reducescatter")
    )
    kernel = kernels.reducescatter(name, op, prescale, postscale, process_set, grouped)
    size, me = _set_size(process_set), _set_rank(process_set)

    def forward(*xs: Any) -> list[Any]:
        ys = bridge.run(kernel, xs, [x.dtype for x in xs], what)
        for y, x in zip(ys, xs):
            rows = x.shape[0]
            mine = None if rows is None else rows // size + (1 if me < rows % size else 0)
            y.set_shape(tf.TensorShape([mine]).concatenate(x.shape[1:]))
        return ys

    def backward(dys: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        grads: list[Any] = [None] * len(xs)
        wanted = _floats(dys, xs)
        if not wanted:
            return grads
        gathered = _allgather([dys[i] for i in wanted], None, process_set, True)
        factor = ops.reducescatter_grad_scale(op, size, prescale, postscale)
        for i, g in zip(wanted, gathered):
            grads[i] = g * tf.constant(factor, dtype=g.dtype) if factor != 1.0 else g
        return grads

    return _differentiable(forward, backward, tensors)


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: type[Compressor] = NoneCompressor,
    op: int = AVERAGE,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Any:
    """Reduces ``tensor`` over the set; returns this rank's rows of dimension 0.

    With ``q, m = divmod(rows, size)``, rank ``r`` of the set gets ``q + 1`` rows if
    ``r < m``, else ``q``. Average (default) and Sum only.
    """
    compression = for_tensorflow(compression)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    name = bridge.scoped_name(name, ignore_name_scope)
    (result,) = _reducescatter([compressed], name, op, prescale_factor, postscale_factor, process_set, False)
    return compression.decompress(result, ctx)


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: type[Compressor] = NoneCompressor,
    op: int = AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    ignore_name_scope: bool = False,
) -> list[Any]:
    """Reducescatters every tensor of the list as one negotiated group."""
    compression = for_tensorflow(compression)
    pairs = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    name = bridge.scoped_name(name, ignore_name_scope)
    results = _reducescatter([p[0] for p in pairs], name, op, prescale_factor, postscale_factor, process_set, True)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, pairs)]


__all__ = [
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "broadcast_",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "reducescatter",
]
