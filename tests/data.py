"""Deterministic per-rank test data, so every rank can compute every rank's input."""

from __future__ import annotations

import numpy as np

try:
    import ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    BFLOAT16 = None

FLOATS = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)] + ([BFLOAT16] if BFLOAT16 else [])
INTS = [np.dtype(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64)]
ALL = FLOATS + INTS + [np.dtype(np.bool_)]


def make(dtype: np.dtype, rank: int, shape: tuple[int, ...], salt: int = 0, near_one: bool = False) -> np.ndarray:
    """The input of ``rank`` for one case; small values so sums and products stay exact for ints."""
    rng = np.random.default_rng(1000 * rank + salt)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind == "u":
        return rng.integers(0, 4, size=shape).astype(dtype)
    if dtype.kind == "i":
        return rng.integers(-3, 4, size=shape).astype(dtype)
    values = rng.uniform(0.5, 1.5, size=shape) if near_one else rng.normal(size=shape)
    return values.astype(np.float32).astype(dtype)


def tolerance(dtype: np.dtype) -> float:
    if dtype == np.float16:
        return 1e-2
    if BFLOAT16 is not None and dtype == BFLOAT16:
        return 3e-2
    if dtype == np.float32:
        return 1e-5
    return 1e-12
