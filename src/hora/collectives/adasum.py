"""Adasum: adaptive summation of gradients (Maleki et al., 2020), as Horovod computes it.

Two gradients ``a`` and ``b`` combine as

    a' = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 when its vector's squared norm is below the square root of the
smallest normal double, Horovod's bound, so tiny gradients still combine): orthogonal vectors
add, parallel ones average. Ranks combine pairwise at distances 1, 2, 4, ... (recursive
doubling), so the result is the same binary tree of combinations Horovod computes, on
every rank: ``((r0 + r1) + (r2 + r3))``. Each tensor of a fused buffer combines on its
own (its own dot products). The number of ranks must be a power of two.

This version exchanges whole vectors at each level (``log2(n)`` times the data per rank),
which keeps every dot product local and exact; it is meant for CPU jobs of modest size.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from hora.collectives.channel import Channel

# Horovod's sqrt(DBL_MIN): below it a squared norm is as good as zero. (A larger bound,
# such as 1e-8, sums gradients whose norm is below 1e-4 instead of combining them.)
NORM_EPSILON = math.sqrt(sys.float_info.min)


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Returns the Adasum combination of two same-shaped float vectors (computed in float64)."""
    wide_a = a.astype(np.float64, copy=False)
    wide_b = b.astype(np.float64, copy=False)
    dot = float(np.dot(wide_a, wide_b))
    norm_a = float(np.dot(wide_a, wide_a))
    norm_b = float(np.dot(wide_b, wide_b))
    coeff_a = 1.0 - dot / (2.0 * norm_a) if norm_a >= NORM_EPSILON else 1.0
    coeff_b = 1.0 - dot / (2.0 * norm_b) if norm_b >= NORM_EPSILON else 1.0
    return coeff_a * wide_a + coeff_b * wide_b


def allreduce(channel: Channel, buffer: np.ndarray, tensors: list[tuple[int, int]]) -> None:
    """Adasum-reduces ``buffer`` in place across a power-of-two number of ranks.

    Args:
        channel: the ranks taking part; ``channel.size`` must be a power of two.
        buffer: float elements, one or more tensors laid end to end.
        tensors: (offset, length) of each tensor in ``buffer``.

    Raises:
        ValueError: the number of ranks is not a power of two.
    """
    n, rank = channel.size, channel.rank
    if n & (n - 1):
        raise ValueError(f"Adasum needs a power-of-two number of ranks; this process set has {n}")
    incoming = np.empty_like(buffer)
    distance = 1
    while distance < n:
        partner = rank ^ distance
        channel.exchange([(partner, buffer)], [(partner, incoming)])
        # Both partners must compute the same thing: the lower rank's vector is always ``a``.
        lower, upper = (buffer, incoming) if rank < partner else (incoming, buffer)
        for offset, length in tensors:
            part = slice(offset, offset + length)
            buffer[part] = combine(lower[part], upper[part]).astype(buffer.dtype, copy=False)
        distance *= 2
