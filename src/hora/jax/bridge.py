"""How ``jax.Array`` s reach hora's core, eagerly and inside ``jax.jit``.

Every collective of ``hora.jax`` is a *kernel*: a Python function on NumPy arrays that
hands them to the shared binding core (``hora.core.binding`` with ``ADAPTER``), waits
for every handle it queued, and returns NumPy arrays. ``run`` calls it:

* Eagerly (concrete inputs), at once: a CPU ``jax.Array`` is read in place through
  ``np.asarray`` (a read-only view, no copy); results are written into 64-byte aligned
  buffers that ``jax.device_put`` adopts without a copy (``adopt``).
* Inside a trace (``jax.jit``, and the forward and backward passes of ``jax.grad``
  under ``jit``), as one ordered host call (``host_call``): XLA calls the kernel when
  the compiled program reaches it, with the program's own input buffers, and the
  engine writes allreduce and broadcast results into the program's result buffers
  (``hora.jax.ffi``; an ordered ``io_callback``, with copies, where JAX lacks the pieces).

Why ordered callbacks. A kernel blocks until every rank of the set has submitted its
collective. Were two independent callbacks of one program free to run in either order,
rank 0 could block in A while rank 1 blocks in B on the single thread that runs them,
and neither would ever submit the other: a hang. JAX's ordering token runs through
every hora callback (the effect of ``io_callback(ordered=True)``), so each program runs
its collectives in program order (the order they were traced in), one at a time, across the executions of
one device too (step ``n + 1`` runs its first collective after step ``n``'s last).
Every rank traces the same program, so every rank runs the same sequence.

Names come from the program, not from the clock (docs/architecture.md, "Learned the
hard way"). An unnamed collective inside a trace gets its key when it is *traced*
(``draw_key``), from what the program says about it: ``jit.<file>:<line>.<digest>``,
where ``<file>:<line>`` is the caller's site outside hora and JAX, and ``<digest>``
hashes the op, its parameters (op, scale factors, root, set) and how many tensors it
takes. It depends on no counter, so a rank that retraces alone (a smaller last batch,
a cache eviction) draws the same keys again; the key is reused on every run, so the
response cache skips negotiation from the second step on. It does not depend on the
inputs' shapes or dtypes either: those may differ between ranks by mistake, and the
coordinator must see one name to say so (``shapes differ across ranks: rank 0 ...``).
Two collectives of one program may share a key (the same line in a Python loop): they
run one after the other (ordered), and each rank runs them in the same order, so they
meet in turn (give them names, or group them, to keep the response cache hitting when
their shapes differ).

A check that fails on one rank only while tracing (a dtype hora cannot move, a root
outside the set) fails the trace at once and is sent to the coordinator under the
names the collective would have had (``check_traced``), so the other ranks fail its
first run instead of waiting.
"""

from __future__ import annotations

import hashlib
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from hora.core import binding, ops
from hora.core.api import current
from hora.collectives.reduce import data_type_of
from hora.core.ops import RequestType
from hora.core.process_sets import ProcessSet
from hora.jax import ffi

Kernel = Callable[..., list[np.ndarray]]

# Modules whose frames are skipped when a key looks for the program's line.
_LIBRARY_PREFIXES = ("hora.", "jax.", "jaxlib.", "flax.", "optax.", "chex.", "contextlib", "functools")


