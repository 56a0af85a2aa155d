"""The TCP path's algorithms at every world size, and the shared-memory packed allreduce,
in one process: ranks are threads.

A ``ThreadChannel`` stands in for the mesh: ``exchange`` puts copies of what it sends in
per-pair queues and takes what it receives from them, in order, as the TCP links do.
The multi-process tests (test_collectives.py) run the same algorithms over real
sockets; these cover more world sizes and sizes in seconds.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from hora.collectives import doubling, pointwise
from hora.collectives.reduce import MAX, MIN, SUM, DataType, reducer


class ThreadChannel:
    """One rank's view of an in-process mesh of ``size`` ranks."""

    def __init__(self, rank: int, size: int, queues: dict[tuple[int, int], queue.Queue[np.ndarray]]) -> None:
        self._rank, self._size, self._queues = rank, size, queues

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def exchange(self, sends: Sequence[tuple[int, np.ndarray]], recvs: Sequence[tuple[int, np.ndarray]]) -> None:
        for peer, buffer in sends:
            if buffer.size:
                self._queues[(self._rank, peer)].put(buffer.copy())
        for peer, buffer in recvs:
            if buffer.size:
                got = self._queues[(peer, self._rank)].get(timeout=10)
                assert got.shape == buffer.shape, f"rank {self._rank} expected {buffer.shape} from {peer}, got {got.shape}"
                buffer[...] = got


def run_ranks(size: int, rank_main: Callable[[int], object], timeout: float = 30) -> list[object]:
    """``rank_main(rank)`` on ``size`` threads; their results by rank (re-raising a failure)."""
    results: list[object] = [None] * size
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            results[rank] = rank_main(rank)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def run_threads(size: int, fn: Callable[[ThreadChannel], object]) -> list[object]:
    """``fn(channel)`` on ``size`` thread ranks joined by an in-process mesh."""
    queues: dict[tuple[int, int], queue.Queue[np.ndarray]] = {
        (a, b): queue.Queue() for a in range(size) for b in range(size) if a != b
    }
    results = run_ranks(size, lambda rank: fn(ThreadChannel(rank, size, queues)))
    for queue_ in queues.values():
        assert queue_.empty(), "a message was sent that nobody received"
    return results


@pytest.mark.parametrize("size", range(1, 10))
@pytest.mark.parametrize("count", [1, 7, 1000])
def test_recursive_doubling_allreduce_matches_and_agrees_bitwise(size: int, count: int) -> None:
    inputs = [np.random.default_rng(r).standard_normal(count).astype(np.float32) for r in range(size)]

    def job(channel: ThreadChannel) -> np.ndarray:
        buffer = inputs[channel.rank].copy()
        doubling.allreduce(channel, buffer, reducer(SUM, DataType.FLOAT32))
        return buffer

    results = run_threads(size, job)
    np.testing.assert_allclose(results[0], np.sum(inputs, axis=0), rtol=1e-5, atol=1e-5)
    for rank, got in enumerate(results):
        assert np.array_equal(got, results[0]), f"rank {rank} differs from rank 0 in the last bits"


@pytest.mark.parametrize("op, combine", [(SUM, np.sum), (MIN, np.min), (MAX, np.max)])
def test_recursive_doubling_ops_and_integers(op: int, combine: Callable[..., np.ndarray]) -> None:
    size = 6
    inputs = [np.arange(10, dtype=np.int64) * (r - 2) for r in range(size)]

    def job(channel: ThreadChannel) -> np.ndarray:
        buffer = inputs[channel.rank].copy()
        doubling.allreduce(channel, buffer, reducer(op, DataType.INT64))
        return buffer

    for got in run_threads(size, job):
        assert np.array_equal(got, combine(inputs, axis=0))


@pytest.mark.parametrize("size", range(1, 8))
@pytest.mark.parametrize("count", [0, 3, 1001])
def test_scatter_allgather_broadcast_from_every_root(size: int, count: int) -> None:
    for root in range(size):

        def job(channel: ThreadChannel) -> np.ndarray:
            buffer = np.arange(count, dtype=np.float64) if channel.rank == root else np.full(count, -1.0)
            pointwise.scatter_allgather_broadcast(channel, buffer, root)
            return buffer

        for rank, got in enumerate(run_threads(size, job)):
            assert np.array_equal(got, np.arange(count, dtype=np.float64)), f"root {root}, rank {rank}"


