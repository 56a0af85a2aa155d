"""Gradient compression for TensorFlow tensors, by Horovod's names.

The compressors are hora's framework-neutral ones (``hora.compression``); only the
cast differs, since TensorFlow tensors have no ``astype``/``to``: ``tf.cast``.
``Compression.fp16`` sends floating-point tensors as float16 and leaves other types
(and float16 itself) alone.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf  # type: ignore[import-untyped]

from hora import compression as neutral
from hora.compression import Compressor, NoneCompressor


class FP16Compressor(neutral.FP16Compressor):
    """Sends floating-point tensors as float16, halving their bytes; other types pass unchanged."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        if not isinstance(tensor, (tf.Tensor, tf.Variable)):
            return neutral.FP16Compressor.compress(tensor)
        dtype = tensor.dtype
        if not dtype.is_floating or dtype == tf.float16:
            return tensor, None
        return tf.cast(tensor, tf.float16), dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        if ctx is None:
            return tensor
        if isinstance(tensor, (tf.Tensor, tf.Variable)):
            return tf.cast(tensor, ctx)
        return neutral.FP16Compressor.decompress(tensor, ctx)


class Compression:
    """The compressors, by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor


def for_tensorflow(compression: type[Compressor]) -> type[Compressor]:
    """Maps the neutral ``hora.compression.Compression.fp16`` to the TensorFlow one."""
    return FP16Compressor if compression is neutral.FP16Compressor else compression


__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor", "for_tensorflow"]
