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
is ready and then released together, so they fuse.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from hora.engine import fusion, validate
from hora.engine.cache import CoordinatorCache
from hora.engine.messages import Request, RequestType, Response, ResponseType
from hora.engine.process_sets import ProcessSetTable
from hora.engine.timeline import Timeline
from hora.errors import ProtocolError

GLOBAL = 0


@dataclasses.dataclass
class _Pending:
    requests: dict[int, Request]
    first_seen: float
    cached: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> cache id it sent


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
        self._joined: set[int] = set()
        self._departed: set[int] = set()  # ranks that shut down; collectives needing them fail
        self._last_joined = -1
        self._next_set_id = 1
        self.timeline: Timeline | None = None  # set while rank 0 records one

    def submit_cached(self, rank: int, cache_id: int) -> None:
        """Records that ``rank`` submitted, unchanged, the tensor cached under ``cache_id``.

        Raises:
            ProtocolError: the id is unknown for this rank.
        """
        try:
            request = self.cache.request(rank, cache_id)
        except (IndexError, KeyError):
            raise ProtocolError(f"rank {rank} sent unknown cache id {cache_id}") from None
        self.submit(request, cache_id)

    def submit(self, request: Request, cache_id: int = -1) -> None:
        """Records one rank's request; what becomes ready is returned by ``take``."""
        if request.type == RequestType.JOIN:
            self._join(request.rank)
            return
        members = self.sets.get(request.process_set_id)
        if members is None or request.rank not in members:
            # The rank checked this locally; a race with remove_process_set can still land here.
            error = f"{request.label}: process set {request.process_set_id} does not exist"
            error += "" if members is None else f" or does not include rank {request.rank}"
            self._emit(Response(ResponseType.ERROR, [request.name], request.process_set_id, error=error), (request.rank,))
            return
        gone = self._departed.intersection(members)
        if gone:
            self._emit(_aborted(request.label, request.name, request.process_set_id, gone), (request.rank,))
            return
        key = (request.process_set_id, request.name)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending({}, self._clock())
            if self.timeline is not None:
                self.timeline.begin(request.name, f"NEGOTIATE_{request.type.name}")
        if self.timeline is not None:
            self.timeline.tick(request.name, str(request.rank))
        pending.requests[request.rank] = request
        if cache_id >= 0:
            pending.cached[request.rank] = cache_id
        self._check_ready(key, pending, members)

    def depart(self, rank: int) -> None:
        """Records that ``rank`` shut down: collectives that need it fail, others go on."""
        self._departed.add(rank)
        self._joined.discard(rank)
        for key, pending in list(self._pending.items()):
            members = self.sets.get(key[0]) or ()
            if rank in members:
                del self._pending[key]
                if self.timeline is not None:
                    self.timeline.end(key[1])
                request = next(iter(pending.requests.values()))
                waiting = tuple(r for r in sorted(pending.requests) if r == rank or r not in self._departed)
                self._emit(_aborted(request.label, key[1], key[0], {rank}), waiting)

    def take(self) -> list[tuple[Response, tuple[int, ...]]]:
        """Returns the responses ready now, fused, each with the global ranks to send it to."""
        ready, self._ready = self._ready, []
        if not ready:
            return []
        members_of = {id(response): members for response, members in ready}
        # Fused responses are new objects; all their parts belong to one process set.
        members_by_set = {r.process_set_id: m for r, m in ready if r.type in fusion.FUSABLE}
        fused = fusion.fuse([response for response, _ in ready], self._fusion_threshold)
        return [(r, members_of.get(id(r)) or members_by_set[r.process_set_id]) for r in fused]

    def stalls(self, older_than: float) -> list[Stall]:
        """Tensors that have waited longer than ``older_than`` seconds for some ranks."""
        now = self._clock()
        stalls = []
        for (set_id, name), pending in self._pending.items():
            waited = now - pending.first_seen
            if waited >= older_than:
                members = self.sets.get(set_id) or ()
                missing = [r for r in members if r not in pending.requests and r not in self._joined]
                stalls.append(Stall(set_id, name, waited, missing))
        return stalls

    def next_deadline(self) -> float | None:
        """The clock time the oldest pending tensor was first seen, or None when none waits."""
        return min((p.first_seen for p in self._pending.values()), default=None)

    def _join(self, rank: int) -> None:
        self._joined.add(rank)
        self._last_joined = rank
        if len(self._joined) == self.size - len(self._departed):
            self._joined.clear()
            response = Response(ResponseType.JOIN, ["join"], GLOBAL, root_rank=self._last_joined)
            self._emit(response, self.sets.ranks(GLOBAL))
            return
        # Fewer ranks are needed now: tensors the others already submitted may be ready.
        for key, pending in list(self._pending.items()):
            members = self.sets.get(key[0])
            if members is not None:
                self._check_ready(key, pending, members)

    def _check_ready(self, key: tuple[int, str], pending: _Pending, members: tuple[int, ...]) -> None:
        if any(rank not in pending.requests and rank not in self._joined for rank in members):
            return
        del self._pending[key]
        if self.timeline is not None:
            self.timeline.end(key[1])
        requests = [pending.requests[rank] for rank in sorted(pending.requests)]
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
            pending = self._pending.pop(key)
            if self.timeline is not None:
                self.timeline.end(key[1])
            request = next(iter(pending.requests.values()))
            error = f"{request.label}: process set {set_id} was removed before every rank submitted it"
            self._emit(Response(ResponseType.ERROR, [key[1]], set_id, error=error), members)
        self.sets.remove(set_id)
        return response


def _aborted(label: str, name: str, set_id: int, gone: set[int]) -> Response:
    ranks = ", ".join(map(str, sorted(gone)))
    return Response(
        ResponseType.ABORTED,
        [name],
        set_id,
        error=f"{label} cannot run: rank {ranks} of its process set has shut down",
    )