@pytest.mark.parametrize("size", range(1, 10))
def test_tree_broadcast_from_every_root_in_log2_rounds(size: int) -> None:
    rounds = (size - 1).bit_length()
    for root in range(size):
        sends: dict[int, list[int]] = {}
        receives: dict[int, list[int]] = {}

        def job(channel: ThreadChannel) -> np.ndarray:
            class Counting:
                rank, size = channel.rank, channel.size

                def exchange(self, out: list, into: list) -> None:
                    sends.setdefault(self.rank, []).extend(peer for peer, _ in out)
                    receives.setdefault(self.rank, []).extend(peer for peer, _ in into)
                    channel.exchange(out, into)

            buffer = np.arange(1001, dtype=np.float64) if channel.rank == root else np.full(1001, -1.0)
            pointwise.tree_broadcast(Counting(), buffer, root)  # type: ignore[arg-type]
            return buffer

        for rank, got in enumerate(run_threads(size, job)):
            assert np.array_equal(got, np.arange(1001, dtype=np.float64)), f"root {root}, rank {rank}"
        # Every rank but the root receives once; the root sends once a round.
        assert sorted(r for r, peers in receives.items() for _ in peers) == [r for r in range(size) if r != root]
        assert len(sends.get(root, [])) == rounds
        assert sorted(p for peers in sends.values() for p in peers) == [r for r in range(size) if r != root]


class ThreadPipe:
    """A one-way byte stream between two thread ranks, holding at most ``capacity`` bytes
    (what a socket's buffers hold: a sender that runs ahead must wait)."""

    def __init__(self, capacity: int) -> None:
        self.data = bytearray()
        self.capacity = capacity
        self.changed = threading.Condition()


class ThreadStream:
    """One rank's ``pipeline.RingStream``: non-blocking sends right, receives from the left."""

    def __init__(self, right: ThreadPipe, left: ThreadPipe) -> None:
        self._right, self._left = right, left

    def send(self, data: memoryview) -> int:
        with self._right.changed:
            room = self._right.capacity - len(self._right.data)
            taken = min(room, len(data))
            self._right.data += data[:taken]
            self._right.changed.notify_all()
            return taken

    def recv_into(self, data: memoryview) -> int:
        with self._left.changed:
            taken = min(len(self._left.data), len(data))
            data[:taken] = self._left.data[:taken]
            del self._left.data[:taken]
            self._left.changed.notify_all()
            return taken

    def wait(self, sending: bool, receiving: bool) -> None:
        # Either side may change first: wait on each briefly in turn (a test, not a fast path).
        if receiving:
            with self._left.changed:
                if not self._left.data:
                    self._left.changed.wait(0.005)
        if sending:
            with self._right.changed:
                if len(self._right.data) >= self._right.capacity:
                    self._right.changed.wait(0.005)


def run_ring(size: int, fn: Callable[[int, ThreadStream], object], capacity: int = 1000) -> list[object]:
    """``fn(rank, stream)`` on ``size`` thread ranks joined in a ring of byte pipes."""
    pipes = [ThreadPipe(capacity) for _ in range(size)]  # pipes[r]: from rank r to rank r + 1
    results = run_ranks(size, lambda rank: fn(rank, ThreadStream(pipes[rank], pipes[(rank - 1) % size])), 60)
    assert not any(pipe.data for pipe in pipes), "bytes were sent that nobody received"
    return results


def ragged_bounds(size: int, seed: int) -> list[tuple[int, int]]:
    """Segments of random lengths, some empty (an allgather of tensors of different first dimensions)."""
    lengths = np.random.default_rng(seed).integers(0, 40, size)
    lengths[seed % size] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [(int(o), int(n)) for o, n in zip(offsets, lengths)]


