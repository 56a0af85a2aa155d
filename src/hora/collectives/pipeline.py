"""The pipelined ring: allreduce, reduce-scatter, allgather and broadcast as streams of chunks.

The plain ring runs ``2(n-1)`` steps, each a whole-segment transfer followed by a
whole-segment reduction. Here every segment is cut into chunks and each rank streams
chunks to its right neighbour in a fixed order while it receives from its left:

* reduce-scatter step ``s`` (``0 <= s < n-1``): send segment ``r-s-1``, receive segment
  ``r-s-2`` and reduce it into the buffer;
* allgather step ``s``: send segment ``r-s``, receive segment ``r-s-1`` into the buffer.

A chunk received in one step is exactly the chunk sent in the next step (the last
reduce-scatter step yields this rank's finished segment, the first allgather send), so
it is queued for sending the moment it has been reduced or received: transfers,
reductions and both phases overlap, and the kernel's socket buffers carry the data
that arrives while a chunk is being reduced.

Reduce-scatter alone is the first phase (the last step leaves segment ``r`` reduced
here), allgather alone the second (segment ``r`` is this rank's on entry); their segments
may differ in size, even be empty (an allgather of tensors of different first
dimensions), as long as every rank passes the same ``bounds``.

Stream order: every rank queues all chunks of its first send at once, and every later
chunk when its predecessor step's chunk arrives; arrivals are processed in order, so
each rank's stream is step-major and chunk-ordered, and the receiver knows which chunk
comes next without any header.

Broadcast is a chain along the ring: the root streams the buffer to its right
neighbour, every other rank forwards to its right what has arrived from its left, and
the root's left neighbour ends the chain. A rank forwards once a chunk's worth waits (or
the rest of the buffer has arrived), everything that waits in one send: where the link
bounds the transfer the chain moves in chunks, and a rank that its CPU holds up (ranks
sharing cores on a fast link) forwards what arrived meanwhile in larger pieces (it takes
up to ``BROADCAST_TAKE_MIN`` or two chunks from its socket at once), so its work per byte
falls as it falls behind instead of staying one pass per chunk. Every link
carries the buffer once, so the last rank has it ``(n-2)`` chunks' time after the root
has sent it: ``(n-2) c / S`` more than the link bound ``S / B``, against ``(n-2) / n``
more for a scatter then a ring allgather (``pointwise.scatter_allgather_broadcast``),
and ``n - 2`` more for the root sending to every rank itself.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np

from hora.collectives.reduce import Reducer
from hora.collectives.ring import Bounds, even_bounds

CHUNK_BYTES = 1 << 20
# The chain broadcast's chunk, the least a rank forwards at once while more is to come: an
# eighth of each rank's share of the buffer, so the chain fills in (n-2)/8n of the
# transfer, within these bounds (below them a pass costs more than the link's time for the
# chunk on fast links; a rank held up forwards more at once anyway). Measured against
# 64-512 KiB chunks forwarded one by one: docs/performance.md, "The chain broadcast
# forwards what has arrived".
BROADCAST_CHUNK_MIN = 16 * 1024
BROADCAST_CHUNK_MAX = 512 * 1024
# What a forwarding rank takes from its socket at once, at least (and at least two chunks),
# so that a rank held up for a while does not pull megabytes before it sends any: taking
# all that waited measured slower at 8 emulated hosts (docs/performance.md, as above).
BROADCAST_TAKE_MIN = 256 * 1024


def broadcast_chunk_bytes(size: int, nbytes: int) -> int:
    """The chain broadcast's chunk (the least a rank forwards at once while more is to
    come) for ``nbytes`` among ``size`` ranks."""
    return min(BROADCAST_CHUNK_MAX, max(BROADCAST_CHUNK_MIN, nbytes // (8 * size)))


def chains(size: int, nbytes: int) -> bool:
    """Whether the chain broadcast beats a scatter then a ring allgather: ``(n-2) c``
    against ``(n-2) S / n`` bytes of delay, so when the buffer holds more than ``n`` chunks
    (the two are alike for two ranks, where a direct send is simplest)."""
    return size > 2 and nbytes > size * broadcast_chunk_bytes(size, nbytes)


class RingStream(Protocol):
    """Non-blocking transfers to the right neighbour and from the left one."""

    def send(self, data: memoryview) -> int:
        """Sends what the socket takes now; returns the bytes sent (0 if none)."""

    def recv_into(self, data: memoryview) -> int:
        """Receives what has arrived, up to ``len(data)``; returns the bytes received.

        Raises:
            HoraInternalError: the neighbour was lost.
        """

    def wait(self, sending: bool, receiving: bool) -> None:
        """Blocks until the socket can send (if ``sending``) or has data (if ``receiving``)."""


def broadcast(
    stream: RingStream, rank: int, size: int, buffer: np.ndarray, root: int, chunk_bytes: int = CHUNK_BYTES
) -> None:
    """Copies ``buffer`` from ``root`` to every rank, as a chain along the ring (see the module).

    Args:
        buffer: a flat contiguous array, the same length on every rank; the root's data on
            entry there, filled on return everywhere.
        root: the rank whose data everyone gets.
        chunk_bytes: the least a rank forwards at once while more is still to come
            (``broadcast_chunk_bytes``).
        stream, rank, size: as ``allreduce``.
    """
    n = size
    if n == 1 or buffer.size == 0:
        return
    data = buffer.view(np.uint8).reshape(-1).data
    total = len(data)
    position = (rank - root) % n  # along the chain: the root 0, its left neighbour n - 1
    # The bytes this rank holds, and those of them it has passed on: the root holds them
    # all, and the chain's last rank passes nothing on (it counts as having sent all).
    received = total if position == 0 else 0
    sent = 0 if position < n - 1 else total
    take = total if position == n - 1 else max(2 * chunk_bytes, BROADCAST_TAKE_MIN)
    while received < total or sent < total:
        forwarding = sent < received and (received - sent >= chunk_bytes or received == total)
        progressed = False
        if forwarding:
            done = stream.send(data[sent:received])
            sent += done
            progressed = done > 0
        if received < total:
            got = stream.recv_into(data[received : received + take])
            received += got
            progressed = progressed or got > 0
        if not progressed:
            stream.wait(forwarding, received < total)


def _send_ready(stream: RingStream, sending: memoryview | None, sends: deque[memoryview]) -> tuple[memoryview | None, bool]:
    """Sends what the socket takes now, from ``sending`` (a chunk under way) then ``sends``.

    Returns:
        The chunk still under way (None: none), and whether any byte went.
    """
    progressed = False
    while sending is not None or sends:
        if sending is None:
            sending = sends.popleft()
        done = stream.send(sending)
        if done == 0:
            break
        progressed = True
        sending = sending[done:] if done < len(sending) else None
    return sending, progressed


def _chunks(offset: int, length: int, step: int) -> list[tuple[int, int]]:
    return [(start, min(step, offset + length - start)) for start in range(offset, offset + length, step)] or []


def allreduce(
    stream: RingStream, rank: int, size: int, buffer: np.ndarray, reduce: Reducer, chunk_bytes: int = CHUNK_BYTES
) -> None:
    """Reduces ``buffer`` in place around the ring of ``size`` ranks; every rank gets the result.

    Args:
        stream: this rank's link to its right and left neighbours.
        rank: this rank's position in the ring.
        size: the number of ranks.
        buffer: a flat contiguous array, the same length on every rank.
        reduce: folds its second argument into its first.
        chunk_bytes: the pipelining granularity.
    """
    _run(stream, rank, size, buffer, even_bounds(buffer.size, size), ("rs", "ag"), reduce, chunk_bytes)


def reduce_scatter(
    stream: RingStream,
    rank: int,
    size: int,
    buffer: np.ndarray,
    bounds: Bounds,
    reduce: Reducer,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Reduces ``buffer`` around the ring, leaving segment ``rank`` of ``bounds`` reduced here.

    Other segments hold partial sums afterwards (as ``ring.reduce_scatter`` leaves them).

    Args:
        bounds: (offset, length) of each rank's segment, the same on every rank.
        stream, rank, size, buffer, reduce, chunk_bytes: as ``allreduce``.
    """
    _run(stream, rank, size, buffer, bounds, ("rs",), reduce, chunk_bytes)


