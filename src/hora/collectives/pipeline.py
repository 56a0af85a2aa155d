"""The pipelined ring allreduce: one stream of chunks around the ring.

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

Stream order: every rank queues all chunks of its first send at once, and every later
chunk when its predecessor step's chunk arrives; arrivals are processed in order, so
each rank's stream is step-major and chunk-ordered, and the receiver knows which chunk
comes next without any header.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np

from hora.collectives.reduce import Reducer
from hora.collectives.ring import even_bounds

CHUNK_BYTES = 1 << 20


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
    n = size
    if n == 1 or buffer.size == 0:
        return
    step = max(1, chunk_bytes // buffer.itemsize)
    segments = even_bounds(buffer.size, n)
    chunks = [_chunks(offset, length, step) for offset, length in segments]
    scratch = np.empty(min(step, max(length for _, length in segments)), dtype=buffer.dtype)
    raw = buffer.view(np.uint8)
    item = buffer.itemsize

    # Everything this rank will receive, in stream order: (phase, step, segment).
    plan = [("rs", s, (rank - s - 2) % n) for s in range(n - 1)] + [("ag", s, (rank - s - 1) % n) for s in range(n - 1)]
    receives = deque((phase, s, start, count) for phase, s, seg in plan for start, count in chunks[seg])
    sends: deque[memoryview] = deque(raw[start * item : (start + count) * item].data for start, count in chunks[(rank - 1) % n])
    sending: memoryview | None = None
    incoming: tuple[str, int, int, int] | None = None
    target = memoryview(b"")
    got = 0
    while receives or incoming is not None or sends or sending is not None:
        progressed = False
        # Send what the socket takes now.
        while sending is not None or sends:
            if sending is None:
                sending = sends.popleft()
            done = stream.send(sending)
            if done == 0:
                break
            progressed = True
            sending = sending[done:] if done < len(sending) else None
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
                    reduce(buffer[start : start + count], scratch[:count])
                # The chunk goes on: to the next reduce-scatter step, to the first
                # allgather step (after the last reduction), or to the next allgather step.
                if not (phase == "ag" and s == n - 2):
                    sends.append(raw[start * item : (start + count) * item].data)
        if not progressed:
            stream.wait(sending is not None or bool(sends), incoming is not None)
