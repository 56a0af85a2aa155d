"""The TCP path's algorithms at every world size, in one process: ranks are threads.

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


def run_threads(size: int, fn: Callable[[ThreadChannel], object]) -> list[object]:
    """``fn(channel)`` on ``size`` thread ranks; their results by rank (re-raising a failure)."""
    queues: dict[tuple[int, int], queue.Queue[np.ndarray]] = {
        (a, b): queue.Queue() for a in range(size) for b in range(size) if a != b
    }
    results: list[object] = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            results[rank] = fn(ThreadChannel(rank, size, queues))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
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
