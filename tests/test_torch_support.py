"""Shared helpers for the hora.torch tests (this module holds no tests).

Deterministic per-rank tensors, so every rank can compute every rank's input, and a
comparison that records problems instead of raising, so one job reports every case.
"""

from __future__ import annotations

import numpy as np
import torch

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
ALL = FLOATS + INTS + [torch.bool]


def setup_rank() -> None:
    """One thread per rank: the test machine has two cores and up to four ranks."""
    torch.set_num_threads(1)


def make(dtype: torch.dtype, rank: int, shape: tuple[int, ...], salt: int = 0, near_one: bool = False) -> torch.Tensor:
    """The input of ``rank`` for one case; small values so integer sums and products stay exact."""
    rng = np.random.default_rng(1000 * rank + salt)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size=shape).astype(bool))
    if dtype == torch.uint8:
        return torch.from_numpy(rng.integers(0, 4, size=shape).astype(np.uint8))
    if not dtype.is_floating_point:
        return torch.from_numpy(rng.integers(-3, 4, size=shape).astype(np.int64)).to(dtype)
    values = rng.uniform(0.5, 1.5, size=shape) if near_one else rng.normal(size=shape)
    return torch.from_numpy(np.asarray(values, dtype=np.float32)).to(dtype)


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-5}.get(dtype, 1e-12)


def wide(t: torch.Tensor) -> torch.Tensor:
    """Expectations are computed in float64, or exactly for integers and bools."""
    if t.dtype == torch.bool:
        return t
    return t.to(torch.float64) if t.dtype.is_floating_point else t.to(torch.int64)


def compare(case: str, got: object, want: torch.Tensor, dtype: torch.dtype, problems: list[str]) -> None:
    if not isinstance(got, torch.Tensor):
        problems.append(f"{case}: got a {type(got).__name__}, not a tensor")
        return
    if tuple(got.shape) != tuple(want.shape):
        problems.append(f"{case}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return
    if got.dtype != dtype:
        problems.append(f"{case}: dtype {got.dtype} != {dtype}")
        return
    if dtype.is_floating_point:
        tol = tolerance(dtype)
        ok = torch.allclose(got.to(torch.float64), want.to(torch.float64), rtol=tol, atol=tol)
    else:
        ok = torch.equal(got, want.to(dtype))
    if not ok:
        problems.append(f"{case}: got {got.reshape(-1)[:6].tolist()} want {want.reshape(-1)[:6].tolist()}")
