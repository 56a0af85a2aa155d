"""Gradient compression for ``jax.Array`` s, by Horovod's names.

The compressors are hora's framework-neutral ones (``hora.compression``); only the cast
differs: ``astype`` on a jax.Array (or a tracer, so compression works inside ``jit``).
``Compression.fp16`` sends floating-point arrays as float16 and leaves other types (and
float16 itself) alone.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from hora import compression as neutral
from hora.compression import Compressor, NoneCompressor


class FP16Compressor(neutral.FP16Compressor):
    """Sends floating-point arrays as float16, halving their bytes; other types pass unchanged."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        if isinstance(tensor, np.ndarray):
            return neutral.FP16Compressor.compress(tensor)
        dtype = jnp.result_type(tensor)
        if not jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.float16:
            return tensor, None
        return tensor.astype(jnp.float16), dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        if ctx is None:
            return tensor
        return tensor.astype(ctx)


class Compression:
    """The compressors, by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor


def for_jax(compression: type[Compressor]) -> type[Compressor]:
    """Maps the neutral ``hora.compression.Compression.fp16`` to the JAX one."""
    return FP16Compressor if compression is neutral.FP16Compressor else compression


__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor", "for_jax"]
