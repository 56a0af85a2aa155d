"""Cross-rank validation: turning every rank's request for one tensor into one response.

Before a collective runs, all ranks must agree on what it is. This module checks the
requests of every rank for one tensor and builds either the response to execute or an
ERROR response whose message names the operation, the tensor and each rank's value:

    allreduce 'grad.fc1.weight': shapes differ across ranks: rank 0: (17, 1311), rank 1: (17, 23, 57)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hora.collectives.reduce import OP_NAMES, DataType
from hora.engine.messages import Request, RequestType, Response, ResponseType


class Mismatch(Exception):
    """The requests disagree; the message is the user-facing error."""


def describe(values: dict[int, str]) -> str:
    """Lists each rank's value, grouping ranks that agree: ``rank 0: a, ranks 1, 2: b``."""
    by_value: dict[str, list[int]] = {}
    for rank in sorted(values):
        by_value.setdefault(values[rank], []).append(rank)
    parts = []
    for value, ranks in by_value.items():
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{label} {', '.join(map(str, ranks))}: {value}")
    return ", ".join(parts)


def _dtype_label(code: int) -> str:
    try:
        return DataType(code).label
    except ValueError:
        return f"type {code}"


def _shape_label(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _agree(requests: list[Request], what: str, key: Callable[[Request], object], show: Callable[[Request], str]) -> None:
    if len({key(request) for request in requests}) > 1:
        raise Mismatch(f"{what} differ across ranks: " + describe({r.rank: show(r) for r in requests}))


def construct(requests: list[Request], set_ranks: Sequence[int], joined: set[int]) -> Response:
    """Validates every rank's request for one tensor and builds the response.

    Args:
        requests: one request per submitting rank, sorted by rank.
        set_ranks: the global ranks of the process set, in order.
        joined: global ranks that have joined (they contribute zeros to allreduce).

    Returns:
        The response to execute, or an ERROR response naming what differs.
    """
    first = requests[0]
    label = first.label
    refused = {r.rank: r.error for r in requests if r.error}
    if refused:
        # A rank's own checks refused the tensor: every rank raises, naming it.
        reasons = "; ".join(f"rank {rank}: {error}" for rank, error in sorted(refused.items()))
        return Response(ResponseType.ERROR, [first.name], first.process_set_id, error=f"{label}: refused by {reasons}")
    try:
        _agree(requests, "operations", lambda r: r.type, lambda r: r.type.label)
        return _build(first.type, requests, set_ranks, joined)
    except Mismatch as exc:
        return Response(ResponseType.ERROR, [first.name], first.process_set_id, error=f"{label}: {exc}")


def _build(kind: RequestType, requests: list[Request], set_ranks: Sequence[int], joined: set[int]) -> Response:
    first = requests[0]
    joined_members = sorted(joined.intersection(set_ranks))
    if joined_members and kind not in (RequestType.ALLREDUCE, RequestType.BARRIER):
        raise Mismatch(
            f"rank(s) {', '.join(map(str, joined_members))} have called join(); only allreduce may run "
            "until every rank has joined"
        )
    if kind not in (RequestType.BARRIER, RequestType.ADD_PROCESS_SET, RequestType.REMOVE_PROCESS_SET):
        _agree(requests, "data types", lambda r: r.dtype, lambda r: _dtype_label(r.dtype))
    response = Response(
        ResponseType(int(kind)), [first.name], first.process_set_id, dtype=first.dtype, reduce_op=first.reduce_op
    )
    if kind in (RequestType.ALLREDUCE, RequestType.ADASUM, RequestType.REDUCESCATTER):
        _agree(requests, "reduce ops", lambda r: r.reduce_op, lambda r: OP_NAMES.get(r.reduce_op, str(r.reduce_op)))
        _agree(requests, "prescale factors", lambda r: r.prescale, lambda r: repr(r.prescale))
        _agree(requests, "postscale factors", lambda r: r.postscale, lambda r: repr(r.postscale))
        _agree(requests, "shapes", lambda r: r.shape, lambda r: _shape_label(r.shape))
        response.prescale, response.postscale = first.prescale, first.postscale
        count = 1
        for dim in first.shape:
            count *= dim
        response.sizes = [count]
    elif kind in (RequestType.ALLGATHER, RequestType.ALLTOALL):
        _agree(requests, "numbers of dimensions", lambda r: len(r.shape), lambda r: str(len(r.shape)))
        if not first.shape:
            raise Mismatch(f"{kind.label} needs tensors with at least one dimension; got a scalar")
        _agree(requests, "shapes beyond the first dimension", lambda r: r.shape[1:], lambda r: _shape_label(r.shape))
        by_rank = {r.rank: r for r in requests}
        if kind == RequestType.ALLGATHER:
            response.sizes = [by_rank[rank].shape[0] for rank in set_ranks]
        else:
            _agree(requests, "numbers of splits", lambda r: len(r.splits), lambda r: str(list(r.splits)))
            response.sizes = [split for rank in set_ranks for split in by_rank[rank].splits]
    elif kind == RequestType.BROADCAST:
        _agree(requests, "root ranks", lambda r: r.root_rank, lambda r: str(r.root_rank))
        _agree(requests, "shapes", lambda r: r.shape, lambda r: _shape_label(r.shape))
        response.root_rank = first.root_rank
    elif kind == RequestType.ADD_PROCESS_SET:
        _agree(requests, "process set ranks", lambda r: r.splits, lambda r: str(list(r.splits)))
        response.sizes = list(first.splits)
    elif kind == RequestType.REMOVE_PROCESS_SET:
        _agree(requests, "process set ids", lambda r: r.root_rank, lambda r: str(r.root_rank))
        response.root_rank = first.root_rank
    return response
