"""Collectives among ranks of one machine, through shared staging buffers.

Every member has two staging halves that all members can read. A collective moves
the data in rounds, alternating halves: each member copies its share of the round
into its own half, a barrier makes every copy visible, then each member reads what it
needs from the others' halves. Work is split so that every member is busy in every
round (each reduces a 1/n share of the round), and each element is reduced by one
member only, so every rank ends with bit-identical results.

Why alternating halves need one barrier per round: a member refills a half only two
rounds later, after passing the next round's barrier, which every member reaches only
after it finished reading that half. Every collective ends with one more barrier, so
the next one (of any process set) may refill either half at once.

An allreduce's round has two steps, reducing a share and then collecting the others'
reduced shares; it overlaps each with the neighbouring rounds so that a round still
costs one barrier (``_rounds``). After round r's barrier each member collects round
r - 1's results, reduces its share of round r (publishing the result in its half r % 2)
and publishes round r + 1's shares for the others (in its other half). Each share has
a fixed place in a half, where it lies in a full round (``_slots``): round r's result
(this member's place) and round r + 2's shares (the others' places), both written into
half r % 2 between the same two barriers, never overlap, and every other write lands
in memory whose readers passed the barrier before it (tests/test_algorithms.py runs the
ranks one at a time in random orders between barriers to check that).

Small allreduces take a shorter path: every member reads every contribution and sums
them itself, in member order (so results stay identical on every rank): one barrier
less, and no member waits for another's reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from hora.collectives.reduce import Reducer, same_memory
from hora.collectives.ring import Bounds, even_bounds


class SharedGroup(Protocol):
    """Members of one process set that share memory."""

    @property
    def rank(self) -> int:
        """This process's index in the set."""

    @property
    def size(self) -> int:
        """The number of members."""

    @property
    def half_bytes(self) -> int:
        """How much of each staging half one round fills (the same on every member)."""

    def stage(self, member: int, half: int) -> np.ndarray:
        """A member's staging half, as bytes."""

    def barrier(self) -> None:
        """Waits until every member reached this barrier."""


def _typed(raw: np.ndarray, dtype: np.dtype[np.generic], count: int) -> np.ndarray:
    return raw[: count * dtype.itemsize].view(dtype)


def _capacity(group: SharedGroup, dtype: np.dtype[np.generic]) -> int:
    return group.half_bytes // dtype.itemsize


SMALL_BYTES = 16 * 1024  # up to this size every member sums every contribution itself


def allreduce(
    group: SharedGroup, buffer: np.ndarray, reduce: Reducer, postscale: Callable[[np.ndarray], None] | None = None
) -> None:
    """Reduces ``buffer`` in place across the group; every member gets the result.

    Args:
        postscale: scales reduced data in place; each member applies it to the share it
            reduced, before publishing it (a pass over 1/n of the data, not all of it).
    """
    n, me = group.size, group.rank
    if n == 1 or buffer.size == 0:
        if postscale is not None:
            postscale(buffer)
        return
    if buffer.nbytes <= min(SMALL_BYTES, group.half_bytes):
        _typed(group.stage(me, 0), buffer.dtype, buffer.size)[...] = buffer
        group.barrier()
        buffer[...] = _typed(group.stage(0, 0), buffer.dtype, buffer.size)
        for k in range(1, n):
            reduce(buffer, _typed(group.stage(k, 0), buffer.dtype, buffer.size))
        if postscale is not None:
            postscale(buffer)
        group.barrier()
        return
    step = _capacity(group, buffer.dtype)
    slots = _slots(step, n)
    views = _views(group, buffer.dtype, step)
    # Each round's first element and shares of the window.
    rounds = [(start, even_bounds(min(step, buffer.size - start), n)) for start in range(0, buffer.size, step)]

    def publish(r: int, half: int) -> None:
        # Only the shares others reduce; this rank's own share stays private.
        start, shares = rounds[r]
        mine = views[me][half]
        for k, (offset, length) in enumerate(shares):
            if k != me:
                mine[slots[k] : slots[k] + length] = buffer[start + offset : start + offset + length]

    def reduce_own(r: int, half: int) -> None:
        # In place in the private buffer (an in-place ufunc writes memory it has just read,
        # which costs less than writing a third buffer), then published for the others.
        start, shares = rounds[r]
        offset, length = shares[me]
        own = buffer[start + offset : start + offset + length]
        for k in range(n):
            if k != me:
                reduce(own, views[k][half][slots[me] : slots[me] + length])
        if postscale is not None:
            postscale(own)
        views[me][half][slots[me] : slots[me] + length] = own

    def collect(r: int, half: int) -> None:
        start, shares = rounds[r]
        for k, (offset, length) in enumerate(shares):
            if k != me:
                buffer[start + offset : start + offset + length] = views[k][half][slots[k] : slots[k] + length]

    _rounds(group, len(rounds), publish, reduce_own, collect)


