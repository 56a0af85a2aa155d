"""Gradient compression applied around allreduce: ``Compression.none`` and ``Compression.fp16``.

A compressor's ``compress(tensor)`` returns the tensor to send and a context;
``decompress(tensor, ctx)`` turns the result back. They work on NumPy arrays and on
framework tensors that offer ``dtype`` and ``to``/``astype`` conversions, so every
binding shares them.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _is_float(tensor: Any) -> bool:
    dtype = tensor.dtype
    if isinstance(dtype, np.dtype):
        return dtype.kind == "f" or dtype.name == "bfloat16"
    return bool(getattr(dtype, "is_floating_point", False))


def _is_half(tensor: Any) -> bool:
    return str(tensor.dtype) in ("float16", "torch.float16")


def _to_half(tensor: Any) -> Any:
    return tensor.astype(np.float16) if isinstance(tensor, np.ndarray) else tensor.half()


def _cast(tensor: Any, dtype: Any) -> Any:
    return tensor.astype(dtype) if isinstance(tensor, np.ndarray) else tensor.to(dtype)


class Compressor:
    """Interface: compress before the collective, decompress after."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16, halving their bytes; other types pass unchanged."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        if not _is_float(tensor) or _is_half(tensor):
            return tensor, None
        return _to_half(tensor), tensor.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else _cast(tensor, ctx)


class Compression:
    """The compressors, by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor
