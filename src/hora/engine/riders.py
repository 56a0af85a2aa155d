"""Small collectives whose data rides the negotiation.

Every collective goes to the coordinator (rank 0) and back before its data moves; for a
small allreduce or broadcast the data phase that follows (recursive doubling across
hosts, the root's sends, barriers in shared memory) costs as much again in round trips.
So a rank sends a small tensor's data along with its request (a *rider*), and when every
member of the set sent one, the coordinator computes the result itself: the allreduce
of the riders in member order, or the root's tensor for a broadcast. The result travels
back in the response (``Response.data``) and each rank copies it into its output: one
round trip in all, through rank 0.

Riding is an optimisation only. A rank decides alone whether its tensor rides (it fits
the frame's budget); the coordinator attaches a result only when every member's rider is
there and no member joined, and every member receives the same response, so either
every member takes the result or every member moves the data itself. Results are
identical on every rank (computed once) and equal to the data path's up to the order of
floating-point sums, as between any two of hora's algorithms.

The budget (``HORA_RIDE_BYTES``, 4 KiB) bounds what rank 0 relays: with N ranks it
receives and sends at most N - 1 times the budget per frame of requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hora.collectives.reduce import DataType, reducer, scale
from hora.engine.messages import Request, RequestType, Response, ResponseType
from hora.engine.queue import Entry


def riders(entries: Sequence[Entry], rank: int, budget: int) -> list[bytes]:
    """The data to send with each entry's request: a small allreduce's input, a small
    broadcast's input from its root; empty bytes for the rest. An empty list when no
    entry's data goes along.

    Args:
        entries: the tensors announced in one frame, in the frame's order.
        rank: this rank (global), to tell a broadcast's root.
        budget: the most bytes the entries' riders take together (``HORA_RIDE_BYTES``),
            taken in order.
    """
    out: list[bytes] = []
    left = budget
    for entry in entries:
        data, request = entry.input, entry.request
        carried = request.type == RequestType.ALLREDUCE or (
            request.type == RequestType.BROADCAST and request.root_rank == rank
        )
        if carried and data is not None and 0 < data.nbytes <= left and not request.error:
            out.append(data.tobytes())
            left -= data.nbytes
        else:
            out.append(b"")
    return out if left < budget else []


# What the coordinator computes one response's result from: the response (validated), each
# member's request and rider (by global rank), and the set's global ranks in order.
Riding = tuple[Response, dict[int, Request], dict[int, bytes], Sequence[int]]


def computed_results(ridings: Sequence[Riding]) -> list[bytes]:
    """``computed_result`` of each, in order; unscaled allreduces of one type, op and
    postscale among the same members share one reduction (also a batch of one).

    A burst of small tensors (160 gradients of a model, say) makes rank 0 compute as
    many results at once; one at a time each cost it ~8 us of NumPy calls. Laid end to
    end, each member's riders form one row, and one reduction along the members folds
    every element in member order, in the storage type, as each tensor's own reduction
    does, then one scaling: bit for bit the results one at a time would be.
    """
    results = [b""] * len(ridings)
    batches: dict[tuple[int, int, float, tuple[int, ...]], list[int]] = {}
    for index, riding in enumerate(ridings):
        key = _batch_key(*riding)
        if key is None:
            results[index] = computed_result(*riding)
        else:
            batches.setdefault(key, []).append(index)
    for (code, op, postscale, members), indices in batches.items():
        dtype = DataType(code)
        try:
            reduce = reducer(op, dtype)
        except ValueError:
            reduce = None  # the op does not apply to the type: computed alone, to nothing
        if reduce is None:
            for index in indices:
                results[index] = computed_result(*ridings[index])
            continue
        storage = dtype.storage
        rows = b"".join(ridings[index][2][rank] for rank in members for index in indices)
        total = reduce.ufunc.reduce(np.frombuffer(rows, dtype=storage).reshape(len(members), -1), axis=0, dtype=storage)
        scale(total, postscale, dtype)
        data = total.tobytes()
        at = 0
        for index in indices:
            end = at + len(ridings[index][2][members[0]])
            results[index] = data[at:end]
            at = end
    return results


def _batch_key(
    response: Response, requests: dict[int, Request], riders: dict[int, bytes], members: Sequence[int]
) -> tuple[int, int, float, tuple[int, ...]] | None:
    """What an allreduce shares with those it can be reduced with, or None for one that
    ``computed_result`` takes alone (any other collective, a bfloat16 or prescaled one, a
    rider missing or of the wrong size). Whether the op applies to the type is asked
    once per batch (``computed_results``)."""
    if response.type != ResponseType.ALLREDUCE or len(response.names) != 1 or response.prescale != 1.0:
        return None
    itemsize = _ITEMSIZE.get(response.dtype)
    if itemsize is None or response.dtype == DataType.BFLOAT16:
        return None
    nbytes = sum(response.sizes) * itemsize
    for rank in members:
        if len(riders.get(rank, b"")) != nbytes:
            return None
    return response.dtype, response.reduce_op, response.postscale, tuple(members)


# Each type's storage width in bytes, by its code: the rider of every tensor of a batch
# is checked against it, so it is looked up without making a ``DataType`` per tensor.
_ITEMSIZE = {int(dtype): dtype.storage.itemsize for dtype in DataType}


def computed_result(response: Response, requests: dict[int, Request], riders: dict[int, bytes], members: Sequence[int]) -> bytes:
    """Computes a validated response's result from the members' riders, or returns b""
    when it cannot (a rider missing or of the wrong size, a collective that does not ride).

    Args:
        response: an ALLREDUCE or BROADCAST response for one tensor, as validated.
        requests: each member's request for it (by global rank).
        riders: each member's rider for it (by global rank); absent for none.
        members: the set's global ranks, in order: the allreduce sums in this order.
    """
    dtype = DataType(response.dtype)
    storage = dtype.storage
    if response.type == ResponseType.BROADCAST:
        root = response.root_rank
        data = riders.get(root, b"")
        request = requests.get(root)
        if request is None or len(data) != _nbytes(request, storage):
            return b""
        return data
    if response.type != ResponseType.ALLREDUCE or len(response.names) != 1:
        return b""
    nbytes = sum(response.sizes) * storage.itemsize
    contributions = [riders.get(rank, b"") for rank in members]
    if any(len(data) != nbytes for data in contributions):
        return b""
    try:
        reduce = reducer(response.reduce_op, dtype)
    except ValueError:
        return b""  # the data path meets the same op and raises it on every rank
    # Member by member, in order (the coordinator reduces unscaled allreduces other than
    # bfloat16 in ``computed_results``, many at once, to these same bits).
    total = np.frombuffer(contributions[0], dtype=storage).copy()
    scale(total, response.prescale, dtype)
    for data in contributions[1:]:
        other = np.frombuffer(data, dtype=storage)
        if response.prescale != 1.0:
            other = other.copy()
            scale(other, response.prescale, dtype)
        reduce(total, other)
    scale(total, response.postscale, dtype)
    return bytes(total.tobytes())


def _nbytes(request: Request, storage: np.dtype[np.generic]) -> int:
    return math.prod(request.shape) * storage.itemsize