def _views(group: SharedGroup, dtype: np.dtype[np.generic], step: int) -> list[list[np.ndarray]]:
    """Every member's two staging halves as ``step`` elements of ``dtype``, by member then
    half: made once per collective, since a round's Python is what bounds small rounds."""
    return [[_typed(group.stage(k, half), dtype, step) for half in (0, 1)] for k in range(group.size)]


def _slots(step: int, n: int) -> list[int]:
    """Where each member's share of a round lies in a staging half: where it lies in a full
    round of ``step`` elements, also in a shorter last round (whose shares are no longer)."""
    return [offset for offset, _ in even_bounds(step, n)]


def _rounds(
    group: SharedGroup,
    count: int,
    publish: Callable[[int, int], None],
    reduce_own: Callable[[int, int], None],
    collect: Callable[[int, int], None],
) -> None:
    """Runs an allreduce's ``count`` rounds, one barrier each (see the module).

    Args:
        publish: ``(round, half)``: puts the shares of that round that others reduce into
            this member's half.
        reduce_own: ``(round, half)``: reduces this member's share of that round from the
            others' halves and publishes the result in its own half.
        collect: ``(round, half)``: copies the others' results of that round out of their
            halves.
    """
    if not count:
        group.barrier()
        return
    publish(0, 0)
    for round_ in range(count):
        group.barrier()
        if round_:
            collect(round_ - 1, (round_ - 1) % 2)
        reduce_own(round_, round_ % 2)
        if round_ + 1 < count:
            publish(round_ + 1, (round_ + 1) % 2)
    group.barrier()
    collect(count - 1, (count - 1) % 2)
    group.barrier()


def allreduce_packed(
    group: SharedGroup,
    inputs: Sequence[np.ndarray | None],
    outputs: Sequence[np.ndarray | None],
    lengths: list[int],
    dtype: np.dtype[np.generic],
    reduce: Reducer,
    prescale: Callable[[np.ndarray], None] | None,
    postscale: Callable[[np.ndarray], None],
) -> None:
    """Allreduces several tensors laid end to end, with no private fusion buffer.

    The tensors go through the staging halves a window at a time, as if packed: each
    round, every member publishes the shares of the window that the others reduce,
    straight from its inputs (scaled by ``prescale`` in its half). After a barrier it
    reduces its own share from its inputs and the others' halves into its outputs,
    scales that (``postscale``) and publishes it; after the next barrier it copies the
    others' results into its outputs. Per member: a pass of copies out of its inputs and
    into its outputs for the others' shares, (n-1)/n each, its own share read, reduced
    and published once: 1.5 passes of copies with two members, against 2 when the
    window is packed whole into the staging half and 4 with a private fusion buffer.

    Args:
        inputs: each tensor's flat data; None for a tensor this rank contributes zeros to
            (it joined).
        outputs: where each tensor's result goes (may be its input, also a read-only
            view's writable twin over the same memory); None to drop it.
        lengths: each tensor's element count.
        dtype: the storage type of every tensor.
        reduce: folds its second argument into its first.
        prescale: scales a contribution in place before reducing; None for no scaling.
        postscale: scales a reduced share in place.
    """
    n, me = group.size, group.rank
    step = _capacity(group, dtype)
    slots = _slots(step, n)
    total = sum(lengths)
    views = _views(group, dtype, step)
    # Each round's first element, shares of the window, and the tensors' parts in it.
    rounds = [
        (start, even_bounds(min(step, total - start), n), parts)
        for start, parts in zip(range(0, total, step), _windows(lengths, step))
    ]

    def publish(r: int, half: int) -> None:
        _, shares, parts = rounds[r]
        mine = views[me][half]
        for index, within, at, length in parts:
            data = inputs[index]
            for k, (offset, size) in enumerate(shares):
                lo, hi = max(at, offset), min(at + length, offset + size)
                if k == me or lo >= hi:
                    continue
                into = mine[slots[k] + lo - offset : slots[k] + hi - offset]
                if data is None:
                    into[...] = 0
                else:
                    into[...] = data[within + lo - at : within + hi - at]
        if prescale is not None:
            for k, (_, size) in enumerate(shares):
                if k != me:
                    prescale(mine[slots[k] : slots[k] + size])

    def reduce_own(r: int, half: int) -> None:
        _, shares, parts = rounds[r]
        offset, size = shares[me]
        at_stage = slots[me] - offset  # element e of the window lies at at_stage + e in a half
        mine = views[me][half]
        others = [views[k][half] for k in range(n) if k != me]
        for index, within, at, length in parts:
            lo, hi = max(at, offset), min(at + length, offset + size)
            if lo >= hi:
                continue
            data, target = inputs[index], outputs[index]
            own = None if data is None else data[within + lo - at : within + hi - at]
            result = mine[at_stage + lo : at_stage + hi] if target is None else target[within + lo - at : within + hi - at]
            _reduce_own(result, own, [other[at_stage + lo : at_stage + hi] for other in others], reduce, prescale)
            postscale(result)
            if target is not None:
                mine[at_stage + lo : at_stage + hi] = result

    def collect(r: int, half: int) -> None:
        _, shares, parts = rounds[r]
        for index, within, at, length in parts:
            target = outputs[index]
            if target is None:
                continue
            for k, (offset, size) in enumerate(shares):
                lo, hi = max(at, offset), min(at + length, offset + size)
                if k != me and lo < hi:
                    target[within + lo - at : within + hi - at] = views[k][half][slots[k] + lo - offset : slots[k] + hi - offset]

    _rounds(group, len(rounds), publish, reduce_own, collect)


