"""Recursive doubling: the allreduce for small buffers across hosts.

The ring takes ``2(n-1)`` steps whatever the size, each paying a link's latency and a
pass through hora's transfer loop; for a buffer of a few kilobytes those latencies are
the whole cost. Recursive doubling takes ``ceil(log2 n)`` steps (two more when ``n`` is
not a power of two), each exchanging the whole buffer with one partner, so it sends
more bytes per rank (``S`` per step instead of ``S/n``) in far fewer steps: cheaper up
to the size where the bytes start to dominate (see ``docs/scaling.md``).

Steps, with ``p`` the largest power of two not above ``n`` and ``extra = n - p``:

1. fold: among the first ``2 * extra`` ranks, each odd rank sends its buffer to the
   even rank below it, which reduces it in; the odd ranks then wait for step 3;
2. double: the ``p`` remaining ranks (virtual ranks ``0 .. p-1``) exchange their whole
   buffer with the partner whose virtual rank differs in bit ``k``, for ``k = 0, 1, ...``,
   each reducing what it received into its buffer;
3. unfold: each even rank of step 1 sends the result to its odd rank.

Every rank ends with the same bits: at each doubling step the two partners hold the
reduction of their halves (the same value on every member of a half, by induction) and
compute ``a op b`` and ``b op a``, which IEEE arithmetic (and min, max, logical ops)
makes identical, so ranks never disagree by a rounding.
"""

from __future__ import annotations

import numpy as np

from hora.collectives.channel import Channel
from hora.collectives.reduce import Reducer


def allreduce(channel: Channel, buffer: np.ndarray, reduce: Reducer, scratch: np.ndarray | None = None) -> None:
    """Reduces ``buffer`` in place across the channel's ranks by recursive doubling.

    Args:
        channel: the ranks taking part.
        buffer: this rank's contribution; every rank's result on return.
        reduce: folds its second argument into its first; must be commutative (every
            reduce op hora has is).
        scratch: a buffer of at least ``buffer.size`` elements of its dtype, reused for
            receiving.
    """
    n, rank = channel.size, channel.rank
    if n == 1 or buffer.size == 0:
        return
    if scratch is None or scratch.size < buffer.size:
        scratch = np.empty(buffer.size, dtype=buffer.dtype)
    incoming = scratch[: buffer.size]
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    if rank < 2 * extra:
        if rank % 2:  # folded into rank - 1; receives the result at the end
            channel.exchange([(rank - 1, buffer)], [])
            channel.exchange([], [(rank - 1, buffer)])
            return
        channel.exchange([], [(rank + 1, incoming)])
        reduce(buffer, incoming)
        virtual = rank // 2
    else:
        virtual = rank - extra
    mask = 1
    while mask < p:
        partner_virtual = virtual ^ mask
        partner = 2 * partner_virtual if partner_virtual < extra else partner_virtual + extra
        channel.exchange([(partner, buffer)], [(partner, incoming)])
        reduce(buffer, incoming)
        mask <<= 1
    if rank < 2 * extra:
        channel.exchange([(rank + 1, buffer)], [])
