"""The collective algorithms one process set uses: the TCP ring, or shared memory.

The executor asks for a process set's ``Collectives`` and calls the same methods
whichever transport is underneath: sets whose ranks all share this machine's memory
domain use ``collectives.shm_ops``; every other set uses the ring and point-to-point
algorithms over the mesh's TCP links.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from hora.collectives import adasum, doubling, pipeline, pointwise, ring, shm_ops
from hora.collectives.channel import Channel
from hora.collectives.reduce import Reducer
from hora.collectives.ring import Bounds

# Allreduces up to this size take recursive doubling over TCP: ceil(log2 n) exchanges of
# the whole buffer beat the ring's 2(n-1) exchanges of 1/n of it while the per-step
# latency outweighs the bytes. Where the two meet depends on n, the link and hora's
# per-step cost; docs/scaling.md fits the model: on 1 Gbit/s links at n = 8 they cross
# near 64 KiB, on unshaped links much later.
DOUBLING_MAX_BYTES = 64 * 1024
# Broadcasts from this size (with more than two ranks) scatter, then allgather around the
# ring: every link carries ~2(n-1)/n of the buffer, instead of the root's link n - 1
# copies, for n more steps of latency; larger ones still (``pipeline.chains``; with its
# 16 KiB chunks, every size from here on fewer than 16 ranks) go along the ring as a
# pipelined chain, every link carrying the buffer once.
SCATTER_BROADCAST_MIN_BYTES = 256 * 1024
# From this size up to the one above, broadcast goes along a binomial tree
# (``pointwise.tree_broadcast``): log2 n transfers of the buffer in a row instead of the
# root's n - 1; below it, the tree's extra steps cost more than the root's extra copies.
# Measured on 4 and 8 emulated hosts at 1 Gbit/s: 64 KiB 0.78 / 2.1 ms against 1.3 /
# 4.5 ms, 128 KiB 2.0 / 4.4 against 3.1 / 8.4; alike at 16 KiB, and at 10 Gbit/s.
TREE_BROADCAST_MIN_BYTES = 32 * 1024


class Collectives(Protocol):
    """The collectives of one process set, on flat buffers."""

    @property
    def rank(self) -> int:
        """This process's rank within the set."""

    @property
    def size(self) -> int:
        """The number of ranks in the set."""

    @property
    def label(self) -> str:
        """The transport, for the timeline: ``SHM``, ``TCP_RING`` or ``HIERARCHICAL``."""

    def allreduce(
        self, buffer: np.ndarray, reduce: Reducer, postscale: Callable[[np.ndarray], None] | None = None
    ) -> None:
        """Reduces ``buffer`` in place; every rank gets the result, scaled by ``postscale``.

        ``postscale`` scales reduced data in place, applied by each algorithm where it
        costs least (on the share a rank reduced, before it is shared, where it can).
        """

    def allreduce_packed(self, inputs: Sequence[np.ndarray | None], outputs: Sequence[np.ndarray | None],
                         lengths: list[int], dtype: np.dtype[np.generic], reduce: Reducer,
                         prescale: Callable[[np.ndarray], None] | None, postscale: Callable[[np.ndarray], None]) -> bool:
        """Allreduces several tensors without a private fusion buffer, where the transport can.

        Returns:
            False, having done nothing, where it cannot (the caller packs the tensors into a
            fusion buffer and calls ``allreduce``). Arguments as ``shm_ops.allreduce_packed``.
        """

    def adasum(self, buffer: np.ndarray, tensors: Bounds) -> None:
        """Adasum-reduces each tensor of ``buffer`` in place."""

    @property
    def reads_only(self) -> bool:
        """True when ``reduce_scatter`` leaves its ``data`` untouched (no copy needed)."""

    def reduce_scatter(self, data: np.ndarray, bounds: Bounds, reduce: Reducer, output: np.ndarray) -> None:
        """Reduces ``data`` (which may be modified unless ``reads_only``); ``output`` gets this rank's segment."""

    def allgather(self, buffer: np.ndarray, bounds: Bounds) -> None:
        """Fills every rank's segment of ``buffer`` (this rank's is filled on entry)."""

    def broadcast(self, buffer: np.ndarray, root: int) -> None:
        """Copies ``buffer`` from ``root`` to every rank."""

    def alltoall(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray, recv_counts: list[int]) -> None:
        """Sends segment ``j`` of ``send`` to rank ``j``; receives segment ``i`` of ``recv`` from rank ``i``."""


class StreamingChannel(Channel, Protocol):
    """A channel that also offers its ring neighbours as a stream (for the pipelined ring)."""

    def ring_stream(self) -> pipeline.RingStream:
        """This rank's non-blocking links to its right and left neighbours."""


