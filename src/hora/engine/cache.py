"""The response cache: repeated tensors skip validation and travel as small integers.

Training submits the same tensors, with the same parameters, every step. The first
time a tensor completes negotiation, the coordinator gives it a cache id and every
rank learns it from the response. Next time a rank submits that tensor unchanged, it
sends only the id; when every rank sent the same id, the coordinator reuses the
validated response instead of checking every rank's request again.

Invariants:

* ``CoordinatorCache.requests[id][r]`` is rank ``r``'s request for that tensor in the
  last negotiation that included it, and rank ``r``'s ``RankCache`` holds the same
  request's signature under that id (both are updated by the same response; a rank
  cannot resubmit a name before the previous submission's response executed).
* Ids are never reused or evicted: once ``capacity`` ids exist, new tensors simply
  negotiate in full. A rank therefore never sends an id the coordinator has forgotten.
"""

from __future__ import annotations

import dataclasses

from hora.engine.messages import Request, RequestType, Response

CACHEABLE = (
    RequestType.ALLREDUCE,
    RequestType.ADASUM,
    RequestType.ALLGATHER,
    RequestType.BROADCAST,
    RequestType.ALLTOALL,
    RequestType.REDUCESCATTER,
)

Signature = tuple[object, ...]


def signature(request: Request) -> Signature:
    """Everything about a request that must match its cached form (all but rank and name)."""
    return (
        request.type,
        request.dtype,
        request.shape,
        request.reduce_op,
        request.root_rank,
        request.prescale,
        request.postscale,
        request.splits,
        request.group,
        request.group_size,
        request.error,  # a refusal never matches a cached tensor
        request.scope,  # a new TF1 graph's op reaches the coordinator in full (Coordinator._record)
    )


class RankCache:
    """What one rank knows: (process set, name) -> (its last request's signature, id)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], tuple[Signature, int]] = {}

    def lookup(self, request: Request) -> int | None:
        """The id to send instead of ``request``, or None to send it in full."""
        found = self._entries.get((request.process_set_id, request.name))
        if found is not None and found[0] == signature(request):
            return found[1]
        return None

    def learn(self, request: Request, cache_id: int) -> None:
        """Records the id the coordinator gave this rank's ``request``."""
        if cache_id >= 0:
            self._entries[(request.process_set_id, request.name)] = (signature(request), cache_id)


@dataclasses.dataclass
class _Cached:
    key: tuple[int, str]
    requests: dict[int, Request]
    response: Response | None


class CoordinatorCache:
    """The coordinator's side: id -> every rank's last request and the validated response.

    Args:
        capacity: the most tensors to cache (0 disables the cache).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_id: list[_Cached] = []
        self._ids: dict[tuple[int, str], int] = {}

    def request(self, rank: int, cache_id: int) -> Request:
        """The request rank ``rank`` stands for when it sends ``cache_id``.

        Raises:
            KeyError: no such id, or the rank has no request under it (a protocol error).
        """
        return self._by_id[cache_id].requests[rank]

    def response(self, cache_id: int) -> Response:
        """A fresh copy of the validated response for the id."""
        t = self._by_id[cache_id].response
        assert t is not None  # invariant: an id exists only once a response validated
        # Built field by field: several times cheaper than copy.copy, on every cached step.
        return Response(
            t.type, list(t.names), t.process_set_id, t.dtype, t.reduce_op, t.root_rank,
            t.prescale, t.postscale, list(t.sizes), t.error, list(t.cache_ids),
        )  # fmt: skip

    def record(self, key: tuple[int, str], requests: list[Request], response: Response) -> int:
        """Stores a successful negotiation; returns the tensor's id, or -1 when not cached.

        Failed negotiations are not recorded: neither the coordinator nor the ranks
        (whose responses then carry no id) update anything, so they stay consistent.
        """
        if not requests or requests[0].type not in CACHEABLE:
            return -1
        cache_id = self._ids.get(key)
        if cache_id is None:
            if len(self._by_id) >= self.capacity:
                return -1
            cache_id = len(self._by_id)
            self._ids[key] = cache_id
            self._by_id.append(_Cached(key, {}, None))
        entry = self._by_id[cache_id]
        entry.requests.update((request.rank, request) for request in requests)
        entry.response = dataclasses.replace(response, names=list(response.names), sizes=list(response.sizes))
        return cache_id

    def __len__(self) -> int:
        return len(self._by_id)