@pytest.mark.parametrize("size", range(2, 10))
@pytest.mark.parametrize("chunk_bytes", [8, 56, 1 << 20])
def test_pipelined_ring_allreduce_reduce_scatter_and_allgather(size: int, chunk_bytes: int) -> None:
    from hora.collectives import pipeline

    total = reducer(SUM, DataType.INT64)
    ragged = ragged_bounds(size, size + chunk_bytes)
    rows = sum(n for _, n in ragged)

    def contribution(rank: int, count: int) -> np.ndarray:
        return np.arange(count, dtype=np.int64) * (rank + 1) + rank

    def job(rank: int, stream: ThreadStream) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        reduced = contribution(rank, 1003)
        pipeline.allreduce(stream, rank, size, reduced, total, chunk_bytes)
        scattered = contribution(rank, rows)
        pipeline.reduce_scatter(stream, rank, size, scattered, ragged, total, chunk_bytes)
        offset, length = ragged[rank]
        gathered = np.full(rows, -1, dtype=np.int64)
        gathered[offset : offset + length] = contribution(rank, rows)[offset : offset + length]
        pipeline.allgather(stream, rank, size, gathered, ragged, chunk_bytes)
        return reduced, scattered[offset : offset + length].copy(), gathered

    results = run_ring(size, job)
    whole = sum(contribution(r, 1003) for r in range(size))
    sums = sum(contribution(r, rows) for r in range(size))
    for rank, (reduced, segment, gathered) in enumerate(results):
        offset, length = ragged[rank]
        assert np.array_equal(reduced, whole)
        assert np.array_equal(segment, sums[offset : offset + length])
        owners = np.concatenate([contribution(r, rows)[o : o + n] for r, (o, n) in enumerate(ragged)])
        assert np.array_equal(gathered, owners)


@pytest.mark.parametrize("size", range(1, 10))
@pytest.mark.parametrize("chunk_bytes", [8, 56, 1 << 20])
def test_pipelined_chain_broadcast_from_every_root(size: int, chunk_bytes: int) -> None:
    # 1003 float64 (8024 bytes): with 8- and 56-byte chunks, many more chunks than a pipe
    # of 1000 bytes holds; chunks of 1 MiB: one chunk, store and forward.
    from hora.collectives import pipeline

    for root in range(size):

        def job(rank: int, stream: ThreadStream) -> np.ndarray:
            buffer = np.arange(1003, dtype=np.float64) if rank == root else np.full(1003, -1.0)
            pipeline.broadcast(stream, rank, size, buffer, root, chunk_bytes)
            return buffer

        for rank, got in enumerate(run_ring(size, job)):
            assert np.array_equal(got, np.arange(1003, dtype=np.float64)), f"root {root}, rank {rank}"


def test_the_chain_forwards_what_arrived_before_the_rest_comes() -> None:
    # The middle rank of three forwards as soon as a chunk's worth waits, not once it holds
    # the whole buffer, and forwards everything that waits in one send, more than a chunk
    # when more arrived meanwhile (the root's pipe delivers up to 1000 bytes at a time).
    from hora.collectives import pipeline

    offered: list[tuple[int, int]] = []  # (bytes the middle rank held, bytes it offered)

    class Recording(ThreadStream):
        held = 0

        def recv_into(self, data: memoryview) -> int:
            got = super().recv_into(data)
            self.held += got
            return got

        def send(self, data: memoryview) -> int:
            offered.append((self.held, len(data)))
            return super().send(data)

    def job(rank: int, stream: ThreadStream) -> np.ndarray:
        if rank == 1:
            stream = Recording(stream._right, stream._left)
        buffer = np.arange(1003, dtype=np.float64) if rank == 0 else np.full(1003, -1.0)
        pipeline.broadcast(stream, rank, 3, buffer, 0, 64)
        return buffer

    for got in run_ring(3, job):
        assert np.array_equal(got, np.arange(1003, dtype=np.float64))
    assert offered[0][0] < 8024, "the middle rank waited for the whole buffer before it forwarded"
    assert all(length >= 64 or held == 8024 for held, length in offered), offered
    assert any(length > 64 for _, length in offered), offered


def test_chain_broadcast_choice() -> None:
    from hora.collectives import pipeline

    assert pipeline.broadcast_chunk_bytes(4, 64 << 20) == pipeline.BROADCAST_CHUNK_MAX
    assert pipeline.broadcast_chunk_bytes(8, 1 << 20) == pipeline.BROADCAST_CHUNK_MIN
    assert pipeline.broadcast_chunk_bytes(4, 8 << 20) == 256 << 10  # an eighth of a rank's share
    assert not pipeline.chains(2, 64 << 20)  # two ranks: a direct send
    assert pipeline.chains(3, 256 << 10)  # more than 3 chunks of 16 KiB
    assert not pipeline.chains(8, 128 << 10)  # 8 chunks of 16 KiB: scatter + allgather is as good
    assert pipeline.chains(8, 256 << 10)


