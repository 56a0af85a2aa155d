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


def tree_broadcast(channel: Channel, buffer: np.ndarray, root: int) -> None:
    """``broadcast`` along a binomial tree: ``ceil(log2 n)`` rounds instead of the root's
    ``n - 1`` sends.

    Numbered from the root (``v = (rank - root) mod n``), rank ``v > 0`` receives the
    buffer from ``v - 2^floor(log2 v)``, then sends it on to ``v + 2^k`` for every ``k``
    from ``bit_length(v)`` while that is below ``n``, one after the other: the first child
    has the largest subtree, so it starts forwarding first. Every rank has the buffer after
    ``ceil(log2 n)`` transfers of it in a row, where the root sending to each rank takes
    ``n - 1`` on the root's link: the better choice for buffers whose transfer outweighs a
    step's latency and that are too small for ``scatter_allgather_broadcast``'s ``n`` steps.
    """
    n = channel.size
    if n == 1 or buffer.size == 0:
        return
    v = (channel.rank - root) % n
    if v > 0:
        parent = v - (1 << (v.bit_length() - 1))
        channel.exchange([], [((parent + root) % n, buffer)])
    step = 1 << v.bit_length()
    while v + step < n:
        channel.exchange([((v + step + root) % n, buffer)], [])
        step <<= 1


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