class JaxAdapter:
    """NumPy views of ``jax.Array`` s as the core moves them (``binding.Adapter``).

    Kernels receive NumPy arrays (views of the jax.Arrays, or of the program's buffers
    inside jit). Eagerly, results are aligned NumPy arrays that ``run`` hands to JAX;
    inside jit, an adapter given the program's result buffers (``adapter(into)``) has
    the engine write allreduce and broadcast results straight into them. bfloat16
    travels as uint16 and is viewed back, no copy.
    """

    @staticmethod
    def _restore(array: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
        return array if array.dtype == dtype else array.view(dtype)

    def stage(self, tensor: np.ndarray, writable: bool, what: str) -> tuple[ops.Tensor, Callable[[], Any]]:
        if writable:  # jax.Arrays are immutable: hora.jax never asks
            raise ValueError(f"{what}: jax.Arrays cannot be written in place")
        try:
            return ops.from_numpy(tensor), lambda: tensor
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{what}: {exc}") from None

    def __init__(self, into: Sequence[np.ndarray] = ()) -> None:
        self._into = list(into)  # the program's result buffers, taken in tensor order

    def output(self, tensor: np.ndarray, wire: ops.Tensor) -> tuple[np.ndarray, Callable[[], Any]]:
        if self._into:  # inside jit (hora.jax.ffi): the engine writes into the program's buffer
            target = self._into.pop(0)
            return target.reshape(-1).view(wire.data.dtype), lambda: target
        output = binding.aligned_empty(wire.data.size, wire.data.dtype)
        return output, lambda: self._restore(output.reshape(wire.shape), tensor.dtype)

    def wrap(self, array: np.ndarray, like: np.ndarray) -> np.ndarray:
        return self._restore(array, like.dtype)

    def splits(self, splits: Any) -> np.ndarray | None:
        if splits is None:
            return None
        array = np.asarray(splits).reshape(-1)
        return array if array.size else None

    def alltoall_result(self, output: np.ndarray, received: np.ndarray, splits_given: bool) -> list[np.ndarray]:
        return [output, np.asarray(received, dtype=np.int32)]


ADAPTER = JaxAdapter()


def adapter(into: Sequence[np.ndarray]) -> JaxAdapter:
    """The adapter for a kernel given the program's result buffers ``into`` (empty: eager,
    or a callback whose results XLA copies in)."""
    return JaxAdapter(into) if into else ADAPTER


def is_traced(values: Sequence[Any]) -> bool:
    """True when any value is a tracer (inside ``jit``, ``grad``, ``vmap``, ...)."""
    return any(isinstance(v, jax.core.Tracer) for v in values)


def host_view(value: Any) -> np.ndarray:
    """A NumPy view of a concrete array (a CPU jax.Array is read in place)."""
    return np.asarray(value)


def check_dtype(dtype: Any, what: str) -> None:
    """Raises ValueError for a dtype hora cannot move."""
    try:
        data_type_of(np.dtype(dtype))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"hora.jax.{what}: {exc}") from None


def check_member(process_set: ProcessSet, what: str) -> None:
    """Raises ValueError at once (also while tracing) when this rank may not use the set."""
    ops.set_id(current(), process_set, f"hora.jax.{what}")


