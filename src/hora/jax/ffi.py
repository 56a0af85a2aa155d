"""hora's collectives inside ``jax.jit`` as XLA FFI custom calls, handled in Python.

A collective inside a compiled program has to reach hora on the host. JAX's host
callbacks (``io_callback``) get there by copying: XLA copies every input out into a new
NumPy array, ``io_callback`` puts it through ``jax.device_put`` (a second, unaligned
copy), and XLA copies the callback's result into the program's buffer. On these 2-core
machines that cost 150 ms around a 64 MiB allreduce whose own work is 27 ms.

An XLA FFI custom call hands its handler the program's buffers themselves. The
handler here is a Python function made callable from C by ``ctypes``; it reads the FFI
call frame (``xla/ffi/api/c_api.h``, API 0.3: the structures below mirror it), views
the input buffers as read-only NumPy arrays and the result buffers as writable ones,
and runs the collective's *body*, which reads the inputs in place and writes its
results into the program's buffers (allreduce and broadcast: the engine writes them
there directly; the others copy their results in once).

In place. An allreduce's or a broadcast's results are declared aliases of its inputs
(``operand_output_aliases``): XLA then gives the result the buffer of an input the
program no longer needs (a step's gradients: mapped and warm) rather than a fresh one
per call, which the engine would fault in page by page as it writes; an input the
program still reads XLA copies first. The handler sees the two as a read-only and a
writable view of the same memory (``hora.collectives.reduce.same_memory``).

Ordering. The call takes and returns JAX's ordering token for ``io_callback(ordered=
True)`` (``jax._src.callback._OrderedIOEffect``), so hora's calls run in program order,
one at a time, among themselves and among the program's ordered ``io_callback`` s,
exactly like ordered callbacks (``hora.jax.bridge`` says why that is needed).

Errors. An exception in the body becomes an FFI error (``XLA_FFI_Error_Create`` from the
API table XLA passes in), which the caller receives as ``jax.errors.JaxRuntimeError``
with the exception's type and message; nothing escapes the C boundary silently.

What it rests on. The FFI's C structures are a versioned, stable ABI; registering a
handler (``jax.ffi.register_ffi_target``, ``jax.ffi.pycapsule``) is public JAX API. The
ordering effect and ``mlir.custom_call`` are JAX internals: ``HostCalls.create``
returns None where any of it is missing, and ``hora.jax.bridge`` then falls back to
``io_callback`` (the same semantics, with the copies).

Bodies are kept by id for as long as the process lives (one per traced collective:
a program that is traced once keeps one per collective in it).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# (inputs viewed read-only, outputs to write) -> the results; a result that is not
# (a view of) its output is copied into it.
Body = Callable[[list[np.ndarray], list[np.ndarray]], list[np.ndarray]]

TARGET = "hora_jax_collective"
API_MAJOR, API_MINOR = 0, 3  # the FFI API these structures follow (c_api.h)
EXTENSION_METADATA = 1  # XLA_FFI_Extension_Metadata: XLA asks the handler's API version
STAGE_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE; the earlier stages have nothing to do
ERROR_UNKNOWN = 2  # XLA_FFI_Error_Code_UNKNOWN
TOKEN = 17  # XLA_FFI_DataType_TOKEN: the ordering token, not data

# XLA_FFI_DataType -> NumPy dtype, for every dtype hora moves.
DTYPES: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.bool_),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.uint8),
    7: np.dtype(np.uint16),
    8: np.dtype(np.uint32),
    9: np.dtype(np.uint64),
    10: np.dtype(np.float16),
    11: np.dtype(np.float32),
    12: np.dtype(np.float64),
    16: np.dtype(jnp.bfloat16),
}


class _ExtensionBase(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int), ("next", ctypes.c_void_p)]


class _ApiVersion(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("major_version", ctypes.c_int),
        ("minor_version", ctypes.c_int),
    ]


class _Metadata(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("api_version", _ApiVersion),
        ("traits", ctypes.c_uint32),
        ("state_type_id", ctypes.c_int64),
    ]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", _ExtensionBase), ("metadata", ctypes.POINTER(_Metadata))]


class _Values(ctypes.Structure):
    """XLA_FFI_Args and XLA_FFI_Rets (the same layout)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),
        ("values", ctypes.POINTER(ctypes.c_void_p)),
    ]


class _Attrs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),
        ("names", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(ctypes.c_void_p)),
    ]


class _CallFrame(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(_ExtensionBase)),
        ("api", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("stage", ctypes.c_int),
        ("args", _Values),
        ("rets", _Values),
        ("attrs", _Attrs),
        ("future", ctypes.c_void_p),
    ]


class _Buffer(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("dims", ctypes.POINTER(ctypes.c_int64)),
    ]


class _Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", ctypes.c_void_p)]


class _ApiHead(ctypes.Structure):
    """The start of XLA_FFI_Api, up to the one function used here."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("api_version", _ApiVersion),
        ("internal_api", ctypes.c_void_p),
        ("error_create", ctypes.c_void_p),
    ]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("message", ctypes.c_char_p),
        ("errc", ctypes.c_int),
    ]


_ErrorCreate = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_ErrorCreateArgs))
_Handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))


class _Interface:
    """Presents a raw buffer to NumPy through the array interface protocol (a few
    microseconds per array, where a ctypes array type made per buffer costs ~12)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, data: int, shape: tuple[int, ...], typestr: str, writable: bool) -> None:
        self.__array_interface__ = {"data": (data, not writable), "shape": shape, "typestr": typestr, "version": 3}


