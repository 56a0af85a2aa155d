"""Collectives where data goes straight from owner to receiver: broadcast and alltoall."""

from __future__ import annotations

import numpy as np

from hora.collectives.channel import Channel
from hora.collectives.ring import bounds_from_lengths


def broadcast(channel: Channel, buffer: np.ndarray, root: int) -> None:
    """Copies ``buffer`` from ``root`` into ``buffer`` on every other rank.

    The root sends to all receivers at once; each transfer is one socket write stream.
    """
    if channel.size == 1 or buffer.size == 0:
        return
    if channel.rank == root:
        channel.exchange([(peer, buffer) for peer in range(channel.size) if peer != root], [])
    else:
        channel.exchange([], [(root, buffer)])


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
