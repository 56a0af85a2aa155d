"""Gradient compression for torch tensors (the framework-neutral compressors, by Horovod's names)."""

from hora.compression import Compression, Compressor, FP16Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