class ThreadGroup:
    """One thread rank's view of in-process staging halves (``shm_ops.SharedGroup``)."""

    def __init__(self, rank: int, halves: list[list[np.ndarray]], barrier: threading.Barrier) -> None:
        self._rank, self._halves, self._barrier = rank, halves, barrier

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._halves)

    @property
    def half_bytes(self) -> int:
        return self._halves[0][0].nbytes

    def stage(self, member: int, half: int) -> np.ndarray:
        return self._halves[member][half]

    def barrier(self) -> None:
        self._barrier.wait(timeout=10)


def run_shared(size: int, half_bytes: int, job: Callable[[int, ThreadGroup], object]) -> list[object]:
    """``job(rank, group)`` on ``size`` thread ranks sharing staging halves of ``half_bytes``."""
    halves = [[np.full(half_bytes, 0xEE, dtype=np.uint8) for _ in range(2)] for _ in range(size)]
    barrier = threading.Barrier(size)
    return run_ranks(size, lambda rank: job(rank, ThreadGroup(rank, halves, barrier)))


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [DataType.FLOAT32, DataType.INT64, DataType.BFLOAT16])
@pytest.mark.parametrize("in_place", [False, True])
def test_shared_memory_packed_allreduce(size: int, dtype: DataType, in_place: bool) -> None:
    # Tensors of ragged lengths (one empty) over staging halves of 1 KiB: rounds and
    # shares end mid-tensor. Rank 1 joined (no input for tensor 2), rank 0 drops tensor 3.
    from hora.collectives import shm_ops
    from hora.collectives.reduce import scale

    lengths = [300, 0, 517, 64, 1000, 3]
    storage = np.dtype(np.uint16) if dtype == DataType.BFLOAT16 else np.dtype(dtype.name.lower())
    total = reducer(SUM, dtype)

    def contribution(rank: int, index: int) -> np.ndarray:
        values = (np.arange(lengths[index]) % 13 + rank * 3 + index).astype(np.float32)
        if dtype == DataType.BFLOAT16:
            return (values.view(np.uint32) >> 16).astype(np.uint16)  # small integers: exact in bfloat16
        return values.astype(storage)

    def job(rank: int, group: ThreadGroup) -> list[np.ndarray | None]:
        inputs: list[np.ndarray | None] = [contribution(rank, i) for i in range(len(lengths))]
        if rank == 1:
            inputs[2] = None
        outputs: list[np.ndarray | None] = [
            x if in_place and x is not None else np.full(k, 99, dtype=storage) for x, k in zip(inputs, lengths)
        ]
        if rank == 0:
            outputs[3] = None
        prescale = None if dtype != DataType.FLOAT32 else (lambda piece: scale(piece, 2.0, dtype))
        shm_ops.allreduce_packed(
            group, inputs, outputs, lengths, storage, total, prescale, lambda piece: scale(piece, 0.5, dtype)
        )
        return outputs

    results = run_shared(size, 1024, job)
    factor = 1.0 if dtype == DataType.FLOAT32 else 0.5
    for index, length in enumerate(lengths):
        ranks = [r for r in range(size) if not (r == 1 and index == 2)]
        want = sum(contribution(r, index).astype(np.float64) for r in ranks) if length else np.zeros(0)
        if dtype == DataType.BFLOAT16:
            want = sum(
                (contribution(r, index).astype(np.uint32) << 16).view(np.float32).astype(np.float64) for r in ranks
            ) if length else np.zeros(0)
        for rank, outputs in enumerate(results):
            got = outputs[index]
            if rank == 0 and index == 3:
                assert got is None
                continue
            assert got is not None
            if dtype == DataType.BFLOAT16:
                got = (got.astype(np.uint32) << 16).view(np.float32)
            expected = np.trunc(want * factor) if dtype == DataType.INT64 else want * factor
            assert np.array_equal(got.astype(np.float64), expected), f"rank {rank}, tensor {index}"
            assert np.array_equal(outputs[index], results[size - 1][index])  # bit-identical on every rank