def _site() -> str:
    """``<file>:<line>`` of the innermost frame outside hora, JAX and the libraries on it."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if not module.startswith(_LIBRARY_PREFIXES) and module not in ("jax", "hora", "flax", "optax"):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "unknown"


def draw_key(what: str, params: Sequence[Any], count: int) -> str:
    """The key of an unnamed collective being traced (see the module's names).

    Args:
        what: the op (``allreduce``, ``grouped_allgather``, ...).
        params: what else distinguishes the call, the same on every rank (op, scale
            factors, root, set); never the inputs' shapes or dtypes.
        count: how many tensors the call takes.
    """
    text = repr((what, tuple(params), count))
    digest = hashlib.blake2b(text.encode(), digest_size=5).hexdigest()
    return f"jit.{_site()}.{digest}"


def check_traced(
    checks: Callable[[], None],
    kind: RequestType,
    what: str,
    name: str | None,
    key: str | None,
    process_set: ProcessSet,
    grouped: bool,
    count: int,
) -> None:
    """Runs the checks of this rank's inputs to a collective; while tracing, a failure is
    also sent to the coordinator under the names the collective would have had, so the
    other ranks fail its first run instead of waiting for this rank. Eagerly only the
    check runs here: the binding core tells the others when the kernel runs.

    Raises:
        Exception: what ``checks`` raised.
    """
    try:
        checks()
    except Exception:
        if key is None:
            raise
        runtime = current()
        _, names, group = binding.call_names(
            runtime,
            what.removeprefix("grouped_"),
            name,
            process_set,
            grouped,
            count,
            key,
            wire_group=kind != RequestType.BROADCAST,
        )
        with ops.refusal(runtime, kind, names, process_set, group):
            raise


def run(
    kernel: Kernel,
    inputs: Sequence[Any],
    out_shapes: Sequence[jax.ShapeDtypeStruct],
    key: str | None,
    in_place: bool = False,
) -> list[Any]:
    """Runs ``kernel(key, *arrays)``: at once when the inputs are concrete, else as one
    ordered host callback of the program being traced (``host_call``).

    Args:
        key: what the collective's caller decided from *its* inputs: None when they were
            concrete (the binding numbers the call), drawn when they were tracers. Under
            ``jax.grad`` without ``jit`` the caller's inputs are tracers while the
            custom_vjp hands the kernel concrete values: the kernel then runs at once
            but under the drawn key, the one a failed check was sent under
            (``check_traced``), so every rank names the call alike.
        in_place: the kernel may be handed each input's buffer as its output's
            (``host_call``).

    Returns:
        The kernel's outputs as jax.Arrays (or tracers), one per ``out_shapes``.
    """
    # A kernel submits and waits at once: the calling thread executes its own collectives
    # (Engine.caller_drives), inside jit on XLA's thread, which a bound rank shares with
    # hora's engine thread.
    if not is_traced(inputs):
        with current().caller_drives():
            results = kernel(key, *[host_view(x) for x in inputs])
        return [adopt(y) for y in results]

    def body(arrays: list[np.ndarray], outputs: list[np.ndarray]) -> list[np.ndarray]:
        with current().caller_drives():
            return kernel(key, *arrays, into=outputs)

    return host_call(body, inputs, out_shapes, in_place)


def adopt(array: np.ndarray) -> Any:
    """A ``jax.Array`` of a kernel's result: JAX's CPU client takes a 64-byte aligned
    buffer (``binding.aligned_empty``) without a copy, and copies any other once."""
    return jax.device_put(array)


def host_call(
    body: Callable[[list[np.ndarray], list[np.ndarray]], list[np.ndarray]],
    inputs: Sequence[Any],
    out_shapes: Sequence[jax.ShapeDtypeStruct],
    in_place: bool = False,
) -> list[Any]:
    """``body(arrays, outputs)`` as one ordered host call of the program being traced.

    An XLA FFI custom call (``hora.jax.ffi``) where this JAX has what it needs: the body
    reads the program's input buffers in place and may write its results straight into
    ``outputs``, the program's result buffers. Elsewhere an ordered ``io_callback``, with
    no outputs to write into (XLA copies the results in).

    Args:
        in_place: ``out_shapes`` are the inputs' and the body may find an input's buffer
            handed over as that output's. XLA then reuses the buffer of an input the
            program no longer needs (a step's gradients) instead of a fresh one per call,
            which the body would write into cold, page by page; where the program still
            needs the input, XLA copies it first. Only for a body whose engine paths all
            read an element of an input before writing that element of its output
            (allreduce, broadcast).
    """
    calls = ffi.HostCalls.create()
    if calls is None:
        return list(io_callback(lambda *arrays: body([host_view(a) for a in arrays], []), list(out_shapes), *inputs, ordered=True))
    return calls.bind(body, inputs, out_shapes, in_place)


def outputs(queued: binding.Queued, grouped: bool) -> list[Any]:
    """Waits for every handle of a call; its results as a kernel's list of outputs."""
    result = queued.finish(binding.wait_all(queued.handles))
    return list(result) if grouped else [result]


def is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))