def allgather(
    stream: RingStream, rank: int, size: int, buffer: np.ndarray, bounds: Bounds, chunk_bytes: int = CHUNK_BYTES
) -> None:
    """Fills every segment of ``buffer`` from the rank that owns it, around the ring.

    Args:
        buffer: holds this rank's segment on entry, every segment on return.
        bounds: (offset, length) of each rank's segment, the same on every rank.
        stream, rank, size, chunk_bytes: as ``allreduce``.
    """
    _run(stream, rank, size, buffer, bounds, ("ag",), None, chunk_bytes)


def _run(
    stream: RingStream,
    rank: int,
    size: int,
    buffer: np.ndarray,
    bounds: Bounds,
    phases: tuple[str, ...],
    reduce: Reducer | None,
    chunk_bytes: int,
) -> None:
    """Streams ``phases`` (``"rs"``, ``"ag"`` or both, in that order) of the ring over ``bounds``."""
    n = size
    if n == 1 or buffer.size == 0:
        return
    step = max(1, chunk_bytes // buffer.itemsize)
    chunks = [_chunks(offset, length, step) for offset, length in bounds]
    largest = max(length for _, length in bounds)
    scratch = np.empty(min(step, largest), dtype=buffer.dtype) if "rs" in phases else buffer[:0]
    raw = buffer.view(np.uint8)
    item = buffer.itemsize

    # Everything this rank will receive, in stream order: (phase, step, segment); and the
    # step after which a received chunk stops (the last step of the last phase).
    plan = []
    if "rs" in phases:
        plan += [("rs", s, (rank - s - 2) % n) for s in range(n - 1)]
    if "ag" in phases:
        plan += [("ag", s, (rank - s - 1) % n) for s in range(n - 1)]
    last = plan[-1][:2]
    receives = deque((phase, s, start, count) for phase, s, seg in plan for start, count in chunks[seg])
    first = (rank - 1) % n if phases[0] == "rs" else rank
    sends: deque[memoryview] = deque(raw[start * item : (start + count) * item].data for start, count in chunks[first])
    sending: memoryview | None = None
    incoming: tuple[str, int, int, int] | None = None
    target = memoryview(b"")
    got = 0
    while receives or incoming is not None or sends or sending is not None:
        sending, progressed = _send_ready(stream, sending, sends)
        # Receive what has arrived, one chunk at a time, acting on each as it completes.
        if incoming is None and receives:
            incoming = receives.popleft()
            phase, _, start, count = incoming
            target = (scratch[:count] if phase == "rs" else buffer[start : start + count]).view(np.uint8).data
            got = 0
        if incoming is not None:
            received = stream.recv_into(target[got:])
            got += received
            progressed = progressed or received > 0
            if got == len(target):
                phase, s, start, count = incoming
                incoming = None
                if phase == "rs":
                    assert reduce is not None  # invariant: a plan with "rs" steps comes with a reducer
                    reduce(buffer[start : start + count], scratch[:count])
                # The chunk goes on: to the next step of its phase, or from the last
                # reduction to the first allgather step; the last step's stays here.
                if (phase, s) != last:
                    sends.append(raw[start * item : (start + count) * item].data)
        if not progressed:
            stream.wait(sending is not None or bool(sends), incoming is not None)
