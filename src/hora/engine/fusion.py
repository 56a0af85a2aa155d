"""Tensor fusion: merging ready allreduce responses of one kind into one collective.

Many small allreduces cost one latency each; fused, they cost one for all. Responses
fuse when they agree on process set, data type, reduce op and scale factors, and the
fused payload stays within the threshold. A response that does not fit closes the
fused response of its kind and opens a new one; responses of other kinds in between
do not stop fusion (every rank receives the same fused list, so order stays agreed).
"""

from __future__ import annotations

from hora.collectives.reduce import DataType
from hora.engine.messages import Response, ResponseType

FUSABLE = (ResponseType.ALLREDUCE, ResponseType.ADASUM)


def _kind(response: Response) -> tuple[int, int, int, int, float, float, bool]:
    # Computed results (hora.engine.riders) fuse only with each other: their data goes end to end.
    return (
        response.type,
        response.process_set_id,
        response.dtype,
        response.reduce_op,
        response.prescale,
        response.postscale,
        bool(response.data),
    )


def _nbytes(response: Response) -> int:
    return sum(response.sizes) * DataType(response.dtype).storage.itemsize


def fuse(responses: list[Response], threshold: int) -> list[Response]:
    """Merges fusable responses, keeping the first-appearance order of what is emitted.

    Args:
        responses: ready responses in the order they became ready.
        threshold: the largest fused payload in bytes; 0 disables fusion.

    Returns:
        The responses to execute, fused where possible.
    """
    if threshold <= 0 or len(responses) == 1:
        return list(responses)
    out: list[Response] = []
    open_by_kind: dict[tuple[int, int, int, int, float, float, bool], tuple[Response, int]] = {}
    for response in responses:
        if response.type not in FUSABLE:
            out.append(response)
            continue
        kind = _kind(response)
        size = _nbytes(response)
        current = open_by_kind.get(kind)
        if current is not None and current[1] + size <= threshold:
            fused, used = current
            fused.names.extend(response.names)
            fused.sizes.extend(response.sizes)
            fused.cache_ids.extend(response.cache_ids)
            fused.data += response.data
            open_by_kind[kind] = (fused, used + size)
            continue
        fused = Response(
            response.type,
            list(response.names),
            response.process_set_id,
            dtype=response.dtype,
            reduce_op=response.reduce_op,
            prescale=response.prescale,
            postscale=response.postscale,
            sizes=list(response.sizes),
            cache_ids=list(response.cache_ids),
            data=response.data,
        )
        out.append(fused)
        open_by_kind[kind] = (fused, size)
    return out
