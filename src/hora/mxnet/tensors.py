"""MXNet NDArrays as hora moves them: zero-copy views of CPU memory, MXNet's engine waited on.

Staging (measured by benchmarks/mxnet_staging.py on MXNet 1.9.1, NumPy 1.26, a 100 MB
float32 array, 2-core AMD EPYC; docs/mxnet.md):

* ``asnumpy()`` copies (17-21 ms), and writing a result back with ``nd[:] = array``
  copies again (11-12 ms).
* DLPack (``to_dlpack_for_read``/``_for_write`` into ``np.from_dlpack``) is zero-copy,
  but NumPy 1.26 makes every DLPack array read-only, so the in-place collectives could
  not write through it, and bool arrays fail.
* A view of the NDArray's own memory (``MXNDArrayGetData``, the pointer MXNet's C API
  gives, wrapped by ``np.frombuffer``) is zero-copy both ways, takes 25-50 us with the
  engine wait whatever the size, and covers every dtype. hora uses it: the collectives
  read the NDArray's memory where it is, and the in-place ones write their result into it.
* Results of a new shape (allgather, alltoall, reducescatter) come back from the core as
  NumPy arrays; ``mx.nd.from_numpy(zero_copy=True)`` makes them NDArrays without a
  copy (int8 arrays, which it refuses, are copied once).

MXNet's engine is asynchronous: an NDArray may still be waiting to be written by
operations pushed before the collective. So a view for reading is taken after
``wait_to_read()`` (every pending write done), and a view for writing after
``MXNDArrayWaitToWrite`` (every pending read and write done). The collectives of
``hora.mxnet`` finish before they return, so every MXNet operation pushed afterwards
sees their results. A view holds a reference to its NDArray, so the memory stays
alive while the engine thread uses it.

NDArrays on another context (a GPU) are copied to the CPU when the collective is
submitted and back when it is done; sparse NDArrays (``row_sparse``, ``csr``) are refused.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call

from hora.collectives.reduce import DataType
from hora.core import ops

# The dtypes Horovod's MXNet binding moves, and bool (MXNet 1.9 has it).
_WIRE: dict[np.dtype[Any], DataType] = {
    np.dtype(np.float16): DataType.FLOAT16,
    np.dtype(np.float32): DataType.FLOAT32,
    np.dtype(np.float64): DataType.FLOAT64,
    np.dtype(np.uint8): DataType.UINT8,
    np.dtype(np.int8): DataType.INT8,
    np.dtype(np.int32): DataType.INT32,
    np.dtype(np.int64): DataType.INT64,
    np.dtype(np.bool_): DataType.BOOL,
}

# What mx.nd.from_numpy(zero_copy=True) accepts (its DLPack type map); others are copied.
_ZERO_COPY_WRAP = {np.dtype(name) for name in ("float16", "float32", "float64", "uint8", "int32", "int64", "bool")}

_CPU = mx.cpu()


def wire_type(array: mx.nd.NDArray, what: str) -> DataType:
    """The core's type code for the NDArray's dtype.

    Raises:
        ValueError: the dtype is not one hora moves (the message lists those it does).
    """
    code = _WIRE.get(np.dtype(array.dtype))
    if code is None:
        supported = ", ".join(str(d) for d in _WIRE)
        raise ValueError(f"{what}: NDArray type {np.dtype(array.dtype)} is not supported; hora moves {supported}")
    return code


def numpy_view(array: mx.nd.NDArray, *, writable: bool) -> np.ndarray:
    """A flat NumPy view of a CPU NDArray's memory, once MXNet's engine is done with it; no copy.

    Args:
        array: a dense NDArray on the CPU (MXNet's NDArrays are contiguous, slices too).
        writable: the caller will write through the view: waits for every pending read
            and write of the array; otherwise for every pending write only, and the view
            is read-only.
    """
    if writable:
        check_call(_LIB.MXNDArrayWaitToWrite(array.handle))
    else:
        array.wait_to_read()
    dtype = np.dtype(array.dtype)
    count = int(np.prod(array.shape, dtype=np.int64))
    if count == 0:
        return np.empty(0, dtype=dtype)
    pointer = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(pointer)))
    if not pointer.value:
        raise ValueError("an NDArray without memory cannot take part in a collective")
    memory = (ctypes.c_char * (count * dtype.itemsize)).from_address(pointer.value)
    memory._owner = array  # the view keeps the NDArray (its memory) alive
    view = np.frombuffer(memory, dtype=dtype)
    if not writable:
        view.flags.writeable = False
    return view


@dataclasses.dataclass
class Staged:
    """An NDArray prepared for a collective.

    Attributes:
        tensor: the caller's NDArray.
        host: the CPU NDArray the collective reads (and the in-place ones write): the
            caller's own NDArray on the CPU, a copy of it on another context.
        wire: the flat NumPy view of ``host`` the core moves.
    """

    tensor: mx.nd.NDArray
    host: mx.nd.NDArray
    wire: ops.Tensor

    @property
    def copied(self) -> bool:
        """True when ``host`` is a copy (an NDArray on another context), not the NDArray itself."""
        return self.host is not self.tensor


def stage(tensor: Any, *, writable: bool, what: str) -> Staged:
    """Prepares an NDArray for a collective (see the module for the waits).

    Args:
        tensor: the caller's NDArray.
        writable: the collective writes its result into it (the ``_`` functions).
        what: the operation and tensor, for messages.

    Raises:
        ValueError: not an NDArray, a sparse one, or an unsupported dtype.
    """
    if not isinstance(tensor, mx.nd.NDArray):
        raise ValueError(f"{what} needs an mxnet NDArray; got {type(tensor).__name__}")
    if tensor.stype != "default":
        raise ValueError(f"{what}: {tensor.stype} NDArrays are not supported; pass a dense one (tostype('default'))")
    code = wire_type(tensor, what)
    host = tensor if tensor.context.device_type == "cpu" else tensor.copyto(_CPU)
    view = numpy_view(host, writable=writable)
    return Staged(tensor, host, ops.Tensor(view, tuple(int(d) for d in tensor.shape), code))


def write_back(staged: Staged) -> mx.nd.NDArray:
    """Completes an in-place collective: copies a staged result back to the NDArray's context."""
    if staged.copied:
        staged.host.copyto(staged.tensor)
    return staged.tensor


def to_context(result: mx.nd.NDArray, like: mx.nd.NDArray) -> mx.nd.NDArray:
    """Moves a CPU result to the context of ``like`` (nothing to do for CPU NDArrays)."""
    return result if like.context.device_type == "cpu" else result.as_in_context(like.context)


def from_numpy(array: np.ndarray) -> mx.nd.NDArray:
    """A result array from the core as a CPU NDArray: zero-copy where MXNet allows, else one copy."""
    if array.dtype in _ZERO_COPY_WRAP and array.flags.c_contiguous:
        return mx.nd.from_numpy(array, zero_copy=True)  # marks ``array`` read-only: the NDArray owns it now
    return mx.nd.array(array, dtype=array.dtype, ctx=_CPU)


class MXNetAdapter:
    """MXNet NDArrays as the core moves them (``binding.Adapter``)."""

    def stage(self, tensor: mx.nd.NDArray, writable: bool, what: str) -> tuple[ops.Tensor, Callable[[], Any]]:
        staged = stage(tensor, writable=writable, what=what)
        return staged.wire, lambda: write_back(staged)

    def output(self, tensor: mx.nd.NDArray, wire: ops.Tensor) -> tuple[np.ndarray, Callable[[], Any]]:
        # Written by the core in place: a new NDArray's memory, no copy afterwards.
        output = mx.nd.empty(wire.shape, ctx=_CPU, dtype=tensor.dtype)
        return numpy_view(output, writable=True), lambda: to_context(output, tensor)

    def wrap(self, array: np.ndarray, like: mx.nd.NDArray) -> mx.nd.NDArray:
        return to_context(from_numpy(array), like)

    def splits(self, splits: Any) -> Sequence[int] | None:
        if splits is None:
            return None
        if isinstance(splits, mx.nd.NDArray):
            if np.dtype(splits.dtype) != np.int32:  # as Horovod: splits of 32-bit integers
                raise ValueError(
                    f"alltoall: splits must be an int32 NDArray or a list of ints; got a {np.dtype(splits.dtype)} NDArray"
                )
            return [int(s) for s in splits.asnumpy().reshape(-1)]
        return list(splits)  # ops checks they are integers

    def alltoall_result(self, output: mx.nd.NDArray, received: np.ndarray, splits_given: bool) -> Any:
        if not splits_given:
            return output
        return output, mx.nd.array(received, dtype=np.int32, ctx=_CPU)  # Horovod: an int32 NDArray on the CPU


ADAPTER = MXNetAdapter()