def _view(address: int, writable: bool) -> np.ndarray | None:
    """A NumPy array over an XLA_FFI_Buffer's data; None for the ordering token."""
    buffer = _Buffer.from_address(address)
    if buffer.dtype == TOKEN:
        return None
    dtype = DTYPES.get(buffer.dtype)
    if dtype is None:  # hora's checks refuse other dtypes when tracing: never reached
        raise TypeError(f"XLA dtype {buffer.dtype} is not one hora moves")
    shape = tuple(buffer.dims[i] for i in range(buffer.rank))
    if 0 in shape:
        return np.empty(shape, dtype)
    # NumPy's interface knows no bfloat16: present the bytes as unsigned integers of the
    # same width, then view them as the real type.
    raw = np.asarray(_Interface(buffer.data, shape, f"<u{dtype.itemsize}", writable))
    return raw if dtype == raw.dtype else raw.view(dtype)


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


class HostCalls:
    """The registered FFI target, its primitive, and the bodies its calls run."""

    def __init__(self, primitive: Any) -> None:
        self._primitive = primitive
        # The C function pointer XLA calls: it must outlive every program that uses it.
        self.handler = _Handler(self.handle)
        self._bodies: dict[int, Body] = {}
        self._ids = itertools.count()

    @classmethod
    @functools.cache
    def create(cls) -> HostCalls | None:
        """Registers the target and the primitive with JAX, once per process; None where
        this JAX lacks what they need (see the module)."""
        try:
            from jax._src import callback as jax_callback
            from jax._src import dispatch
            from jax._src.interpreters import mlir as mlir_internal
            from jax._src.lib.mlir import ir  # type: ignore[attr-defined]
            from jax._src.lib.mlir.dialects import hlo  # type: ignore[attr-defined]
            from jax.extend.core import Primitive
            from jax.interpreters import mlir

            effect = jax_callback._OrderedIOEffect
            custom_call = mlir_internal.custom_call
        except (ImportError, AttributeError):
            return None

        primitive = Primitive("hora_collective")
        primitive.multiple_results = True

        def abstract(*avals: Any, body: int, out_avals: tuple[Any, ...], in_place: bool) -> tuple[list[Any], set[Any]]:
            return list(out_avals), {effect}

        def lower(ctx: Any, *operands: Any, body: int, out_avals: tuple[Any, ...], in_place: bool) -> list[Any]:
            token = ctx.tokens_in.get(effect)
            types = [hlo.TokenType.get(), *[mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out]]
            op = custom_call(
                TARGET,
                result_types=types,
                operands=[token, *operands],
                backend_config={"body": ir.IntegerAttr.get(ir.IntegerType.get_signless(64), body)},
                has_side_effect=True,
                api_version=4,  # the typed FFI
                # Operand i + 1 and result i + 1 (0 is the token) share a buffer.
                operand_output_aliases={i: i for i in range(1, len(operands) + 1)} if in_place else None,
            )
            results = list(op.results)
            ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({effect: results[0]})))
            return results[1:]

        primitive.def_effectful_abstract_eval(abstract)  # type: ignore[no-untyped-call]
        primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))  # type: ignore[no-untyped-call]
        mlir.register_lowering(primitive, lower, cacheable=False)
        calls = cls(primitive)  # before registering: XLA calls the handler at once (the version query)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(calls.handler), platform="cpu")  # type: ignore[no-untyped-call]
        return calls

    def bind(
        self, body: Body, inputs: Sequence[Any], out_shapes: Sequence[jax.ShapeDtypeStruct], in_place: bool = False
    ) -> list[Any]:
        """``body`` as one ordered call of the program being traced; its outputs (tracers).

        Args:
            in_place: each output has its input's shape and type, and XLA may hand the
                body an input's buffer as that output's (see the module).
        """
        ident = next(self._ids)
        self._bodies[ident] = body
        avals = tuple(jax.core.ShapedArray(tuple(s.shape), s.dtype) for s in out_shapes)
        return list(self._primitive.bind(*inputs, body=ident, out_avals=avals, in_place=in_place))

    def handle(self, frame_pointer: Any) -> int | None:
        """The FFI handler: answers XLA's version query, runs a body when executed.

        Returns:
            None (success) or an ``XLA_FFI_Error*`` carrying the body's exception.
        """
        try:
            frame = frame_pointer.contents
            if frame.extension_start and frame.extension_start.contents.type == EXTENSION_METADATA:
                extension = ctypes.cast(frame.extension_start, ctypes.POINTER(_MetadataExtension)).contents
                metadata = extension.metadata.contents
                metadata.api_version.major_version = API_MAJOR
                metadata.api_version.minor_version = API_MINOR
                metadata.traits = 0
                return None
            if frame.stage != STAGE_EXECUTE:
                return None
            scalar = _Scalar.from_address(frame.attrs.attrs[0])
            body = self._bodies[ctypes.c_int64.from_address(scalar.value).value]
            inputs = [_view(frame.args.values[i], False) for i in range(frame.args.size)]
            outputs = [_view(frame.rets.values[i], True) for i in range(frame.rets.size)]
            targets = [o for o in outputs if o is not None]
            results = body([a for a in inputs if a is not None], targets)
            for result, target in zip(results, targets, strict=True):
                if target.size and _address(np.asarray(result)) != _address(target):
                    np.copyto(target, np.asarray(result).reshape(target.shape))
            return None
        except BaseException as exc:  # noqa: BLE001 - handed to XLA: nothing may cross the C boundary
            return self._error(frame_pointer.contents, f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _error(frame: Any, message: str) -> int | None:
        create = _ErrorCreate(_ApiHead.from_address(frame.api).error_create)
        args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None, message.encode(errors="replace"), ERROR_UNKNOWN)
        result: int | None = create(ctypes.byref(args))
        return result
