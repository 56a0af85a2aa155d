"""Recursive halving and doubling (Rabenseifner's allreduce): the ring's bytes in log steps.

The ring (``ring.allreduce``) sends ``2(n-1)/n`` of the buffer per rank in ``2(n-1)``
steps; recursive doubling (``doubling.allreduce``) takes ``log2 n`` steps but sends the
whole buffer in each. Between the two sizes where each is best (a few tens of kilobytes
up to the megabytes where the pipelined ring takes over), each of the ring's steps pays a
link's latency and a pass through hora's transfer loop while moving only ``S/n``. This
algorithm sends the ring's bytes in ``2 log2 n`` steps, for ``n`` a power of two:

1. reduce-scatter by recursive halving: for ``mask = n/2, n/4, ..., 1`` each rank splits
   the range it holds in two halves, keeps the lower one if its bit ``mask`` is clear
   (the upper one if set), sends the other half to ``rank ^ mask`` and reduces the
   partner's copy of its own half into it. The partner holds the same range (the two
   ranks agree on every bit above ``mask``, which chose the range), so each step halves
   what both send. At the end each rank holds one ``S/n`` block, fully reduced;
2. allgather by recursive doubling, the same steps in reverse: each rank sends the range
   it holds to ``rank ^ mask`` and receives the sibling half into place, for ``mask = 1,
   2, ..., n/2``.

Every rank ends with the same bits: each element's partial sums are computed by one rank
(the one that kept that half), and the allgather only copies.
"""

from __future__ import annotations

import numpy as np

from hora.collectives.channel import Channel
from hora.collectives.reduce import Reducer


def applies(size: int) -> bool:
    """Whether the algorithm runs on ``size`` ranks: a power of two, 2 or more."""
    return size >= 2 and size & (size - 1) == 0


def allreduce(channel: Channel, buffer: np.ndarray, reduce: Reducer, scratch: np.ndarray | None = None) -> None:
    """Reduces ``buffer`` in place across the channel's ranks by recursive halving and doubling.

    Args:
        channel: the ranks taking part; their number must be a power of two.
        buffer: this rank's contribution; every rank's result on return.
        reduce: folds its second argument into its first.
        scratch: a buffer of at least ``(buffer.size + 1) // 2`` elements of its dtype,
            reused for receiving.

    Raises:
        ValueError: the channel's size is not a power of two.
    """
    n, rank = channel.size, channel.rank
    if n == 1:
        return
    if not applies(n):
        raise ValueError(f"recursive halving needs a power-of-two number of ranks, not {n}")
    half_size = (buffer.size + 1) // 2
    if scratch is None or scratch.size < half_size:
        scratch = np.empty(half_size, dtype=buffer.dtype)
    lo, hi = 0, buffer.size
    splits: list[tuple[int, int, int]] = []  # (lo, mid, hi) of each halving step, outermost first
    mask = n >> 1
    while mask:
        partner = rank ^ mask
        mid = lo + (hi - lo) // 2
        splits.append((lo, mid, hi))
        keep, give = ((lo, mid), (mid, hi)) if rank & mask == 0 else ((mid, hi), (lo, mid))
        incoming = scratch[: keep[1] - keep[0]]
        channel.exchange([(partner, buffer[give[0] : give[1]])], [(partner, incoming)])
        if incoming.size:
            reduce(buffer[keep[0] : keep[1]], incoming)
        lo, hi = keep
        mask >>= 1
    mask = 1
    for parent_lo, mid, parent_hi in reversed(splits):
        partner = rank ^ mask
        sibling = (mid, parent_hi) if rank & mask == 0 else (parent_lo, mid)
        channel.exchange([(partner, buffer[lo:hi])], [(partner, buffer[sibling[0] : sibling[1]])])
        lo, hi = parent_lo, parent_hi
        mask <<= 1
