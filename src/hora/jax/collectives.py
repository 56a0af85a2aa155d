"""Horovod's collectives on ``jax.Array`` s, eager and inside ``jax.jit``, differentiable.

Each function checks its arguments (process-set membership, the op, this rank's
dtypes; while tracing a failed check also fails the collective on the other ranks:
``bridge.check_traced``), then runs its kernel through ``bridge.run``: at once on
concrete arrays, as an ordered host callback inside a trace. Under a transformation
(``jax.grad``, ``jax.vjp``, ``jax.jit``) the call is a ``jax.custom_vjp`` whose backward
pass is Horovod's gradient, itself a collective, so every rank computes gradients in
the same order (the same program does):

* allreduce: the same allreduce of the upstream gradients (op and scale factors); for
  Min/Max the summed upstream gradient flows to the elements that won, for Product it
  is multiplied by ``result / input``.
* allgather: the averaged upstream gradient, then this rank's rows.
* broadcast: the averaged upstream gradient on the root, zeros elsewhere.
* alltoall: the upstream gradient sent back where it came from.
* reducescatter: the allgathered upstream gradient, times the scale factors (and the
  set size for Sum).

Integer inputs get no gradient (a zero cotangent).

Inside ``jit`` every output shape must be known when tracing: allgather needs the same
first dimension on every rank (the result has ``size`` times its rows), alltoall splits
evenly (no ``splits``) and likewise needs equal first dimensions.

Example, on 2 ranks::

    hvd.allreduce(jnp.array([1.0, 2.0]) * (hvd.rank() + 1), op=hvd.Sum)
    # rank 0: [3., 6.]   rank 1: [3., 6.]
    hvd.allgather(jnp.full((hvd.rank() + 1, 2), hvd.rank()))
    # both ranks (eager): [[0, 0], [1, 1], [1, 1]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hora.core import binding, ops
from hora.core.api import current
from hora.collectives.reduce import ADASUM, AVERAGE, OP_NAMES, PRODUCT, SUM
from hora.compression import Compressor, NoneCompressor
from hora.core.ops import RequestType
from hora.core.process_sets import ProcessSet, global_process_set
from hora.errors import UnsupportedOperationError
from hora.jax import bridge
from hora.jax.bridge import ADAPTER
from hora.jax.compression import for_jax

Forward = Callable[..., list[Any]]
Backward = Callable[[list[Any], list[Any], list[Any]], list[Any]]


def _differentiable(forward: Forward, backward: Backward, inputs: Sequence[Any]) -> list[Any]:
    """Runs ``forward(*inputs)``; under a transformation with ``backward(dys, xs, ys) -> dxs``
    as its gradient (None: no gradient for that input)."""
    if not bridge.is_traced(inputs):
        return forward(*inputs)  # concrete arrays: nothing can differentiate this call

    @jax.custom_vjp
    def op(*xs: Any) -> list[Any]:
        return forward(*xs)

    def fwd(*xs: Any) -> tuple[list[Any], tuple[list[Any], list[Any]]]:
        ys = forward(*xs)
        return ys, (list(xs), list(ys))

    def bwd(res: tuple[list[Any], list[Any]], dys: list[Any]) -> tuple[Any, ...]:
        xs, ys = res
        grads = backward(list(dys), xs, ys)
        return tuple(None if g is None else g.astype(x.dtype) for g, x in zip(grads, xs))

    op.defvjp(fwd, bwd)
    return list(op(*inputs))


def _floats(dys: list[Any], xs: list[Any]) -> list[int]:
    """Indices of the inputs that take a gradient (floating inputs with an upstream gradient)."""
    return [i for i, (dy, x) in enumerate(zip(dys, xs)) if dy is not None and bridge.is_float(x.dtype)]


def _set_size(process_set: ProcessSet) -> int:
    return int(process_set.size() or 1)


def _set_rank(process_set: ProcessSet) -> int:
    return int(process_set.rank() or 0)


def _prepare(
    tensors: Sequence[Any],
    process_set: ProcessSet,
    what: str,
    kind: RequestType,
    name: str | None,
    grouped: bool,
    params: Sequence[Any],
    more: Callable[[list[Any]], None] | None = None,
) -> tuple[list[Any], str | None]:
    """Converts a collective's inputs, checks them and draws the key of a traced call.

    Returns:
        The inputs as jax arrays (or tracers), and the key: None when eager (the binding
        numbers the call when the kernel runs), drawn now when traced (``bridge.draw_key``).
    """
    arrays = [x if isinstance(x, jax.core.Tracer) else jnp.asarray(x) for x in tensors]
    if not arrays:
        raise ValueError(f"hora.jax.{what}: needs at least one tensor")
    bridge.check_member(process_set, what)
    traced = bridge.is_traced(arrays)
    key = bridge.draw_key(what, [name, process_set.process_set_id, *params], len(arrays)) if traced else None

    def checks() -> None:
        for array in arrays:
            bridge.check_dtype(array.dtype, what)
        if more is not None:
            more(arrays)

    bridge.check_traced(checks, kind, what, name, key, process_set, grouped, len(arrays))
    return arrays, key


def _not_scalar(what: str) -> Callable[[list[Any]], None]:
    def check(arrays: list[Any]) -> None:
        if any(a.ndim == 0 for a in arrays):
            raise ValueError(f"hora.jax.{what}: needs arrays with at least one dimension; got a scalar")

    return check


def _shape(shape: Sequence[int], dtype: Any) -> jax.ShapeDtypeStruct:
    """A callback's output shape (``jax.ShapeDtypeStruct`` is untyped)."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype)  # type: ignore[no-untyped-call]