class TcpCollectives:
    """Ring and point-to-point algorithms over a channel of TCP links.

    Allreduces, reduce-scatters and allgathers larger than one pipeline chunk per rank
    use the pipelined ring; small allreduces (``DOUBLING_MAX_BYTES``) recursive doubling,
    which takes fewer steps; everything in between the plain ring, which has less
    bookkeeping per byte. Broadcasts to more than two ranks from
    ``SCATTER_BROADCAST_MIN_BYTES`` scatter and allgather, and larger ones
    (``pipeline.chains``) stream along the ring as a chain.

    Args:
        channel: the set's channel.
    """

    def __init__(self, channel: StreamingChannel) -> None:
        self._channel = channel
        self._scratch = np.empty(0, dtype=np.uint8)

    @property
    def rank(self) -> int:
        return self._channel.rank

    @property
    def size(self) -> int:
        return self._channel.size

    @property
    def reads_only(self) -> bool:
        return False  # the ring reduces in place

    @property
    def label(self) -> str:
        return "TCP_RING"

    def _scratch_for(self, count: int, dtype: np.dtype[np.generic]) -> np.ndarray:
        nbytes = count * dtype.itemsize
        if self._scratch.size < nbytes:
            self._scratch = np.empty(max(nbytes, self._scratch.size * 2), dtype=np.uint8)
        return self._scratch[:nbytes].view(dtype)

    def allreduce(
        self, buffer: np.ndarray, reduce: Reducer, postscale: Callable[[np.ndarray], None] | None = None
    ) -> None:
        if self._streams(buffer):  # a set of one has no ring links
            pipeline.allreduce(self._channel.ring_stream(), self.rank, self.size, buffer, reduce)
        elif buffer.nbytes <= DOUBLING_MAX_BYTES:
            doubling.allreduce(self._channel, buffer, reduce, self._scratch_for(buffer.size, buffer.dtype))
        else:
            # The ring receives at most one segment (a 1/size share, rounded up) at a time.
            scratch = self._scratch_for(-(-buffer.size // self.size), buffer.dtype)
            ring.allreduce(self._channel, buffer, reduce, scratch)
        if postscale is not None:
            postscale(buffer)  # TCP is slower than a pass over memory: no gain in folding it in

    def allreduce_packed(self, inputs: Sequence[np.ndarray | None], outputs: Sequence[np.ndarray | None],
                         lengths: list[int], dtype: np.dtype[np.generic], reduce: Reducer,
                         prescale: Callable[[np.ndarray], None] | None, postscale: Callable[[np.ndarray], None]) -> bool:
        return False  # the ring reduces a buffer in place: the caller packs

    def adasum(self, buffer: np.ndarray, tensors: Bounds) -> None:
        adasum.allreduce(self._channel, buffer, tensors)

    def _streams(self, buffer: np.ndarray) -> bool:
        """Whether the pipelined ring carries ``buffer``: more than a chunk per rank (below
        that, the ring's whole-segment steps are as fast and keep no stream state)."""
        return self.size > 1 and buffer.nbytes > pipeline.CHUNK_BYTES * self.size

    def reduce_scatter(self, data: np.ndarray, bounds: Bounds, reduce: Reducer, output: np.ndarray) -> None:
        if self._streams(data):
            pipeline.reduce_scatter(self._channel.ring_stream(), self.rank, self.size, data, bounds, reduce)
        else:
            scratch = self._scratch_for(max((length for _, length in bounds), default=0), data.dtype)
            ring.reduce_scatter(self._channel, data, bounds, reduce, scratch)
        offset, length = bounds[self.rank]
        output[...] = data[offset : offset + length]

    def allgather(self, buffer: np.ndarray, bounds: Bounds) -> None:
        if self._streams(buffer):
            pipeline.allgather(self._channel.ring_stream(), self.rank, self.size, buffer, bounds)
        else:
            ring.allgather(self._channel, buffer, bounds)

    def broadcast(self, buffer: np.ndarray, root: int) -> None:
        if self.size > 2 and buffer.nbytes >= SCATTER_BROADCAST_MIN_BYTES:
            if pipeline.chains(self.size, buffer.nbytes):
                chunk = pipeline.broadcast_chunk_bytes(self.size, buffer.nbytes)
                pipeline.broadcast(self._channel.ring_stream(), self.rank, self.size, buffer, root, chunk)
            else:
                pointwise.scatter_allgather_broadcast(self._channel, buffer, root)
        elif self.size > 2 and buffer.nbytes >= TREE_BROADCAST_MIN_BYTES:
            pointwise.tree_broadcast(self._channel, buffer, root)
        else:
            pointwise.broadcast(self._channel, buffer, root)

    def alltoall(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray, recv_counts: list[int]) -> None:
        pointwise.alltoall(self._channel, send, send_counts, recv, recv_counts)


class SharedCollectives(TcpCollectives):
    """Shared-memory algorithms for a set on one machine (Adasum stays on TCP links).

    Args:
        group: the set's shared-memory group.
        channel: the set's TCP channel, for Adasum.
    """

    def __init__(self, group: shm_ops.SharedGroup, channel: StreamingChannel) -> None:
        super().__init__(channel)
        self._group = group

    @property
    def reads_only(self) -> bool:
        return True

    @property
    def label(self) -> str:
        return "SHM"

    def allreduce(
        self, buffer: np.ndarray, reduce: Reducer, postscale: Callable[[np.ndarray], None] | None = None
    ) -> None:
        shm_ops.allreduce(self._group, buffer, reduce, postscale)

    def allreduce_packed(self, inputs: Sequence[np.ndarray | None], outputs: Sequence[np.ndarray | None],
                         lengths: list[int], dtype: np.dtype[np.generic], reduce: Reducer,
                         prescale: Callable[[np.ndarray], None] | None, postscale: Callable[[np.ndarray], None]) -> bool:
        # Small fused buffers take the short path of ``allreduce`` (no reduction shares).
        if self._group.size == 1 or sum(lengths) * dtype.itemsize <= shm_ops.SMALL_BYTES:
            return False
        shm_ops.allreduce_packed(self._group, inputs, outputs, lengths, dtype, reduce, prescale, postscale)
        return True

    def reduce_scatter(self, data: np.ndarray, bounds: Bounds, reduce: Reducer, output: np.ndarray) -> None:
        shm_ops.reduce_scatter(self._group, data, bounds, reduce, output)

    def allgather(self, buffer: np.ndarray, bounds: Bounds) -> None:
        shm_ops.allgather(self._group, buffer, bounds)

    def allgather_pieces(self, buffer: np.ndarray, pieces: list[Bounds]) -> None:
        """Fills every member's pieces of ``buffer`` (see ``shm_ops.allgather_pieces``)."""
        shm_ops.allgather_pieces(self._group, buffer, pieces)

    def broadcast(self, buffer: np.ndarray, root: int) -> None:
        shm_ops.broadcast(self._group, buffer, root)

    def alltoall(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray, recv_counts: list[int]) -> None:
        shm_ops.alltoall(self._group, send, send_counts, recv, recv_counts)


class HierarchicalCollectives(TcpCollectives):
    """Allreduce and allgather across hosts in stages; the others run over the flat TCP ring.

    Allreduce:
    1. within each host, a shared-memory reduce-scatter leaves each local rank ``l``
       with segment ``l`` reduced over its host;
    2. across hosts, the ranks with the same local index allreduce their segment over
       TCP (the pipelined ring), each pair of hosts carrying ``1/local_size`` of the data
       per local rank, all local ranks at once;
    3. within each host, a shared-memory allgather gives every local rank every segment.

    Allgather:
    1. across hosts, the ranks with the same local index gather their own segments over
       TCP (the ring), all local ranks at once, so each TCP link carries only the
       segments of one local index;
    2. within each host, a shared-memory allgather in which every local rank hands on
       the segments it gathered.

    Args:
        local: the set's members on this host (shared memory).
        cross: the set's members with this rank's local index, one per host (TCP).
        flat: every member of the set (TCP), for the other collectives.
        layout: by host (in the order of ``cross``), the set indices of its members (in
            the order of ``local``).
        allreduce: whether allreduce takes the hierarchical path (else the flat ring).
        allgather: whether allgather does.
    """

    def __init__(
        self,
        local: SharedCollectives,
        cross: TcpCollectives,
        flat: StreamingChannel,
        layout: list[tuple[int, ...]],
        allreduce: bool = True,
        allgather: bool = True,
    ) -> None:
        super().__init__(flat)
        self._local = local
        self._cross = cross
        self._layout = layout
        self.hierarchical_allreduce = allreduce
        self.hierarchical_allgather = allgather

    @property
    def label(self) -> str:
        return "HIERARCHICAL"

    def allreduce(
        self, buffer: np.ndarray, reduce: Reducer, postscale: Callable[[np.ndarray], None] | None = None
    ) -> None:
        if not self.hierarchical_allreduce:
            super().allreduce(buffer, reduce, postscale)
            return
        bounds = ring.even_bounds(buffer.size, self._local.size)
        offset, length = bounds[self._local.rank]
        segment = buffer[offset : offset + length]
        self._local.reduce_scatter(buffer, bounds, reduce, segment)
        self._cross.allreduce(segment, reduce, postscale)  # each rank scales only its segment
        self._local.allgather(buffer, bounds)

    def allgather(self, buffer: np.ndarray, bounds: Bounds) -> None:
        if not self.hierarchical_allgather:
            super().allgather(buffer, bounds)
            return
        column = self._local.rank
        self._cross.allgather(buffer, [bounds[host[column]] for host in self._layout])
        pieces = [[bounds[host[index]] for host in self._layout] for index in range(self._local.size)]
        self._local.allgather_pieces(buffer, pieces)