def _reduce_own(
    result: np.ndarray,
    own: np.ndarray | None,
    others: list[np.ndarray],
    reduce: Reducer,
    prescale: Callable[[np.ndarray], None] | None,
) -> None:
    """Writes this member's contribution (zeros for None), scaled by ``prescale``, folded
    with the others' in member order, into ``result`` (which may be ``own``'s memory)."""
    if own is None or prescale is not None:
        if own is None:
            result[...] = 0
        elif not same_memory(result, own):
            result[...] = own
        if prescale is not None:
            prescale(result)
        for other in others:
            reduce(result, other)
        return
    reduce.into(own, others[0], result)
    for other in others[1:]:
        reduce(result, other)


def reduce_scatter(group: SharedGroup, buffer: np.ndarray, bounds: Bounds, reduce: Reducer, output: np.ndarray) -> None:
    """Reduces ``buffer`` across the group; ``output`` receives this member's segment.

    ``buffer`` is only read. Each round, every member publishes the pieces of the
    others' segments and reduces the piece of its own segment from its private input
    and the others' published pieces, straight into ``output``.

    Args:
        bounds: (offset, length) of each member's segment of ``buffer``.
        output: ``bounds[rank][1]`` elements, filled with the reduced segment; it may be
            this member's segment of ``buffer`` itself.
    """
    n, me = group.size, group.rank
    own_offset, own_length = bounds[me]
    if n == 1:
        output[...] = buffer[own_offset : own_offset + own_length]
        return
    share = max(1, _capacity(group, buffer.dtype) // n)  # elements of each segment per round
    longest = max(length for _, length in bounds)
    views = _views(group, buffer.dtype, share * n)
    for round_, start in enumerate(range(0, max(longest, 1), share)):
        stages = [member[round_ % 2] for member in views]
        for k, (offset, length) in enumerate(bounds):
            piece = max(0, min(share, length - start))
            if k != me and piece:
                stages[me][k * share : k * share + piece] = buffer[offset + start : offset + start + piece]
        group.barrier()
        piece = max(0, min(share, own_length - start))
        if piece:
            # This rank's own contribution first: ``output`` may be its own segment of
            # ``buffer`` (hierarchical allreduce reduces in place).
            own = buffer[own_offset + start : own_offset + start + piece]
            others = [stages[k][me * share : me * share + piece] for k in range(n) if k != me]
            target = output[start : start + piece]
            reduce.into(own, others[0], target)
            for contribution in others[1:]:
                reduce(target, contribution)
    group.barrier()


def allgather(group: SharedGroup, buffer: np.ndarray, bounds: Bounds) -> None:
    """Fills every member's segment of ``buffer`` from that member (segment ``rank`` is filled on entry)."""
    allgather_pieces(group, buffer, [[segment] for segment in bounds])


def allgather_pieces(group: SharedGroup, buffer: np.ndarray, pieces: list[Bounds]) -> None:
    """Fills every member's pieces of ``buffer`` from that member.

    Each member publishes its pieces back to back, a staging half per round; the
    others copy them out to the same places in their own ``buffer``.

    Args:
        buffer: holds this member's pieces on entry, every member's on return.
        pieces: by member, the (offset, length) spans of ``buffer`` it owns, identical on
            every member; no span overlaps another.
    """
    n, me = group.size, group.rank
    if n == 1:
        return
    step = _capacity(group, buffer.dtype)
    views = _views(group, buffer.dtype, step)
    # By member, by round: (offset in the buffer, offset in the staging half, length).
    slices = [_slices(spans, step) for spans in pieces]
    for round_ in range(max(1, *map(len, slices))):
        half = round_ % 2
        if round_ < len(slices[me]):
            stage = views[me][half]
            for offset, at, length in slices[me][round_]:
                stage[at : at + length] = buffer[offset : offset + length]
        group.barrier()
        for k in range(n):
            if k != me and round_ < len(slices[k]):
                stage = views[k][half]
                for offset, at, length in slices[k][round_]:
                    buffer[offset : offset + length] = stage[at : at + length]
    group.barrier()


def _slices(spans: Bounds, step: int) -> list[list[tuple[int, int, int]]]:
    """The parts of each window of ``step`` elements of the spans laid end to end.

    Returns:
        by window: (offset in the buffer, offset in the staging half, length) of each part.
    """
    return [
        [(spans[index][0] + within, at, length) for index, within, at, length in parts]
        for parts in _windows([length for _, length in spans], step)
    ]


def _windows(lengths: list[int], step: int) -> list[list[tuple[int, int, int, int]]]:
    """The parts of every window of ``step`` elements of items laid end to end, in one
    pass over the items.

    Returns:
        by window: (item index, offset within the item, offset from the window's start,
        length) of each part.
    """
    windows: list[list[tuple[int, int, int, int]]] = [[] for _ in range(-(-sum(lengths) // step))]
    position = 0  # where the current item begins
    for index, length in enumerate(lengths):
        lo, end = position, position + length
        while lo < end:
            window = lo // step
            hi = min(end, (window + 1) * step)
            windows[window].append((index, lo - position, lo - window * step, hi - lo))
            lo = hi
        position = end
    return windows


def broadcast(group: SharedGroup, buffer: np.ndarray, root: int) -> None:
    """Copies ``buffer`` from member ``root`` to every member."""
    if group.size == 1 or buffer.size == 0:
        return
    step = _capacity(group, buffer.dtype)
    for round_, start in enumerate(range(0, buffer.size, step)):
        half = round_ % 2
        chunk = buffer[start : start + step]
        stage = _typed(group.stage(root, half), buffer.dtype, chunk.size)
        if group.rank == root:
            stage[...] = chunk
        group.barrier()
        if group.rank != root:
            chunk[...] = stage
    group.barrier()


def alltoall(
    group: SharedGroup, send: np.ndarray, send_counts: list[int], recv: np.ndarray, recv_counts: list[int]
) -> None:
    """Sends segment ``j`` of ``send`` to member ``j``; receives segment ``i`` of ``recv`` from member ``i``."""
    n, me = group.size, group.rank
    send_offsets = np.concatenate(([0], np.cumsum(send_counts))).astype(int)
    recv_offsets = np.concatenate(([0], np.cumsum(recv_counts))).astype(int)
    recv[recv_offsets[me] : recv_offsets[me] + recv_counts[me]] = send[send_offsets[me] : send_offsets[me] + send_counts[me]]
    if n == 1:
        return
    share = max(1, _capacity(group, send.dtype) // n)
    longest = max(max(send_counts, default=0), max(recv_counts, default=0))
    for round_, start in enumerate(range(0, max(longest, 1), share)):
        half = round_ % 2
        mine = _typed(group.stage(me, half), send.dtype, share * n)
        for j in range(n):
            piece = max(0, min(share, send_counts[j] - start))
            mine[j * share : j * share + piece] = send[send_offsets[j] + start : send_offsets[j] + start + piece]
        group.barrier()
        for i in range(n):
            piece = max(0, min(share, recv_counts[i] - start))
            if i != me and piece:
                theirs = _typed(group.stage(i, half), send.dtype, share * n)
                recv[recv_offsets[i] + start : recv_offsets[i] + start + piece] = theirs[me * share : me * share + piece]
    group.barrier()