def _like(xs: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    return [_shape(x.shape, x.dtype) for x in xs]


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
    if op not in OP_NAMES:
        raise ValueError(f"hora.jax.{what}: {op!r} is not a reduce op (use hvd.Average, hvd.Sum, hvd.Min, ...)")
    kind = RequestType.ADASUM if op == ADASUM else RequestType.ALLREDUCE
    xs, key = _prepare(tensors, process_set, what, kind, name, grouped, [op, prescale, postscale])

    def kernel(key: str | None, *arrays: np.ndarray, into: Sequence[np.ndarray] = ()) -> list[np.ndarray]:
        adapter = bridge.adapter(into)
        queued = binding.allreduce_submit(adapter, arrays, name, op, prescale, postscale, process_set, False, grouped, key)
        return bridge.outputs(queued, grouped)

    def forward(*xs: Any) -> list[Any]:
        return bridge.run(kernel, xs, _like(xs), key, in_place=True)

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
                    safe = jnp.where(xs[i] == 0, 1, xs[i])
                    reduced.append(jnp.where(xs[i] == 0, 0, t * ys[i] / safe))
                else:  # MIN, MAX: the gradient flows to the elements that won
                    reduced.append(t * (xs[i] == ys[i]).astype(t.dtype))
        for i, g in zip(wanted, reduced):
            grads[i] = g
        return grads

    return _differentiable(forward, backward, xs)


def allreduce(
    tensor: Any,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Averages (or sums, ...) an array over the ranks of the set.

    Args:
        tensor: a ``jax.Array`` (or anything ``jnp.asarray`` takes; a tracer inside jit).
        average: deprecated; use ``op``.
        name: a name shared by every rank (unnamed calls are named for you: see ``bridge``).
        compression: ``Compression.fp16`` sends floating-point arrays as float16.
        op: Average (default), Sum, Min, Max, Product or Adasum.
        prescale_factor, postscale_factor: multiply the input before and the result after.
        process_set: the ranks taking part.

    Returns:
        An array of the input's shape and dtype.

    Raises:
        ValueError: a dtype hora does not move, a set this rank is not in, bad op/average.
        CollectiveMismatchError: (eager) the ranks disagreed; inside jit the same message
            arrives inside a ``jax.errors.JaxRuntimeError``.
    """
    op = ops.resolve_op(op, average)
    compression = for_jax(compression)
    compressed, ctx = compression.compress(tensor)
    (reduced,) = _allreduce([compressed], name, op, prescale_factor, postscale_factor, process_set, False)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[Any]:
    """Reduces every array of the list in one negotiated, fused group (see ``allreduce``)."""
    op = ops.resolve_op(op, average)
    compression = for_jax(compression)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _allreduce([p[0] for p in pairs], name, op, prescale_factor, postscale_factor, process_set, True)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


# ----- allgather -----


def _allgather(tensors: Sequence[Any], name: str | None, process_set: ProcessSet, grouped: bool) -> list[Any]:
    what = "grouped_allgather" if grouped else "allgather"
    xs, key = _prepare(tensors, process_set, what, RequestType.ALLGATHER, name, grouped, [], _not_scalar(what))
    size = _set_size(process_set)

    def kernel(key: str | None, *arrays: np.ndarray, fixed: bool, into: Sequence[np.ndarray] = ()) -> list[np.ndarray]:
        results = bridge.outputs(binding.allgather_submit(ADAPTER, arrays, name, process_set, grouped, key), grouped)
        if fixed:  # inside jit the result's shape was fixed when traced
            for result, array in zip(results, arrays):
                if result.shape[0] != array.shape[0] * size:
                    raise ValueError(
                        f"hora.jax.{what} inside jax.jit needs the same first dimension on every rank: this rank "
                        f"has {array.shape[0]} rows, the ranks {result.shape[0]} together; call it outside jit"
                    )
        return results

    def forward(*xs: Any) -> list[Any]:
        if not bridge.is_traced(xs):
            return bridge.run(functools.partial(kernel, fixed=False), xs, [], key)
        shapes = [_shape((x.shape[0] * size, *x.shape[1:]), x.dtype) for x in xs]
        return bridge.run(functools.partial(kernel, fixed=True), xs, shapes, key)

    def backward(dys: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        grads: list[Any] = [None] * len(xs)
        wanted = _floats(dys, xs)
        if not wanted:
            return grads
        reduced = _allreduce([dys[i] for i in wanted], None, AVERAGE, 1.0, 1.0, process_set, True)
        rows = np.array([[xs[i].shape[0] for i in wanted]], dtype=np.int64)
        (everyone,) = _allgather([jnp.asarray(rows)], None, process_set, False)
        starts = jnp.sum(everyone[: _set_rank(process_set)], axis=0)
        for k, (i, g) in enumerate(zip(wanted, reduced)):
            grads[i] = jax.lax.dynamic_slice_in_dim(g, starts[k], xs[i].shape[0], axis=0)
        return grads

    return _differentiable(forward, backward, xs)


def allgather(tensor: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """Concatenates every rank's array along dimension 0, in rank order.

    Dimension 0 may differ by rank eagerly; inside jit it must not (see the module).
    """
    return _allgather([tensor], name, process_set, False)[0]


def grouped_allgather(
    tensors: Sequence[Any], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Allgathers every array of the list as one negotiated group."""
    return _allgather(list(tensors), name, process_set, True)


# ----- broadcast -----


def _broadcast(
    tensors: Sequence[Any], root_rank: int, name: str | None, process_set: ProcessSet, grouped: bool
) -> list[Any]:
    what = "broadcast"
    root = int(root_rank)  # a global rank, as in Horovod

    def root_is_member(_: list[Any]) -> None:
        ops.check_root(current(), root, process_set, f"hora.jax.{what}")

    xs, key = _prepare(tensors, process_set, what, RequestType.BROADCAST, name, grouped, [root], root_is_member)

    def kernel(key: str | None, *arrays: np.ndarray, into: Sequence[np.ndarray] = ()) -> list[np.ndarray]:
        queued = binding.broadcast_submit(bridge.adapter(into), arrays, root, name, process_set, False, grouped, key)
        return bridge.outputs(queued, grouped)

    def forward(*xs: Any) -> list[Any]:
        return bridge.run(kernel, xs, _like(xs), key, in_place=True)

    def backward(dys: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        grads: list[Any] = [None] * len(xs)
        wanted = _floats(dys, xs)
        if not wanted:
            return grads
        reduced = _allreduce([dys[i] for i in wanted], None, AVERAGE, 1.0, 1.0, process_set, True)
        is_root = current().rank == root
        for i, g in zip(wanted, reduced):
            grads[i] = g if is_root else jnp.zeros_like(g)
        return grads

    return _differentiable(forward, backward, xs)


def broadcast(
    tensor: Any, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Returns ``root_rank``'s array on every rank (``root_rank`` is a global rank, a member of the set)."""
    return _broadcast([tensor], root_rank, name, process_set, False)[0]


def grouped_broadcast(
    tensors: Sequence[Any], root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Broadcasts every array of the list from ``root_rank``, all queued at once (one callback in jit)."""
    return _broadcast(list(tensors), root_rank, name, process_set, True)


# ----- alltoall -----


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Sends slice ``i`` of ``tensor`` (along dimension 0) to rank ``i`` of the set.

    Args:
        splits: rows for each rank; None splits evenly. Inside jit: None only.

    Returns:
        The received rows in rank order; with ``splits`` given, a tuple of (received
        rows, int32 array of rows received from each rank).
    """
    size = _set_size(process_set)
    given = splits is not None
    split_array = np.zeros(0, np.int32) if splits is None else splits
    if given and bridge.is_traced([tensor, split_array]):
        raise ValueError(
            "hora.jax.alltoall inside jax.jit splits evenly only (splits=None): with splits the result's shape "
            "is known only when it runs; call it outside jit"
        )

    def checks(arrays: list[Any]) -> None:
        _not_scalar("alltoall")(arrays[:1])
        if not jnp.issubdtype(arrays[1].dtype, jnp.integer):
            raise ValueError(f"hora.jax.alltoall: splits must be integers; got {arrays[1].dtype}")

    xs, key = _prepare([tensor, split_array], process_set, "alltoall", RequestType.ALLTOALL, name, False, [], checks)

    def kernel(
        key: str | None, array: np.ndarray, split: np.ndarray, fixed: bool, into: Sequence[np.ndarray] = ()
    ) -> list[np.ndarray]:
        queued = binding.alltoall_submit(ADAPTER, array, split, name, process_set, key)
        result: list[np.ndarray] = queued.finish(binding.wait_all(queued.handles))
        if fixed and result[0].shape[0] != array.shape[0]:  # inside jit the shape was fixed when traced
            raise ValueError(
                "hora.jax.alltoall inside jax.jit needs the same first dimension on every rank; call it outside jit"
            )
        return result

    def forward(x: Any, s: Any) -> list[Any]:
        if not bridge.is_traced([x, s]):
            return bridge.run(functools.partial(kernel, fixed=False), [x, s], [], key)
        shapes = [_shape(x.shape, x.dtype), _shape((size,), jnp.int32)]
        return bridge.run(functools.partial(kernel, fixed=True), [x, s], shapes, key)

    def backward(dys: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        if not _floats(dys[:1], xs[:1]):
            return [None, None]
        back = alltoall(dys[0], splits=ys[1] if given else None, process_set=process_set)
        back = back[0] if given else back
        missing = xs[0].shape[0] - back.shape[0]  # rows past the splits were not sent
        if missing:
            back = jnp.concatenate([back, jnp.zeros((missing, *back.shape[1:]), back.dtype)])
        return [back, None]

    output, received = _differentiable(forward, backward, xs)
    return (output, received) if given else output


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
        raise ValueError(f"hora.jax.{what}: {op!r} is not a reduce op (use hvd.Average or hvd.Sum)")
    if op not in (AVERAGE, SUM):  # Horovod's reducescatter has Average and Sum alone
        raise UnsupportedOperationError(f"hora.jax.{what}: reduce op {OP_NAMES[op]} is not supported (use Average or Sum)")
    xs, key = _prepare(
        tensors, process_set, what, RequestType.REDUCESCATTER, name, grouped, [op, prescale, postscale], _not_scalar(what)
    )
    size, me = _set_size(process_set), _set_rank(process_set)

    def kernel(key: str | None, *arrays: np.ndarray, into: Sequence[np.ndarray] = ()) -> list[np.ndarray]:
        queued = binding.reducescatter_submit(ADAPTER, arrays, name, op, process_set, prescale, postscale, grouped, key)
        return bridge.outputs(queued, grouped)

    def forward(*xs: Any) -> list[Any]:
        shapes = [
            _shape((x.shape[0] // size + (1 if me < x.shape[0] % size else 0), *x.shape[1:]), x.dtype)
            for x in xs
        ]
        return bridge.run(kernel, xs, shapes, key)

    def backward(dys: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        grads: list[Any] = [None] * len(xs)
        wanted = _floats(dys, xs)
        if not wanted:
            return grads
        gathered = _allgather_rows([dys[i] for i in wanted], [xs[i].shape[0] for i in wanted], process_set)
        factor = ops.reducescatter_grad_scale(op, size, prescale, postscale)
        for i, g in zip(wanted, gathered):
            grads[i] = g * factor if factor != 1.0 else g
        return grads

    return _differentiable(forward, backward, xs)


def _allgather_rows(tensors: list[Any], rows: list[int], process_set: ProcessSet) -> list[Any]:
    """Allgathers reducescatter's slices back to full arrays; inside jit the slices of
    different ranks may differ by one row, so each is padded to the largest and cut after."""
    size = _set_size(process_set)
    if not bridge.is_traced(tensors):
        return _allgather(tensors, None, process_set, True)
    padded = []
    for t, n in zip(tensors, rows):
        most = -(-n // size)
        padded.append(jnp.concatenate([t, jnp.zeros((most - t.shape[0], *t.shape[1:]), t.dtype)]) if t.shape[0] < most else t)
    gathered = _allgather(padded, None, process_set, True)
    results = []
    for g, n in zip(gathered, rows):
        most, extra = -(-n // size), n % size
        # rank r's rows sit at [r * most, r * most + its rows); keep them in order
        index = np.concatenate([np.arange(r * most, r * most + n // size + (1 if r < extra else 0)) for r in range(size)])
        results.append(g[index])
    return results


def reducescatter(
    tensor: Any,
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: int = AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Any:
    """Reduces ``tensor`` over the set; returns this rank's rows of dimension 0.

    With ``q, m = divmod(rows, size)``, rank ``r`` of the set gets ``q + 1`` rows if
    ``r < m``, else ``q``. Average (default) and Sum only.
    """
    compression = for_jax(compression)
    compressed, ctx = compression.compress(tensor)
    (result,) = _reducescatter([compressed], name, op, prescale_factor, postscale_factor, process_set, False)
    return compression.decompress(result, ctx)


def grouped_reducescatter(
    tensors: Sequence[Any],
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: int = AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[Any]:
    """Reducescatters every array of the list as one negotiated group."""
    compression = for_jax(compression)
    pairs = [compression.compress(t) for t in tensors]
    results = _reducescatter([p[0] for p in pairs], name, op, prescale_factor, postscale_factor, process_set, True)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, pairs)]


__all__ = [
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_broadcast",
    "grouped_reducescatter",
    "reducescatter",
]
