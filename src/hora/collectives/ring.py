"""Ring algorithms: reduce-scatter, allgather and allreduce (reduce-scatter + allgather).

With ``n`` ranks each rank sends and receives ``(n-1)/n`` of the buffer in each
phase, whatever ``n`` is, so the bandwidth each rank needs stays flat as ranks grow.

Segments: the buffer is cut into ``n`` contiguous segments, ``bounds[i] = (offset,
length)``; segments may be empty or uneven. Reduce-scatter leaves segment ``r`` fully
reduced on rank ``r``; allgather starts from segment ``r`` on rank ``r`` and ends with
every segment everywhere.
"""

from __future__ import annotations

import numpy as np

from hora.collectives.channel import Channel
from hora.collectives.reduce import Reducer

Bounds = list[tuple[int, int]]


def even_bounds(count: int, parts: int) -> Bounds:
    """Splits ``count`` elements into ``parts`` contiguous segments differing by at most one."""
    base, extra = divmod(count, parts)
    bounds = []
    offset = 0
    for part in range(parts):
        length = base + (1 if part < extra else 0)
        bounds.append((offset, length))
        offset += length
    return bounds


def bounds_from_lengths(lengths: list[int]) -> Bounds:
    """Turns segment lengths into (offset, length) pairs."""
    bounds = []
    offset = 0
    for length in lengths:
        bounds.append((offset, int(length)))
        offset += int(length)
    return bounds


def _segment(buffer: np.ndarray, bounds: Bounds, index: int) -> np.ndarray:
    offset, length = bounds[index]
    return buffer[offset : offset + length]


def reduce_scatter(
    channel: Channel, buffer: np.ndarray, bounds: Bounds, reduce: Reducer, scratch: np.ndarray | None = None
) -> None:
    """Reduces ``buffer`` across ranks, leaving segment ``rank`` reduced on each rank.

    Other segments of ``buffer`` hold partial sums afterwards.

    Args:
        channel: the ranks taking part.
        buffer: this rank's contribution, reduced in place.
        bounds: the segments, one per rank, identical on every rank.
        reduce: folds its second argument into its first.
        scratch: a buffer of at least the largest segment, reused for receiving.
    """
    n, rank = channel.size, channel.rank
    if n == 1:
        return
    largest = max(length for _, length in bounds)
    if scratch is None or scratch.size < largest:
        scratch = np.empty(largest, dtype=buffer.dtype)
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_index = (rank - step - 1) % n
        recv_index = (rank - step - 2) % n
        outgoing = _segment(buffer, bounds, send_index)
        target = _segment(buffer, bounds, recv_index)
        incoming = scratch[: target.size]
        channel.exchange([(right, outgoing)], [(left, incoming)])
        if target.size:
            reduce(target, incoming)


def allgather(channel: Channel, buffer: np.ndarray, bounds: Bounds) -> None:
    """Fills every segment of ``buffer`` from the rank that owns it.

    Args:
        channel: the ranks taking part.
        buffer: holds this rank's segment ``rank`` on entry, every segment on return.
        bounds: the segments, one per rank, identical on every rank.
    """
    n, rank = channel.size, channel.rank
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        outgoing = _segment(buffer, bounds, (rank - step) % n)
        incoming = _segment(buffer, bounds, (rank - step - 1) % n)
        channel.exchange([(right, outgoing)], [(left, incoming)])


def allreduce(channel: Channel, buffer: np.ndarray, reduce: Reducer, scratch: np.ndarray | None = None) -> None:
    """Reduces ``buffer`` in place across ranks; every rank ends with the full result."""
    if channel.size == 1:
        return
    bounds = even_bounds(buffer.size, channel.size)
    reduce_scatter(channel, buffer, bounds, reduce, scratch)
    allgather(channel, buffer, bounds)
