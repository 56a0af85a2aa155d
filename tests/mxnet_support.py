"""What the MXNet tests share: inputs by rank, expected results, comparisons, memory addresses.

Imported by tests/test_mxnet*.py and by their ranks, only in MXNet's environment
(.venv-mxnet): ``import hora.mxnet`` comes first, so mxnet imports under NumPy 1.24+.
"""

from __future__ import annotations

import ctypes

import hora.mxnet  # noqa: F401  (first: restores the NumPy aliases mxnet reads)

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8", "int8", "bool"]
OPS = ["Sum", "Average", "Min", "Max", "Product"]


def make(dtype: str, rank: int, shape: tuple[int, ...], salt: int = 0) -> np.ndarray:
    """The input of ``rank`` for one case; small values so sums and products stay exact in every dtype."""
    rng = np.random.default_rng(1000 * rank + salt)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype in ("float16", "float32", "float64"):
        return rng.uniform(-2, 2, size=shape).astype(dtype)
    return rng.integers(0, 3, size=shape).astype(dtype)  # 0..2: products of 3 ranks fit in int8/uint8


def reduce_expected(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """What a reduction of the ranks' inputs gives, computed wide and cast back like hora's."""
    dtype = inputs[0].dtype
    if dtype == bool:
        stacked = np.stack(inputs)
        return {"Sum": stacked.any(0), "Max": stacked.any(0), "Min": stacked.all(0), "Product": stacked.all(0)}[op]
    wide = np.stack([x.astype(np.float64) for x in inputs])
    result = {
        "Sum": lambda: wide.sum(0),
        "Average": lambda: wide.sum(0) / len(inputs),
        "Min": lambda: wide.min(0),
        "Max": lambda: wide.max(0),
        "Product": lambda: wide.prod(0),
    }[op]()
    if dtype.kind in "iu":
        result = np.trunc(result)
    return result.astype(dtype)


def close(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal for integers and bools; within the dtype's rounding for floats."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if want.dtype.kind == "f":
        tol = 1e-2 if want.dtype == np.float16 else 1e-5
        return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol))
    return bool(np.array_equal(got, want))


def check(case: str, got: object, want: np.ndarray, problems: list[str]) -> None:
    """Appends a line to ``problems`` unless ``got`` is a CPU NDArray equal to ``want``."""
    if not isinstance(got, mx.nd.NDArray):
        problems.append(f"{case}: got a {type(got).__name__}, not an NDArray")
        return
    if got.context != mx.cpu():
        problems.append(f"{case}: the result is on {got.context}")
    values = got.asnumpy()
    if not close(values, want):
        problems.append(f"{case}: got {values.dtype}{values.shape} {values.ravel()[:6]}, want {want.dtype}{want.shape} {want.ravel()[:6]}")


def address(array: mx.nd.NDArray) -> int:
    """The address of an NDArray's memory (its first element)."""
    from mxnet.base import _LIB, check_call

    pointer = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(pointer)))
    return int(pointer.value or 0)
