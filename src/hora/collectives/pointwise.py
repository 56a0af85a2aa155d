"""Collectives where data goes straight from owner to receiver: broadcast and alltoall."""

from __future__ import annotations

import numpy as np

from hora.collectives import ring
from hora.collectives.channel import Channel
from hora.collectives.ring import bounds_from_lengths


def broadcast(channel: Channel, buffer: np.ndarray, root: int) -> None:
    """Copies ``buffer`` from ``root`` into ``buffer`` on every other rank.

    The root sends to all receivers at once; each transfer is one socket write stream.
    The root's link carries ``(n-1)`` copies: for large buffers across hosts use
    ``scatter_allgather_broadcast``.
    """
    if channel.size == 1 or buffer.size == 0:
        return
    if channel.rank == root:
        channel.exchange([(peer, buffer) for peer in range(channel.size) if peer != root], [])
    else:
        channel.exchange([], [(root, buffer)])


def scatter_allgather_broadcast(channel: Channel, buffer: np.ndarray, root: int) -> None:
    """``broadcast`` in two bandwidth-optimal phases (van de Geijn's broadcast).

    The root sends segment ``i`` (``1/n`` of the buffer) to rank ``i``, then a ring
    allgather gives every rank every segment. Each link carries about ``2(n-1)/n`` of the
    buffer instead of the root's link carrying ``n-1`` copies, for ``n`` more steps of
    latency: the better choice once the buffer's bytes outweigh those steps.
    """
    n = channel.size
    if n == 1 or buffer.size == 0:
        return
    bounds = ring.even_bounds(buffer.size, n)

    def segment(index: int) -> np.ndarray:
        offset, length = bounds[index]
        return buffer[offset : offset + length]

    if channel.rank == root:
        channel.exchange([(peer, segment(peer)) for peer in range(n) if peer != root], [])
    else:
        channel.exchange([], [(root, segment(channel.rank))])
    ring.allgather(channel, buffer, bounds)


def alltoall(
    channel: Channel, send: np.ndarray, send_counts: list[int], recv: np.ndarray, recv_counts: list[int]
) -> None:
    """Sends segment ``j`` of ``send`` to rank ``j`` and receives segment ``i`` of ``recv`` from rank ``i``.

    Args:
        channel: the ranks taking part.
        send: this rank's outgoing data, segments in rank order.
        send_counts: elements for each destination rank.
        recv: the buffer for incoming data, segments in source-rank order.
        recv_counts: elements from each source rank.
    """
    rank = channel.rank
    send_bounds = bounds_from_lengths(send_counts)
    recv_bounds = bounds_from_lengths(recv_counts)

    def seg(buffer: np.ndarray, bounds: list[tuple[int, int]], peer: int) -> np.ndarray:
        offset, length = bounds[peer]
        return buffer[offset : offset + length]

    seg(recv, recv_bounds, rank)[...] = seg(send, send_bounds, rank)
    peers = [peer for peer in range(channel.size) if peer != rank]
    channel.exchange(
        [(peer, seg(send, send_bounds, peer)) for peer in peers if send_counts[peer]],
        [(peer, seg(recv, recv_bounds, peer)) for peer in peers if recv_counts[peer]],
    )
