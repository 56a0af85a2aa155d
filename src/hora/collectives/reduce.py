"""Data types, reduce operations and scaling on flat NumPy buffers.

Every function works in place on contiguous 1-D arrays with NumPy ufuncs, which
release the GIL, so reduction runs in parallel with the training thread.

bfloat16 travels as its 16 raw bits in a ``uint16`` array (NumPy has no bfloat16):
reduction widens both operands to float32, combines them, and rounds back to
nearest-even, which is what a bfloat16 ALU does.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import numpy as np

# Reduce ops: Horovod's constants and values.
AVERAGE = 0
SUM = 1
ADASUM = 2
MIN = 3
MAX = 4
PRODUCT = 5
OP_NAMES = {AVERAGE: "Average", SUM: "Sum", ADASUM: "Adasum", MIN: "Min", MAX: "Max", PRODUCT: "Product"}


class DataType(enum.IntEnum):
    """Wire codes of the element types hora moves: Horovod's values."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    INT32 = 4
    INT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BOOL = 9
    BFLOAT16 = 10

    @property
    def storage(self) -> np.dtype[np.generic]:
        """The NumPy dtype that holds this type's elements."""
        return _STORAGE[self]

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def is_float(self) -> bool:
        return self in (DataType.FLOAT16, DataType.FLOAT32, DataType.FLOAT64, DataType.BFLOAT16)


_STORAGE: dict[DataType, np.dtype[np.generic]] = {
    DataType.UINT8: np.dtype(np.uint8),
    DataType.INT8: np.dtype(np.int8),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.INT16: np.dtype(np.int16),
    DataType.INT32: np.dtype(np.int32),
    DataType.INT64: np.dtype(np.int64),
    DataType.FLOAT16: np.dtype(np.float16),
    DataType.FLOAT32: np.dtype(np.float32),
    DataType.FLOAT64: np.dtype(np.float64),
    DataType.BOOL: np.dtype(np.bool_),
    DataType.BFLOAT16: np.dtype(np.uint16),
}
_BY_NUMPY = {dtype: code for code, dtype in _STORAGE.items() if code != DataType.BFLOAT16}


def data_type_of(dtype: np.dtype[np.generic]) -> DataType:
    """Returns the wire code of a NumPy dtype (``ml_dtypes.bfloat16`` included).

    Raises:
        ValueError: hora does not move this type; the message lists what it moves.
    """
    code = _BY_NUMPY.get(dtype)
    if code is not None:
        return code
    if dtype.name == "bfloat16":  # ml_dtypes; checked second, ``dtype.name`` is slow
        return DataType.BFLOAT16
    supported = ", ".join(code.label for code in DataType)
    raise ValueError(f"Tensor type {dtype} is not supported (hora moves {supported}).")


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``b`` is ``a``'s memory, byte for byte: an output aliased to its input
    (inside ``jax.jit`` they come as two views, one read-only). Outputs are either that
    or disjoint from the inputs, never partly overlapping, so memory the two share is the
    same memory (``np.may_share_memory`` compares bounds in C; ``__array_interface__``
    builds a dictionary per call, 4 us, on every tensor's path)."""
    return a is b or (a.nbytes == b.nbytes and np.may_share_memory(a, b))


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widens bfloat16 bits (uint16) to float32 values, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray, out: np.ndarray) -> None:
    """Rounds float32 values to bfloat16 bits (nearest even) into ``out`` (uint16)."""
    bits = values.view(np.uint32)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    rounded = np.where(np.isnan(values), 0x7FC0, rounded)
    out[...] = rounded.astype(np.uint16)


class Reducer:
    """Combines buffers element-wise with one reduce op, in place or into an output.

    Args:
        ufunc: the NumPy ufunc of the op.
        bfloat16: the buffers hold bfloat16 bits in uint16.
    """

    def __init__(self, ufunc: np.ufunc, bfloat16: bool = False) -> None:
        self.ufunc = ufunc
        self.bfloat16 = bfloat16

    def __call__(self, target: np.ndarray, other: np.ndarray) -> None:
        """Folds ``other`` into ``target``."""
        self.into(target, other, target)

    def into(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """Writes ``a op b`` to ``out`` (which may be ``a``) in one pass."""
        if self.bfloat16:
            wide = bf16_to_f32(a)
            self.ufunc(wide, bf16_to_f32(b), out=wide)
            f32_to_bf16(wide, out)
        else:
            self.ufunc(a, b, out=out)


_UFUNCS = {AVERAGE: np.add, SUM: np.add, MIN: np.minimum, MAX: np.maximum, PRODUCT: np.multiply}
_BOOL_UFUNCS = {SUM: np.logical_or, MAX: np.logical_or, MIN: np.logical_and, PRODUCT: np.logical_and}


def reducer(op: int, dtype: DataType) -> Reducer:
    """Returns the ``Reducer`` for this op and type.

    Average reduces as Sum; the division is a postscale factor.

    Raises:
        ValueError: the op does not apply to the type (Average of bool) or is unknown.
    """
    if dtype == DataType.BOOL:
        if op not in _BOOL_UFUNCS:
            raise ValueError(f"{OP_NAMES.get(op, op)} is not defined for bool tensors (use Sum, Min, Max or Product)")
        return Reducer(_BOOL_UFUNCS[op])
    if op not in _UFUNCS:
        raise ValueError(f"unknown reduce op {op}")
    return Reducer(_UFUNCS[op], bfloat16=dtype == DataType.BFLOAT16)


def scale(buffer: np.ndarray, factor: float, dtype: DataType) -> None:
    """Multiplies a buffer by ``factor`` in place.

    Integers are scaled in float64 and truncated toward zero, as Horovod does;
    float16 and bfloat16 are scaled in float32.
    """
    if factor == 1.0 or buffer.size == 0:
        return
    if dtype == DataType.BFLOAT16:
        wide = bf16_to_f32(buffer)
        np.multiply(wide, np.float32(factor), out=wide)
        f32_to_bf16(wide, buffer)
    elif dtype == DataType.FLOAT16:
        buffer[...] = (buffer.astype(np.float32) * np.float32(factor)).astype(np.float16)
    elif dtype.is_float:
        np.multiply(buffer, factor, out=buffer)
    elif dtype == DataType.BOOL:
        raise ValueError("bool tensors cannot be scaled (prescale, postscale and Average need numbers)")
    else:
        buffer[...] = np.trunc(buffer * factor)
