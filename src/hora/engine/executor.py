"""Executes responses: moves each tensor's data through the collective and completes its handle.

Runs on the engine thread, one response at a time, in the agreed order. A response
names tensors by name; the executor takes the matching entries out of the queue. A
rank that has joined has no entry for an allreduce and contributes zeros instead.

Fused allreduces are packed into one persistent fusion buffer (grown on demand), run
as a single ring allreduce, and unpacked; a single tensor runs in its own output
buffer with no packing copy.

Invariant: an entry taken out of the queue for execution is in ``running`` until its
response has finished (its handle completed), so a response that fails midway (a lost
peer, an abort) leaves no handle that nobody completes: ``abandon`` fails the ones it
took, as ``TensorQueue.close`` fails those still queued.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hora.collectives import ring
from hora.engine.algorithms import Collectives
from hora.engine.cache import RankCache
from hora.collectives.reduce import SUM, DataType, reducer, same_memory, scale
from hora.engine.messages import Response, ResponseType
from hora.engine.process_sets import ProcessSetTable
from hora.engine.queue import Entry, TensorQueue
from hora.engine.timeline import Timeline
from hora.errors import CollectiveMismatchError, HoraInternalError


class Executor:
    """Runs responses on this rank.

    Args:
        rank: this process's global rank.
        sets: this rank's process-set table (updated as set responses execute).
        queue: the tensor queue entries are taken from.
        collectives_for: the algorithms among a process set's global ranks.
    """

    def __init__(
        self,
        rank: int,
        sets: ProcessSetTable,
        queue: TensorQueue,
        collectives_for: Callable[[tuple[int, ...]], Collectives],
    ) -> None:
        self.rank = rank
        self.sets = sets
        self.queue = queue
        self._collectives_for = collectives_for
        self.cache = RankCache()
        self.timeline: Timeline | None = None  # set while rank 0 records one
        self._fusion = np.empty(0, dtype=np.uint8)
        self.running: list[Entry] = []  # the entries the response being executed took
        self.current: Response | None = None  # the response being executed, for messages
        # Applies an autotune parameter change where the agreed sequence puts it (ControlPlane).
        self.on_params: Callable[[Response], None] = lambda response: None

    def run(self, response: Response) -> None:
        """Executes one response and completes the handles of its tensors.

        Raises:
            HoraInternalError: a peer was lost mid-collective (the job fails).
        """
        self.running.clear()  # the previous response finished: its handles are complete
        self.current = response
        kind = response.type
        if kind in (ResponseType.ERROR, ResponseType.ABORTED):
            error_type = CollectiveMismatchError if kind == ResponseType.ERROR else HoraInternalError
            for name in response.names:
                entry = self.queue.pop(response.process_set_id, name)
                if entry is not None:
                    entry.handle.fail(error_type(response.error))
            return
        if kind == ResponseType.JOIN:
            self._complete(response, "join", response.root_rank)
            return
        if kind == ResponseType.PARAMS:
            self.on_params(response)  # no tensor: every rank switches here (hora.engine.autotune)
            return
        if kind == ResponseType.ADD_PROCESS_SET:
            self.sets.add(response.root_rank, tuple(response.sizes))
            self._complete(response, response.names[0], response.root_rank)
            return
        if kind == ResponseType.REMOVE_PROCESS_SET:
            removed = self.sets.remove(response.root_rank)
            self._complete(response, response.names[0], removed)
            return
        if kind == ResponseType.BARRIER:
            self._complete(response, response.names[0], None)
            return
        # A response with data carries its result, computed by the coordinator (hora.engine.riders).
        channel = None if response.data else self._collectives_for(self.sets.ranks(response.process_set_id))
        timeline = self.timeline
        if timeline is not None:
            args = self._trace_args(response)
            label = "COORDINATOR" if channel is None else channel.label
            for name in response.names:
                timeline.begin(name, kind.name)
                timeline.begin(name, f"{label}_{kind.name}")
        if channel is None:
            self._deliver(response)
        else:
            self._execute(response, channel)
        if timeline is not None:
            for name in response.names:
                timeline.end(name)
                timeline.end(name, args.get(name))

    def _trace_args(self, response: Response) -> dict[str, dict[str, str]]:
        """The dtype and shape of each local tensor of a response, for the timeline."""
        dtype = DataType(response.dtype).label
        args = {}
        for name in response.names:
            entry = self.queue.peek(response.process_set_id, name)
            if entry is not None:
                args[name] = {"dtype": dtype, "shape": str(list(entry.shape))}
        return args

    def _execute(self, response: Response, channel: Collectives) -> None:
        kind = response.type
        if kind in (ResponseType.ALLREDUCE, ResponseType.ADASUM):
            self._allreduce(response, channel)
            return
        entry = self._take_all(response)[0]  # the other collectives are of one tensor each
        if entry is None:
            raise RuntimeError(f"hora internal error: no local tensor for {kind.name.lower()} '{response.names[0]}'")
        if kind == ResponseType.ALLGATHER:
            self._allgather(response, channel, entry)
        elif kind == ResponseType.BROADCAST:
            self._broadcast(response, channel, entry)
        elif kind == ResponseType.ALLTOALL:
            self._alltoall(response, channel, entry)
        elif kind == ResponseType.REDUCESCATTER:
            self._reducescatter(response, channel, entry)
        else:
            raise RuntimeError(f"hora internal error: cannot execute {kind.name}")

    def _deliver(self, response: Response) -> None:
        """Completes a response whose result it carries: copies each tensor's part of the
        data into the tensor's output (an allreduce's tensors lie end to end; a
        broadcast's one tensor is the root's)."""
        result = np.frombuffer(response.data, dtype=DataType(response.dtype).storage)
        offset = 0
        for index, entry in enumerate(self._take_all(response)):
            count = response.sizes[index] if response.type == ResponseType.ALLREDUCE else result.size
            if entry is not None and entry.output is not None:
                entry.output[...] = result[offset : offset + count]
                entry.handle.complete(entry.output.reshape(entry.shape))
            offset += count

    def _take_all(self, response: Response) -> list[Entry | None]:
        """Removes the entries of ``response``'s tensors (None: not this rank's), in
        order, and learns their cache ids."""
        entries = self.queue.pop_many(response.process_set_id, response.names)
        learn, ids = self.cache.learn, response.cache_ids
        for index, entry in enumerate(entries):
            if entry is not None:
                self.running.append(entry)
                if index < len(ids):
                    learn(entry.request, ids[index])
        return entries

    def describe(self) -> str:
        """Names the collective being executed, e.g. ``allreduce 'grad'`` (for messages)."""
        response = self.current
        if response is None:
            return "a collective"
        label = response.type.name.lower()
        first = response.names[0] if response.names else "?"
        if first.startswith(label + "."):
            first = first[len(label) + 1 :]
        more = f" (fused with {len(response.names) - 1} more)" if len(response.names) > 1 else ""
        return f"{label} '{first}'{more}"

    def abandon(self, error_for: Callable[[Entry], BaseException]) -> None:
        """Fails the handles of the response that was cut short (a completed one ignores it)."""
        running, self.running = self.running, []
        for entry in running:
            entry.handle.fail(error_for(entry))

    def _complete(self, response: Response, name: str, result: object) -> None:
        entry = self.queue.pop(response.process_set_id, name)
        if entry is not None:
            entry.handle.complete(result)

    def _buffer(self, attribute: str, count: int, dtype: np.dtype[np.generic]) -> np.ndarray:
        """Returns ``count`` elements of a persistent byte buffer, grown as needed."""
        raw: np.ndarray = getattr(self, attribute)
        nbytes = count * dtype.itemsize
        if raw.size < nbytes:
            raw = np.empty(max(nbytes, raw.size * 2), dtype=np.uint8)
            setattr(self, attribute, raw)
        return raw[:nbytes].view(dtype)

    def _allreduce(self, response: Response, channel: Collectives) -> None:
        """Allreduce or Adasum of one or more tensors (fused when several)."""
        dtype = DataType(response.dtype)
        reduce = reducer(SUM if response.type == ResponseType.ADASUM else response.reduce_op, dtype)
        entries = self._take_all(response)

        def postscale(part: np.ndarray) -> None:
            scale(part, response.postscale, dtype)

        if response.type == ResponseType.ALLREDUCE and len(entries) > 1 and channel.allreduce_packed(
            [None if entry is None else entry.input for entry in entries],
            [None if entry is None else entry.output for entry in entries],
            response.sizes,
            dtype.storage,
            reduce,
            None if response.prescale == 1.0 else lambda piece: scale(piece, response.prescale, dtype),
            postscale,
        ):
            for entry in entries:
                if entry is not None and entry.output is not None:
                    entry.handle.complete(entry.output.reshape(entry.shape))
            return
        only = entries[0] if len(entries) == 1 else None
        if only is not None and only.output is not None and only.input is not None:
            # One tensor: reduce in its own output buffer, no packing copy.
            fused = False
            buffer = only.output
            if not same_memory(buffer, only.input):
                np.copyto(buffer, only.input)
        else:
            # Invariant: the fusion buffer is this executor's own, so it aliases no
            # tensor; packing and unpacking copy every one. Slice assignment rather than
            # ``np.copyto``, whose argument parsing costs 1 us a tensor.
            fused = True
            buffer = self._buffer("_fusion", sum(response.sizes), dtype.storage)
            offset = 0
            for entry, count in zip(entries, response.sizes):
                if entry is None or entry.input is None:
                    buffer[offset : offset + count] = 0  # this rank joined: it contributes zeros
                else:
                    buffer[offset : offset + count] = entry.input
                offset += count
        scale(buffer, response.prescale, dtype)
        if response.type == ResponseType.ADASUM:
            channel.adasum(buffer, ring.bounds_from_lengths(response.sizes))
            scale(buffer, response.postscale, dtype)
        else:
            channel.allreduce(buffer, reduce, postscale)
        offset = 0
        for entry, count in zip(entries, response.sizes):
            if entry is not None and entry.output is not None:
                if fused:
                    entry.output[...] = buffer[offset : offset + count]
                entry.handle.complete(entry.output.reshape(entry.shape))
            offset += count

    def _allgather(self, response: Response, channel: Collectives, entry: Entry) -> None:
        assert entry.input is not None  # invariant: allgather entries carry data
        dims = response.sizes
        row = _row_size(entry.shape)
        bounds = ring.bounds_from_lengths([d * row for d in dims])
        output = np.empty(sum(dims) * row, dtype=entry.input.dtype)
        offset, length = bounds[channel.rank]
        output[offset : offset + length] = entry.input
        channel.allgather(output, bounds)
        entry.handle.complete(output.reshape((sum(dims), *entry.shape[1:])))

    def _broadcast(self, response: Response, channel: Collectives, entry: Entry) -> None:
        assert entry.input is not None and entry.output is not None  # invariant: set at enqueue
        root = self.sets.ranks(response.process_set_id).index(response.root_rank)  # global -> set rank
        if channel.rank == root and not same_memory(entry.output, entry.input):
            np.copyto(entry.output, entry.input)
        channel.broadcast(entry.output, root)
        entry.handle.complete(entry.output.reshape(entry.shape))

    def _alltoall(self, response: Response, channel: Collectives, entry: Entry) -> None:
        assert entry.input is not None  # invariant: alltoall entries carry data
        n, me = channel.size, channel.rank
        matrix = np.asarray(response.sizes, dtype=np.int64).reshape(n, n)
        row = _row_size(entry.shape)
        received = matrix[:, me]
        output = np.empty(int(received.sum()) * row, dtype=entry.input.dtype)
        channel.alltoall(entry.input, [int(c) * row for c in matrix[me]], output, [int(c) * row for c in received])
        result = output.reshape((int(received.sum()), *entry.shape[1:]))
        entry.handle.complete((result, received.astype(np.int32)))

    def _reducescatter(self, response: Response, channel: Collectives, entry: Entry) -> None:
        assert entry.input is not None  # invariant: reducescatter entries carry data
        dtype = DataType(response.dtype)
        n = channel.size
        rows = entry.shape[0] if entry.shape else 1
        row = _row_size(entry.shape)
        counts = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
        bounds = ring.bounds_from_lengths([c * row for c in counts])
        data = entry.input
        if response.prescale != 1.0 or not channel.reads_only:
            # The algorithm (or the prescaling) writes into its input: work on a copy.
            data = self._buffer("_fusion", entry.input.size, dtype.storage)
            np.copyto(data, entry.input)
            scale(data, response.prescale, dtype)
        output = np.empty(bounds[channel.rank][1], dtype=dtype.storage)
        channel.reduce_scatter(data, bounds, reducer(response.reduce_op, dtype), output)
        scale(output, response.postscale, dtype)
        entry.handle.complete(output.reshape((counts[channel.rank], *entry.shape[1:])))


def _row_size(shape: tuple[int, ...]) -> int:
    size = 1
    for dim in shape[1:]:
        size *= dim
    return size
