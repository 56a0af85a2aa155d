"""The coordinator: decides which collectives run, and in which order, for the whole job.

Rank 0 runs one coordinator for every process set. Each rank reports the tensors it
submits; when a tensor has been submitted by every member of its set that has not
joined, the coordinator validates the requests (``validate.construct``) and appends a
response to one global sequence. Each rank receives the subsequence of responses for
the sets it belongs to.

Invariant: every rank executes its responses in the order of the global sequence.
Any two ranks therefore execute the collectives they share in the same order, so the
data on the link between them never interleaves, and no cycle of waits can form
(the earliest unfinished response always has all its members ready to run it).

Grouped tensors (``grouped_allreduce`` and friends) are held back until the whole group
is ready and then released together, so they fuse. A rank's group arrives at once
(``submit_many``), so once one of its tensors is ready every member has sent its whole
group: a group whose sizes differ across ranks fails, all of it, on every rank.

Mismatched collectives that no check can see (a barrier on one rank and an allreduce on
another, one name used for an allreduce here and an allgather there) are found as a
deadlock: a rank reports itself *stuck* when every thread that submits collectives there
waits for one, having received every response sent to it (``note_stuck``). Once stuck
ranks wait only for tensors that stuck ranks have not submitted, none of them can ever
move again, so after ``MISMATCH_GRACE`` seconds their tensors fail on every rank with a
message that lists what each one waits for (``find_mismatches``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from hora.engine import fusion, validate
from hora.engine.cache import CoordinatorCache
from hora.engine.messages import Request, RequestType, Response, ResponseType, split_name, tensor_label
from hora.engine.process_sets import ProcessSetTable
from hora.engine.riders import Riding, computed_results
from hora.engine.timeline import Timeline
from hora.errors import ProtocolError

GLOBAL = 0
# Seconds a set of stuck ranks must stay stuck before their collectives fail as
# mismatched: a thread that never submitted before may still be about to.
MISMATCH_GRACE = 1.0
# The most tensors one rank may have waiting here for the others: hora's own ranks never
# come near it (TensorQueue.MAX_IN_FLIGHT refuses more locally); a peer that sends more is
# broken, and the job fails naming it rather than rank 0 running out of memory.
MAX_PENDING_PER_RANK = 1 << 16


@dataclasses.dataclass
class _Pending:
    requests: dict[int, Request]
    first_seen: float
    cached: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> cache id it sent
    riders: dict[int, bytes] = dataclasses.field(default_factory=dict)  # rank -> data it sent along

    def waited_for(self) -> bool:
        """Whether a rank waits for this tensor: it submitted it, rather than refused it."""
        return not all(request.error for request in self.requests.values())


@dataclasses.dataclass
class Stall:
    """A tensor some ranks submitted long ago and others have not."""

    process_set_id: int
    name: str
    waited: float
    missing: list[int]


class Coordinator:
    """Negotiation state of the job, kept by rank 0.

    Args:
        size: the number of ranks in the job.
        fusion_threshold: the largest fused allreduce in bytes (0 disables fusion).
        cache_capacity: how many tensors the response cache holds (0 disables it).
        clock: returns seconds; injectable for tests.
    """

    def __init__(
        self,
        size: int,
        fusion_threshold: int,
        cache_capacity: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.size = size
        self.cache = CoordinatorCache(cache_capacity)
        self.sets = ProcessSetTable(size)
        self._fusion_threshold = fusion_threshold
        self._clock = clock
        self._pending: dict[tuple[int, str], _Pending] = {}
        self._groups: dict[tuple[int, str], list[Response]] = {}
        self._ready: list[tuple[Response, tuple[int, ...]]] = []
        # Ready responses whose results the coordinator computes from riders, all at once
        # in ``take`` (``riders.computed_results``).
        self._riding: list[Riding] = []
        self._joined: set[int] = set()
        self._departed: dict[int, str] = {}  # ranks that left, and how; collectives needing them fail
        self._last_joined = -1
        self._next_set_id = 1
        self._sent = [0] * size  # responses handed out for each rank (see take)
        self._waiting_of = [0] * size  # pending tensors each rank submitted (bounded)
        self._stuck: dict[int, float] = {}  # rank -> when it reported itself stuck (see note_stuck)
        self._examine_at: float | None = None  # when find_mismatches next has something to look at
        self.timeline: Timeline | None = None  # set while rank 0 records one

    @property
    def fusion_threshold(self) -> int:
        """The largest fused allreduce in bytes (0: no fusion); the autotuner changes it."""
        return self._fusion_threshold

    def emit_to_all(self, response: Response) -> None:
        """Appends a response for every rank still in the job (an autotune change) to the
        global sequence, after everything ready so far."""
        members = tuple(rank for rank in self.sets.ranks(GLOBAL) if rank not in self._departed)
        self._emit(response, members)

    def set_fusion_threshold(self, threshold: int) -> None:
        """Fuses with ``threshold`` from the next ``take`` on (rank 0 alone fuses)."""
        self._fusion_threshold = threshold

    def submit_cached(self, rank: int, cache_id: int) -> None:
        """Records that ``rank`` submitted, unchanged, the tensor cached under ``cache_id``.

        Raises:
            ProtocolError: the id is unknown for this rank.
        """
        self.submit_many([], [cache_id], rank)

    def submit_many(
        self, requests: Sequence[Request], cached: Sequence[int] = (), rank: int = -1, riders: Sequence[bytes] = ()
    ) -> None:
        """Records what ``rank`` submitted at once (full requests, and tensors it sent by
        cache id), then checks what became ready: a rank's grouped call is thus whole
        here before any of its tensors is validated.

        Args:
            riders: empty, or the data sent along with each tensor, full requests first
                (``hora.engine.riders``; empty bytes for none).

        Raises:
            ProtocolError: a cache id is unknown for ``rank``.
        """
        submitted = list(requests)
        recorded = [self._record(request) for request in requests]
        for cache_id in cached:
            try:
                request = self.cache.request(rank, cache_id)
            except (IndexError, KeyError):
                raise ProtocolError(f"unknown cache id {cache_id} from rank {rank}") from None
            submitted.append(request)
            recorded.append(self._record(request, cache_id))
        for request, found, rider in zip(submitted, recorded, riders):
            if found is not None and rider:
                found[1].riders[request.rank] = rider
        for found in recorded:
            # A tensor that an earlier one's failure took away (its group) is gone.
            if found is not None and self._pending.get(found[0]) is found[1]:
                self._check_ready(*found)

    def submit(self, request: Request, cache_id: int = -1) -> None:
        """Records one rank's request; what becomes ready is returned by ``take``."""
        found = self._record(request, cache_id)
        if found is not None:
            self._check_ready(*found)

    def _record(self, request: Request, cache_id: int = -1) -> tuple[tuple[int, str], _Pending, tuple[int, ...]] | None:
        """Files one request; returns where it went, or None when it was answered at once."""
        self._stuck.pop(request.rank, None)  # a rank that submits is not stuck
        if request.type == RequestType.JOIN:
            self._join(request.rank)
            return None
        members = self.sets.get(request.process_set_id)
        if members is None or request.rank not in members:
            # The rank checked this locally; a race with remove_process_set can still land here.
            error = f"{request.label}: process set {request.process_set_id} does not exist"
            error += "" if members is None else f" or does not include rank {request.rank}"
            self._emit(Response(ResponseType.ERROR, [request.name], request.process_set_id, error=error), (request.rank,))
            return None
        gone = self._departed.keys() & set(members) if self._departed else None
        if gone:
            self._emit(self._aborted(request.label, request.name, request.process_set_id, gone), (request.rank,))
            return None
        key = (request.process_set_id, request.name)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending({}, self._clock())
            if self.timeline is not None:
                self.timeline.begin(request.name, f"NEGOTIATE_{request.type.name}")
        if self.timeline is not None:
            self.timeline.tick(request.name, str(request.rank))
        if request.scope and not request.error:
            self._retire_stale_refusals(key, pending, request.scope)
        if request.rank not in pending.requests:
            if self._waiting_of[request.rank] >= MAX_PENDING_PER_RANK:
                raise ProtocolError(
                    f"more than {MAX_PENDING_PER_RANK} of its collectives wait for other ranks at the coordinator"
                )
            self._waiting_of[request.rank] += 1
        pending.requests[request.rank] = request
        if cache_id >= 0:
            pending.cached[request.rank] = cache_id
        return key, pending, members

    def _retire_stale_refusals(self, key: tuple[int, str], pending: _Pending, scope: int) -> None:
        """Drops the refusals of ``pending`` sent while ranks built an earlier TF1 graph
        than ``scope``, the graph of a request that just came under the same name.

        In a TF1 graph a collective is named when its op is built, and names restart in
        every graph. A rank whose checks fail while it builds an op refuses it at once,
        so that the others' op fails when it runs; when they never run it, the refusal
        would wait here and fail the op of the same name in a later graph instead (and
        the refusing rank, which ran that op, would wait for ever). Every rank builds
        the same graphs in the same order, so a request from a later graph means the
        refused op is one that nobody will run.
        """
        for rank, other in list(pending.requests.items()):
            if other.error and 0 < other.scope < scope:
                del pending.requests[rank]
                self._waiting_of[rank] -= 1
        if not pending.requests:
            # For stall warnings the tensor is new: it goes to the end (see next_deadline).
            pending.first_seen = self._clock()
            del self._pending[key]
            self._pending[key] = pending

    def depart(self, rank: int, how: str = "has shut down") -> None:
        """Records that ``rank`` left: collectives that need it fail, others go on.

        Args:
            how: what became of it, for messages: ``"on host h has shut down (it
                called shutdown())"``, ``"on host h was lost: it exited after ..."``.
        """
        self._departed[rank] = how
        self._joined.discard(rank)
        for key, pending in list(self._pending.items()):
            members = self.sets.get(key[0]) or ()
            if rank in members:
                self._drop(key)
                request = next(iter(pending.requests.values()))
                waiting = tuple(r for r in sorted(pending.requests) if r == rank or r not in self._departed)
                self._emit(self._aborted(request.label, key[1], key[0], {rank}), waiting)
        if self._joined:
            self._complete_join()  # a rank that left never joins: those in join() may be all that is left


    def take(self) -> list[tuple[Response, tuple[int, ...]]]:
        """Returns the responses ready now, fused, each with the global ranks to send it to."""
        if self._riding:
            riding, self._riding = self._riding, []
            for (response, *_), data in zip(riding, computed_results(riding), strict=True):
                response.data = data
        ready, self._ready = self._ready, []
        if not ready:
            return []
        members_of = {id(response): members for response, members in ready}
        # Fused responses are new objects; all their parts belong to one process set.
        members_by_set = {r.process_set_id: m for r, m in ready if r.type in fusion.FUSABLE}
        fused = fusion.fuse([response for response, _ in ready], self._fusion_threshold)
        taken = [(r, members_of.get(id(r)) or members_by_set[r.process_set_id]) for r in fused]
        for _, members in taken:
            for member in members:
                self._sent[member] += 1
                self._stuck.pop(member, None)  # this response may be what it waits for
        return taken

    # ----- mismatches no check can see -----

    def note_stuck(self, rank: int, received: int) -> None:
        """Records that every thread submitting collectives on ``rank`` waits for one, with
        ``received`` responses received: ignored when more were sent since (one of them
        may free it). A request from the rank, or a response to it, clears it."""
        if received == self._sent[rank] and rank not in self._stuck:
            now = self._clock()
            self._stuck[rank] = now
            self._examine_at = min(self._examine_at or float("inf"), now + MISMATCH_GRACE)

    def seconds_to_mismatch_check(self) -> float | None:
        """How long the engine may sleep before ``find_mismatches`` has something to do."""
        return None if self._examine_at is None else max(0.0, self._examine_at - self._clock())

    def find_mismatches(self) -> None:
        """Fails the collectives of ranks that can never move again (see the module doc).

        A rank stuck for ``MISMATCH_GRACE`` waits for the pending tensors it submitted;
        it is doomed when each of them misses a rank that is itself doomed (so no
        submission can ever complete them). Every tensor a doomed rank submitted then
        fails, on every member of its set, with one message naming what each waits for.
        """
        now = self._clock()
        if self._examine_at is None or now < self._examine_at:
            return  # nothing changed since the last look: a rank became stuck, or its grace ran out
        stuck = {rank for rank, since in self._stuck.items() if now - since >= MISMATCH_GRACE}
        younger = [since + MISMATCH_GRACE for rank, since in self._stuck.items() if rank not in stuck]
        self._examine_at = min(younger, default=None)
        if not stuck:
            return
        waits: dict[int, list[tuple[tuple[int, str], set[int]]]] = {}
        for key, pending in self._pending.items():
            members = self.sets.get(key[0]) or ()
            missing = {r for r in members if r not in pending.requests and r not in self._joined}
            for rank, request in pending.requests.items():
                if rank in stuck and not request.error:  # a rank waits for none of its refusals
                    waits.setdefault(rank, []).append((key, missing))
        doomed = set(waits)
        changed = True
        while changed:  # drop ranks with a tensor that ranks not doomed could still complete
            changed = False
            for rank in list(doomed):
                if any(not missing & doomed for _, missing in waits[rank]):
                    doomed.discard(rank)
                    changed = True
        if not doomed:
            return
        error = _mismatch_message({rank: waits[rank] for rank in sorted(doomed)}, self._pending)
        for key in {key for rank in doomed for key, _ in waits[rank]}:
            pending = self._drop(key)
            members = self.sets.get(key[0]) or tuple(sorted(pending.requests))
            self._emit(Response(ResponseType.ERROR, [key[1]], key[0], error=error), members)
        for rank in doomed:
            self._stuck.pop(rank, None)

    def stalls(self, older_than: float) -> list[Stall]:
        """Tensors that a rank has waited for longer than ``older_than`` seconds, for some
        others. A tensor only refused so far is none: the refusing ranks wait for nothing
        (and the others may never run it, as a TF1 graph's op that is built but not run)."""
        now = self._clock()
        stalls = []
        for (set_id, name), pending in self._pending.items():
            waited = now - pending.first_seen
            if waited >= older_than and pending.waited_for():
                members = self.sets.get(set_id) or ()
                missing = [r for r in members if r not in pending.requests and r not in self._joined]
                stalls.append(Stall(set_id, name, waited, missing))
        return stalls

    def waiting_anything(self) -> bool:
        """True when a tensor waits for ranks, or a stuck rank awaits a look (a cheap test
        before working out deadlines)."""
        return bool(self._pending) or self._examine_at is not None

    def next_deadline(self) -> float | None:
        """The clock time the oldest pending tensor a rank waits for was first seen, or
        None when none is waited for (see ``stalls``)."""
        # Invariant: ``_pending`` is in the order of ``first_seen`` (insertion order, and a
        # tensor whose clock restarts moves to the end), so the first waited for is the
        # oldest: a plan per submit must not scan every tensor in flight (a burst of n
        # tensors cost n^2 / 2 scans).
        return next((p.first_seen for p in self._pending.values() if p.waited_for()), None)

    def _join(self, rank: int) -> None:
        self._joined.add(rank)
        self._last_joined = rank
        if self._complete_join():
            return
        # Fewer ranks are needed now: tensors the others already submitted may be ready.
        for key, pending in list(self._pending.items()):
            members = self.sets.get(key[0])
            if members is not None:
                self._check_ready(key, pending, members)

    def _complete_join(self) -> bool:
        """Answers ``join()`` once every rank still in the job has joined (ranks that left
        are not waited for, as no other collective waits for them); True when it did."""
        if len(self._joined) < self.size - len(self._departed):
            return False
        self._joined.clear()
        members = tuple(rank for rank in self.sets.ranks(GLOBAL) if rank not in self._departed)
        self._emit(Response(ResponseType.JOIN, ["join"], GLOBAL, root_rank=self._last_joined), members)
        return True

    def _check_ready(self, key: tuple[int, str], pending: _Pending, members: tuple[int, ...]) -> None:
        # Every request is a member's (``_record``), so with nobody joined a count tells;
        # checking each member on each rank's request cost n^2 per tensor at n ranks.
        if self._joined:
            if any(rank not in pending.requests and rank not in self._joined for rank in members):
                return
        elif len(pending.requests) < len(members):
            return
        self._drop(key)
        requests = [pending.requests[rank] for rank in sorted(pending.requests)]
        if requests[0].group and len({r.group_size for r in requests}) > 1:
            self._fail_group(key, requests, members)
            return
        ids = set(pending.cached.values())
        if len(ids) == 1 and len(pending.cached) == len(requests) and not self._joined.intersection(members):
            # Every rank sent the same tensor unchanged: reuse the validated response.
            cache_id = ids.pop()
            response = self.cache.response(cache_id)
            response.cache_ids = [cache_id]
        else:
            response = validate.construct(requests, members, self._joined)
            if response.type == ResponseType.ADD_PROCESS_SET:
                response = self._add_set(response)
            elif response.type == ResponseType.REMOVE_PROCESS_SET:
                response = self._remove_set(response)
            if response.type not in (ResponseType.ERROR, ResponseType.ABORTED):
                response.cache_ids = [self.cache.record(key, requests, response)]
        if pending.riders and not self._joined.intersection(members):
            self._riding.append((response, pending.requests, pending.riders, members))
        group = requests[0].group
        if group:
            held = self._groups.setdefault((key[0], group), [])
            held.append(response)
            if len(held) < requests[0].group_size:
                return
            del self._groups[(key[0], group)]
            for response in held:
                self._emit(response, members)
            return
        self._emit(response, members)

    def _fail_group(self, key: tuple[int, str], requests: list[Request], members: tuple[int, ...]) -> None:
        """Fails every tensor of a grouped call whose number of tensors differs across
        ranks (the one found ready, those held, those pending), on every member: each
        member sent its whole group already (``submit_many``), so no more will come."""
        set_id, group = key[0], requests[0].group
        names = [key[1], *(name for response in self._groups.pop((set_id, group), []) for name in response.names)]
        for other in [k for k, p in self._pending.items() if k[0] == set_id and any(r.group == group for r in p.requests.values())]:
            self._drop(other)
            names.append(other[1])
        sizes = validate.describe({r.rank: str(r.group_size) for r in requests})
        error = f"{tensor_label(requests[0].type.label, group)}: numbers of tensors in the grouped call differ across ranks: {sizes}"
        self._emit(Response(ResponseType.ERROR, names, set_id, error=error), members)

    def _aborted(self, label: str, name: str, set_id: int, gone: set[int]) -> Response:
        """The answer for a collective that needs ranks that left the job."""
        who = "; ".join(f"rank {rank} {self._departed[rank]}" for rank in sorted(gone))
        return Response(ResponseType.ABORTED, [name], set_id, error=f"{label} cannot run: in its process set, {who}")

    def _drop(self, key: tuple[int, str]) -> _Pending:
        """Takes a tensor out of the pending table (it is answered: ready, failed, aborted)."""
        pending = self._pending.pop(key)
        for rank in pending.requests:
            self._waiting_of[rank] -= 1
        if self.timeline is not None:
            self.timeline.end(key[1])
        return pending

    def _emit(self, response: Response, members: tuple[int, ...]) -> None:
        self._ready.append((response, members))

    def _add_set(self, response: Response) -> Response:
        ranks = tuple(response.sizes)
        problem = None
        if not ranks or list(ranks) != sorted(set(ranks)) or ranks[0] < 0 or ranks[-1] >= self.size:
            problem = f"ranks {list(ranks)} are not distinct ranks of a job of size {self.size}"
        elif self.sets.find(ranks) is not None:
            problem = f"Attempted to add a duplicate process set: ProcessSet(ranks={list(ranks)})"
        if problem is not None:
            return Response(ResponseType.ERROR, response.names, GLOBAL, error=f"add_process_set: {problem}")
        set_id = self._next_set_id
        self._next_set_id += 1
        self.sets.add(set_id, ranks)
        response.root_rank = set_id
        return response

    def _remove_set(self, response: Response) -> Response:
        set_id = response.root_rank
        if set_id == GLOBAL or self.sets.get(set_id) is None:
            what = "the global process set cannot be removed" if set_id == GLOBAL else f"no process set has id {set_id}"
            return Response(ResponseType.ERROR, response.names, GLOBAL, error=f"remove_process_set: {what}")
        members = self.sets.ranks(set_id)
        for key in [key for key in self._pending if key[0] == set_id]:
            pending = self._drop(key)
            request = next(iter(pending.requests.values()))
            error = f"{request.label}: process set {set_id} was removed before every rank submitted it"
            self._emit(Response(ResponseType.ERROR, [key[1]], set_id, error=error), members)
        self.sets.remove(set_id)
        return response


def _mismatch_message(waits: dict[int, list[tuple[tuple[int, str], set[int]]]], pending: dict[tuple[int, str], _Pending]) -> str:
    """What each rank of a deadlock waits for, and a hint when one name serves two operations."""
    parts = []
    uses: dict[str, set[str]] = {}
    for rank, tensors in waits.items():
        described = []
        for key, missing in tensors:
            request = pending[key].requests[rank]
            described.append(f"{request.label} (not submitted by rank {', '.join(map(str, sorted(missing)))})")
            op, shown = split_name(request.type.label, request.name)
            if shown is not None:
                uses.setdefault(f"'{shown}'", set()).add(op)
        parts.append(f"rank {rank} waits for " + ", ".join(described))
    message = (
        "collectives do not match across ranks: each of these ranks waits for a collective that another of them "
        "never submitted, so none can run: " + "; ".join(parts)
    )
    shared = [f"{name} is used for {' and '.join(sorted(ops))}" for name, ops in uses.items() if len(ops) > 1]
    if shared:
        message += " (the name " + "; ".join(shared) + ")"
    return message
