"""Gradient compression for MXNet NDArrays: ``Compression.none`` and ``Compression.fp16``, by Horovod's names.

The interface is the framework-neutral one (``hora.compression.Compressor``); only the
casts are MXNet's (``astype``), and, as in Horovod, ``fp16`` casts floating-point
NDArrays only (float16 ones pass as they are) and restores their dtype afterwards.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hora.compression import Compressor, NoneCompressor


def _is_float(dtype: Any) -> bool:
    return bool(np.dtype(dtype).kind == "f")


class FP16Compressor(Compressor):
    """Sends floating-point NDArrays as float16, halving their bytes; other types pass unchanged."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        if not _is_float(tensor.dtype):
            return tensor, None
        return tensor.astype("float16", copy=False), tensor.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else tensor.astype(ctx, copy=False)


class Compression:
    """The compressors, by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor


__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