def test_packed_windows_hold_each_tensors_part_of_each_window() -> None:
    # The packed allreduce lays out all its rounds in one pass over the tensors; each
    # window's parts must be the overlap of that window with each tensor, in order.
    from hora.collectives import shm_ops

    def alone(lengths: list[int], start: int, count: int) -> list[tuple[int, int, int, int]]:
        parts, position = [], 0
        for index, length in enumerate(lengths):
            lo, hi = max(start, position), min(start + count, position + length)
            if lo < hi:
                parts.append((index, lo - position, lo - start, hi - lo))
            position += length
        return parts

    rng = np.random.default_rng(7)
    for _ in range(300):
        lengths = [int(k) for k in rng.choice([0, 1, 2, 5, 17, 64, 100, 1000], size=int(rng.integers(1, 12)))]
        step = int(rng.choice([1, 3, 16, 64, 100, 1024]))
        total = sum(lengths)
        want = [alone(lengths, start, min(step, total - start)) for start in range(0, total, step)]
        assert shm_ops._windows(lengths, step) == want, (lengths, step)


class SerialRanks:
    """Thread ranks that run one at a time between barriers, in a fresh random order
    after every barrier. A collective that is correct under every such order has no
    rank write memory that another reads between the same two barriers (the order would
    decide what the reader saw), so a few random orders find such a race for certain
    where free-running threads find it by luck."""

    def __init__(self, size: int, seed: int) -> None:
        self._size, self._rng = size, np.random.default_rng(seed)
        self._cond = threading.Condition()
        self._order, self._turn, self._epoch = self._shuffled(), 0, 0

    def _shuffled(self) -> list[int]:
        return [int(r) for r in self._rng.permutation(self._size)]

    def _wait_turn(self, rank: int, epoch: int) -> None:
        assert self._cond.wait_for(lambda: self._epoch >= epoch and self._order[self._turn] == rank, timeout=10)

    def _pass_turn(self) -> None:
        self._turn += 1
        if self._turn == self._size:  # every rank reached the barrier: the next round's order
            self._order, self._turn, self._epoch = self._shuffled(), 0, self._epoch + 1
        self._cond.notify_all()

    def enter(self, rank: int) -> None:
        with self._cond:
            self._wait_turn(rank, 0)

    def barrier(self, rank: int) -> None:
        with self._cond:
            epoch = self._epoch
            self._pass_turn()
            self._wait_turn(rank, epoch + 1)

    def leave(self) -> None:
        with self._cond:
            self._pass_turn()


class SerialGroup(ThreadGroup):
    def __init__(self, rank: int, halves: list[list[np.ndarray]], serial: SerialRanks) -> None:
        super().__init__(rank, halves, threading.Barrier(1))
        self._serial = serial

    def barrier(self) -> None:
        self._serial.barrier(self.rank)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_shared_memory_allreduce_has_no_race_between_barriers(size: int, packed: bool) -> None:
    # 1 KiB halves: 256 float32 per round; 1000 elements make 4 rounds, the last one short.
    from hora.collectives import shm_ops
    from hora.collectives.reduce import scale

    lengths = [1000] if not packed else [300, 517, 64, 3, 116]
    total = sum(lengths)
    for seed in range(12):
        serial = SerialRanks(size, seed)
        halves = [[np.full(1024, 0xEE, dtype=np.uint8) for _ in range(2)] for _ in range(size)]

        def job(rank: int) -> list[np.ndarray]:
            flat = (np.arange(total) % 29 + 7 * rank).astype(np.float32)
            group = SerialGroup(rank, halves, serial)
            serial.enter(rank)
            try:
                if packed:
                    parts = np.split(flat, np.cumsum(lengths)[:-1])
                    outputs = [np.full(n, 99, dtype=np.float32) for n in lengths]
                    shm_ops.allreduce_packed(
                        group, list(parts), list(outputs), lengths, np.dtype(np.float32), reducer(SUM, DataType.FLOAT32),
                        None, lambda piece: scale(piece, 0.5, DataType.FLOAT32),
                    )  # fmt: skip
                    return outputs
                shm_ops.allreduce(group, flat, reducer(SUM, DataType.FLOAT32), lambda piece: scale(piece, 0.5, DataType.FLOAT32))
                return [flat]
            finally:
                serial.leave()

        results = run_ranks(size, job)
        want = sum((np.arange(total) % 29 + 7 * r).astype(np.float64) for r in range(size)) * 0.5
        for rank, outputs in enumerate(results):
            got = np.concatenate(outputs)  # type: ignore[arg-type]
            assert np.array_equal(got, want), f"seed {seed}, rank {rank}"
