"""The fast lane: cached allreduces agreed, and small ones reduced, through shared memory.

When every rank of the job shares this machine, an allreduce of a tensor the response
cache knows (same name and parameters as a negotiated one), small enough for a lane
slot (``data_limit``: 256 KiB, less from five ranks on, so that no rank reads more than
``READ_BUDGET`` to settle it), skips the coordinator: each rank writes a *proposal*
(the tensor's cache id and its data) into its own lane slot, and once every rank has
written one for the same slot number, each sums every rank's data, in rank order, into
its output. No control frame, no response, no executor, no barrier: one write and one
wait. Anything the lane cannot settle falls back, on every rank alike, to the
coordinator's path.

Larger cached allreduces, whole grouped calls of any size, and batches of lone cached
allreduces announced together (a burst of asynchronous calls, or a ``Runtime.batch``) are
proposed *by id*: the slot holds the tensors' cache ids instead of their data, and once
every rank proposed the same ids, each builds the response the coordinator would have
sent (``response``) and runs it through its executor, data phase and all. Since a data
phase synchronizes the ranks, every rank must run it at the same point of the response
sequence; the rules for that are under "Invariants".

Protocol. Entries are numbered. Every rank writes entries 1, 2, 3... in order, each
either a proposal or a refusal ("no"), into slot ``seq % 2`` of its own segment (one
writer per slot: no atomic operations; like the barriers this relies on x86-64's store
order, and the fields go in before the number, so a reader that sees the number sees
them). An entry's outcome is the same on every rank:

* success when every rank proposed the same cache id and size;
* failure as soon as one rank refused, two proposals differ, or a rank that wrote
  nothing has left (shutdown); then each proposer's tensor goes the coordinator's way.

Invariants:

* A rank writes entry ``t`` only once every rank has written entry ``t - 1`` (a
  proposer checks; a refusal answers an entry someone proposed, so the check was made),
  and it settles ``t - 1`` (reading the data on success) before it writes ``t``. So
  slot ``t % 2`` is rewritten only after every rank has finished with entry ``t - 2``.
* A rank with collectives in flight on the coordinator's path is *busy* and refuses
  every proposal it sees: the proposal may be for a tensor it sent the coordinator's
  way, and neither path would then finish. A proposer wakes busy ranks (a wake-up byte
  on the domain's socket), which refuse if they are still busy when they look. A rank
  that is not busy writes nothing until its own next allreduce: that one either matches
  the proposal or, differing, fails it.
* By-id proposals keep data phases in one order on every rank. A rank proposes by id
  only with nothing else in flight, no response waiting to run, only the global
  process set known, and no autotune (whose parameter changes come from rank 0 alone,
  outside the order below); it settles a by-id proposal (running it on success) before
  it runs the next response. For a successful entry t and a response R with a data phase
  (every rank runs it, none finishes before all have started): each rank proposed t
  before submitting R's tensor or after R finished on it. All before: R's response
  exists only after every proposal, so every rank sees t settled before R and runs t
  first. One after: R started everywhere before that proposal existed, so no rank saw t
  settled at R, and all run R first. With another process set known, a member could run
  the set's collective while a non-member's proposal completes t for another member,
  who would run t first: hence that rule. Besides, a rank with collectives in flight
  refuses any by-id proposal it sees before it runs a response (``refuse_by_id``;
  refusing is always safe).
* A rank that waits for entries sleeps with a *watch* flag set; whoever writes an entry
  wakes the ranks whose flag is set. Flag and entry form a pair on each side (set mine,
  then read yours), which x86-64 may reorder (a store may wait in a buffer past a later
  load), so each side puts a full fence between them (a lock taken and released: a
  locked instruction), and then at least one side sees the other's write. The same holds
  for busy flags and proposals. Waits still wake now and then (``recheck_ms``, doubling
  up to a second) to report a stall and, defensively, to look again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from hora.collectives.reduce import DataType, Reducer, reducer, scale
from hora.config import Config
from hora.engine.coordinator import Stall
from hora.engine.messages import RequestType, Response, ResponseType
from hora.engine.queue import Entry
from hora.engine.stall import StallInspector
from hora.transport.shm import LANE_DATA_BYTES, Domain

# Flags (the lane's int64 meta fields of each rank's segment).
_WRITTEN = 0  # the number of the last entry this rank wrote
_BUSY = 1  # 1 while this rank has collectives in flight on the coordinator's path
_LEFT = 2  # 1 once this rank has shut down: it writes nothing more
_WATCH_CALLER = 3  # 1 while a user thread of this rank sleeps waiting for entries
_WATCH_ENGINE = 4  # 1 while the engine thread of this rank sleeps waiting for entries
# A slot's header fields.
_SEQ = 0  # the entry's number, written last
_VERDICT = 1  # the proposed cache id, or _NO
_NBYTES = 2  # the proposal's size in bytes
_COUNT = 3  # a by-id proposal's number of cache ids (its data area holds them); 0 for data
_NO = -1

MAX_IDS = LANE_DATA_BYTES // 8  # the most tensors one by-id proposal names
# What one rank may read to settle a data proposal (every rank's data, n times the tensor):
# past it, the staged algorithm's barriers cost less than the reads (hora.collectives.shm_ops).
READ_BUDGET = 1 << 20

_RECHECK_MIN_MS = 2.0
_RECHECK_MAX_MS = 1000.0


class Proposal:
    """This rank's entry that awaits the others' (its fields never change once made).

    ``count`` is 0 for a proposal with the tensor's data, else the number of cache ids
    it names (``cache_ids``, one per entry, in order).
    """

    __slots__ = ("cache_ids", "count", "entries", "nbytes", "seq", "since")

    def __init__(self, seq: int, entries: list[Entry], cache_ids: list[int], nbytes: int, count: int) -> None:
        self.seq = seq
        self.entries = entries
        self.cache_ids = cache_ids
        self.nbytes = nbytes
        self.count = count
        self.since = time.monotonic()

    @property
    def entry(self) -> Entry:
        """The first (for a data proposal, the only) entry."""
        return self.entries[0]


class FastLane:
    """This rank's side of the fast lane. Used only by the thread holding the engine's lock.

    Args:
        domain: the shared memory of the job's ranks, which must be every rank of the job.
        config: supplies the stall warning and shutdown times.
    """

    def __init__(self, domain: Domain, config: Config) -> None:
        self._domain = domain
        # The same on every rank (one slot size, one job size): ranks agree on which way a
        # tensor goes, with its data or by id.
        self.data_limit = min(LANE_DATA_BYTES, READ_BUDGET // len(domain.ranks))
        # A batch of lone allreduces runs as one fused response: no more than the
        # coordinator would fuse (autotune, which changes the threshold, proposes nothing
        # by id).
        self._batch_bytes = config.fusion_threshold
        lanes = {rank: domain.lane(rank) for rank in domain.ranks}
        flags = {rank: lane[0] for rank, lane in lanes.items()}
        headers = {rank: [lane[1][slot][0] for slot in (0, 1)] for rank, lane in lanes.items()}
        self._flags = flags[domain.me]
        self._headers = headers[domain.me]
        self._peers = [rank for rank in domain.ranks if rank != domain.me]
        self._peer_flags = [flags[rank] for rank in self._peers]
        # By slot: each peer's header, and every rank's data in rank order.
        self._peer_headers = [[headers[rank][slot] for rank in self._peers] for slot in (0, 1)]
        self._data = [[lanes[rank][1][slot][1] for rank in domain.ranks] for slot in (0, 1)]
        self._reducers: dict[tuple[int, DataType], Reducer] = {}
        self.pending: Proposal | None = None
        self.succeeded = 0  # proposals that succeeded (for tests and diagnostics)
        self._left = False
        self._recheck_ms = _RECHECK_MIN_MS
        self._next_recheck = 0.0
        self._stall = StallInspector(config)

    def carries(self, entry: Entry) -> bool:
        """True for a tensor the lane carries with its data: a lone allreduce of the global
        set of at most ``data_limit`` bytes."""
        request = entry.request
        return (
            request.type == RequestType.ALLREDUCE
            and request.process_set_id == 0
            and not request.group
            and entry.input is not None
            and entry.output is not None
            and entry.input.nbytes <= self.data_limit
        )

    def carries_by_id(self, entries: Sequence[Entry]) -> bool:
        """True for tensors the lane can agree on by id: a lone allreduce of the global set
        over ``data_limit`` bytes, a whole grouped call of allreduces of the global set, or
        a batch of lone ones announced together (a burst of ``allreduce_async`` calls) of at
        most the fusion threshold, alike in data type, reduce op and scale factors (they run
        fused, as the coordinator would fuse them). Ranks whose batches differ fail the
        proposal, and every tensor of it goes the coordinator's way."""
        if not entries or len(entries) > MAX_IDS:
            return False
        first = entries[0].request
        nbytes = 0
        for entry in entries:
            request = entry.request
            if (
                request.type != RequestType.ALLREDUCE
                or request.process_set_id != 0
                or entry.input is None
                or entry.output is None
                or request.group != first.group
                or (request.dtype, request.reduce_op, request.prescale, request.postscale)
                != (first.dtype, first.reduce_op, first.prescale, first.postscale)
            ):
                return False
            nbytes += entry.input.nbytes
        if first.group:
            return len(entries) == first.group_size
        if len(entries) == 1:
            return nbytes > self.data_limit
        return nbytes <= self._batch_bytes

    @staticmethod
    def response(proposal: Proposal) -> Response:
        """What the coordinator would send for a by-id proposal that succeeded: one
        allreduce of its tensors, fused in order (the same on every rank, since every
        rank proposed the same ids, each standing for the same validated request)."""
        first = proposal.entry.request
        return Response(
            ResponseType.ALLREDUCE,
            [entry.request.name for entry in proposal.entries],
            0,
            dtype=first.dtype,
            reduce_op=first.reduce_op,
            prescale=first.prescale,
            postscale=first.postscale,
            sizes=[0 if entry.input is None else entry.input.size for entry in proposal.entries],
            cache_ids=list(proposal.cache_ids),
        )

    # ----- proposing -----

    def propose(self, entries: list[Entry], cache_ids: list[int], by_id: bool) -> bool:
        """Writes a proposal for ``entries`` (cached under ``cache_ids``) if the lane is open.

        Args:
            entries: one tensor ``carries`` accepts, or tensors ``carries_by_id`` accepts.
            cache_ids: their cache ids, in order.
            by_id: propose the ids alone (the data goes through the executor on success).

        Returns:
            False when it is not (a proposal pending, a rank gone, or a rank still
            behind): no proposal was written, and the tensors go the coordinator's way.
            A busy rank is proposed to all the same: it is usually just finishing its
            last collective, and then answers with its own proposal; if not, it refuses.
        """
        if self.pending is not None or self._left:
            return False
        for flags in self._peer_flags:
            if flags[_LEFT]:
                return False
        seq = self._catch_up()
        for flags in self._peer_flags:
            if flags[_WRITTEN] < seq - 1:
                return False
        header = self._headers[seq % 2]
        mine = self._data[seq % 2][self._domain.index]
        if by_id:
            count = len(cache_ids)
            mine[: 8 * count].view(np.int64)[:] = cache_ids
            nbytes = sum(0 if entry.input is None else entry.input.nbytes for entry in entries)
        else:
            entry = entries[0]
            assert entry.input is not None  # invariant: carries()
            count, nbytes = 0, entry.input.nbytes
            view = mine[:nbytes].view(entry.input.dtype)
            view[...] = entry.input
            scale(view, entry.request.prescale, entry.dtype)
        header[_VERDICT] = cache_ids[0]
        header[_NBYTES] = nbytes
        header[_COUNT] = count
        self._publish(header, seq)
        self.pending = Proposal(seq, list(entries), list(cache_ids), nbytes, count)
        self._recheck_ms = _RECHECK_MIN_MS
        self._next_recheck = time.perf_counter() + _RECHECK_MIN_MS / 1000.0
        self._wake_busy()  # each refuses, unless it finds itself idle by then (see serve)
        return True

    def _catch_up(self) -> int:
        """Refuses every entry already doomed by others' entries; returns the next entry's number."""
        seq = self._flags[_WRITTEN] + 1
        while True:
            verdicts = [h[_VERDICT] for h in self._peer_headers[seq % 2] if h[_SEQ] == seq]
            if not verdicts or (_NO not in verdicts and len(set(verdicts)) == 1):
                return seq
            self._refuse(seq)
            seq += 1

    def _refuse(self, seq: int) -> None:
        header = self._headers[seq % 2]
        header[_VERDICT] = _NO
        header[_NBYTES] = 0
        header[_COUNT] = 0
        self._publish(header, seq)

    def _publish(self, header: memoryview, seq: int) -> None:
        """Numbers the entry (its fields are in place) and wakes the ranks that watch."""
        header[_SEQ] = seq
        self._flags[_WRITTEN] = seq
        self._wake_watchers()

    def _wake_watchers(self) -> None:
        self._fence()
        for rank, flags in zip(self._peers, self._peer_flags):
            if flags[_WATCH_CALLER] or flags[_WATCH_ENGINE]:
                self._domain.send_wake(rank)

    # ----- settling -----

    def settled(self) -> bool:
        """True when the pending proposal's outcome is known (cheap: read while spinning)."""
        pending = self.pending
        return pending is not None and self._outcome(pending) is not None

    def settled_for(self, proposal: Proposal) -> bool:
        """True when ``proposal``'s outcome is known. Reads only shared memory and the
        proposal (fixed once made), so a thread without the engine's lock may call it,
        with a proposal published to it (``ControlPlane.published``)."""
        return self._outcome(proposal) is not None

    def _outcome(self, proposal: Proposal) -> bool | None:
        """Success, failure, or None while some rank has not answered (and has not left)."""
        seq = proposal.seq
        waiting = False
        for header, flags in zip(self._peer_headers[seq % 2], self._peer_flags):
            if header[_SEQ] != seq:
                if flags[_LEFT]:
                    return False
                waiting = True
            elif (
                header[_VERDICT] != proposal.cache_ids[0]
                or header[_NBYTES] != proposal.nbytes
                or header[_COUNT] != proposal.count
            ):
                return False
        if waiting:
            return None
        if proposal.count > 1:  # the first ids agree: so must the rest (fields before number)
            data, size = self._data[seq % 2], 8 * proposal.count
            mine = data[self._domain.index][:size].tobytes()  # bytes compare: a fraction of array_equal's cost
            return all(theirs[:size].tobytes() == mine for theirs in data)
        return True

    def settle(self) -> tuple[Proposal, bool] | None:
        """Settles the pending proposal if every rank has answered it.

        On success of a data proposal, writes the reduced tensor into the entry's output
        (the caller completes its handle); a by-id proposal's response is the caller's
        to run (``response``).

        Returns:
            None while it waits; otherwise the proposal and whether it succeeded (when
            not, its tensors go the coordinator's way).

        Raises:
            hora.engine.stall.StalledError: it waited past the stall shutdown time.
        """
        proposal = self.pending
        if proposal is None:
            return None
        outcome = self._outcome(proposal)
        if outcome is None:
            self._recheck(proposal)
            return None
        self.pending = None
        seq, entry = proposal.seq, proposal.entry
        if not outcome:
            return proposal, False
        self.succeeded += 1
        if proposal.count:
            return proposal, True
        assert entry.output is not None and entry.input is not None  # invariant: carries()
        # Every rank sums the same bytes in the same order: bit-identical results.
        dtype, nbytes = entry.input.dtype, proposal.nbytes
        data = self._data[seq % 2]
        out = entry.output
        out[...] = data[0][:nbytes].view(dtype)
        key = (entry.request.reduce_op, entry.dtype)
        reduce = self._reducers.get(key)
        if reduce is None:
            reduce = self._reducers[key] = reducer(*key)
        for contribution in data[1:]:
            reduce(out, contribution[:nbytes].view(dtype))
        scale(out, entry.request.postscale, entry.dtype)
        return proposal, True

    def _recheck(self, proposal: Proposal) -> None:
        """Now and then while waiting: wakes busy ranks again, and reports a stall."""
        now = time.perf_counter()
        if now < self._next_recheck:
            return
        self._recheck_ms = min(self._recheck_ms * 2, _RECHECK_MAX_MS)
        self._next_recheck = now + self._recheck_ms / 1000.0
        self._wake_busy()
        waited = time.monotonic() - proposal.since
        if self._stall.enabled and waited >= self._stall.warn_after:
            seq = proposal.seq
            missing = [rank for rank, h in zip(self._peers, self._peer_headers[seq % 2]) if h[_SEQ] != seq]
            self._stall.report([Stall(0, proposal.entry.request.name, waited, missing)])

    def recheck_ms(self) -> float:
        """How long a wait for the pending proposal may sleep before the next recheck."""
        return max(0.0, (self._next_recheck - time.perf_counter()) * 1000.0)

    def _wake_busy(self) -> None:
        for rank, flags in zip(self._peers, self._peer_flags):
            if flags[_BUSY]:
                self._domain.send_wake(rank)

    # ----- this rank's state -----

    def serve(self, busy: bool) -> None:
        """Publishes whether this rank is busy; a busy rank refuses every proposal it sees.

        Call after ``settle`` (entries past a pending proposal cannot exist yet).
        """
        if self._left:
            return  # others no longer wait for this rank's entries
        if self._flags[_BUSY] != busy:
            self._flags[_BUSY] = int(busy)
            self._fence()
        if not busy or self.pending is not None:
            return
        seq = self._flags[_WRITTEN] + 1
        while any(h[_SEQ] == seq for h in self._peer_headers[seq % 2]):
            self._refuse(seq)
            seq += 1

    def refuse_by_id(self) -> None:
        """Refuses the next entry if a rank proposed it by id: a rank with collectives in
        flight calls this before it runs a response (see "Invariants")."""
        if self._left or self.pending is not None:
            return
        seq = self._flags[_WRITTEN] + 1
        if any(h[_SEQ] == seq and h[_COUNT] > 0 for h in self._peer_headers[seq % 2]):
            self._refuse(seq)

    def watch(self, caller: bool, on: bool) -> None:
        """Sets or clears the flag that asks writers to wake this rank's sleeping thread
        (set it before the last look at the entries)."""
        self._flags[_WATCH_CALLER if caller else _WATCH_ENGINE] = int(on)
        if on:
            self._fence()

    def _fence(self) -> None:
        """A full memory fence: this rank's stores so far are visible before its next loads."""
        self._domain.fence()

    def leave(self) -> None:
        """Marks this rank gone: others stop proposing, and fail what waits for it."""
        if not self._left:
            self._left = True
            self._flags[_LEFT] = 1
            self._flags[_BUSY] = 0
            self._wake_watchers()  # whoever waits for this rank's entry fails it now

    def close(self) -> None:
        """Drops the views of shared memory (so the domain can unmap it)."""
        for view in (self._flags, *self._headers, *self._peer_flags, *self._peer_headers[0], *self._peer_headers[1]):
            view.release()
        self._headers = []
        self._peer_flags = []
        self._peer_headers = [[], []]
        self._data = [[], []]
