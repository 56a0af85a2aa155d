"""Submitting collectives, shared by every framework binding.

A binding turns its tensor into a ``Tensor``: a flat, contiguous NumPy view of the
tensor's memory (no copy), its shape, and its wire type. The functions here check
what can be checked on this rank alone (types, process-set membership, roots, splits),
raising ``ValueError`` at once, then queue the tensor and return its ``Handle``.
What can only be checked across ranks is checked by the coordinator and raised from
``synchronize``.

Names: a named tensor is called ``<op>.<name>``, as in Horovod. An unnamed one is
called ``<op>.noname.<set id>.<n>``: the n-th unnamed ``<op>`` this rank submitted in
that process set. Ranks that submit their unnamed collectives of each set in the same
order therefore agree on names without coordination, even when they run different
numbers of other operations (Horovod numbers them by handle, which breaks as soon as
ranks of different process sets do different amounts of work).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from hora.collectives.reduce import ADASUM, AVERAGE, MAX, MIN, OP_NAMES, PRODUCT, SUM, DataType, data_type_of
# Handle and RequestType are the bindings' too: they reach the engine only through the core.
from hora.engine.handles import Handle as Handle
from hora.engine.messages import RequestType as RequestType
from hora.engine.messages import tensor_label
from hora.errors import UnsupportedOperationError
from hora.core.process_sets import ProcessSet
from hora.core.runtime import Runtime


@dataclasses.dataclass
class Tensor:
    """A framework tensor as hora moves it.

    Attributes:
        data: a flat contiguous view of the tensor's elements (bfloat16 as uint16).
        shape: the tensor's shape.
        dtype: the wire type.
    """

    data: np.ndarray
    shape: tuple[int, ...]
    dtype: DataType


def from_numpy(array: np.ndarray, *, writable: bool = False) -> Tensor:
    """Views a NumPy array as a ``Tensor`` without copying.

    Args:
        array: the array.
        writable: the view will be written (in-place ops): the array must be
            C-contiguous and writable, since a copy would not update it.

    Raises:
        ValueError: the dtype is not supported, or ``writable`` and the array is not
            contiguous or read-only.
    """
    dtype = data_type_of(array.dtype)
    if writable:
        if not array.flags.c_contiguous:
            raise ValueError("Tensor is required to be contiguous.")
        if not array.flags.writeable:
            raise ValueError("in-place collectives need a writable array; this one is read-only")
    storage = np.ascontiguousarray(array).reshape(-1)
    if dtype == DataType.BFLOAT16:
        storage = storage.view(np.uint16)
    return Tensor(storage, array.shape, dtype)  # an ndarray's shape is a tuple of ints


def group_names(base: str, count: int) -> list[str]:
    """The names of a grouped call's tensors: ``<base>_0``, ``<base>_1``, ...

    They do not depend on the group's size, so ranks that group different numbers of
    tensors meet at the coordinator and fail with an error instead of waiting (Horovod
    appends ``of<count>``, which makes them never meet).

    Raises:
        ValueError: ``count`` is 0.
    """
    if count == 0:
        raise ValueError("grouped collectives need at least one tensor")
    return [f"{base}_{i}" for i in range(count)]


@contextlib.contextmanager
def refusal(
    runtime: Runtime,
    kind: RequestType,
    names: Sequence[str],
    process_set: ProcessSet,
    group: tuple[str, int] = ("", 0),
) -> Iterator[None]:
    """Runs a collective's local checks and submission, telling the others if they fail.

    A check that only this rank fails (bad splits, a root out of range, a tensor it
    cannot move, an object it cannot pickle; also an interrupt that lands here) raises
    here at once, and is also sent to the coordinator under the collective's names, so
    every rank of the set fails it with an error naming this rank and the reason instead
    of waiting for this one.

    Raises:
        BaseException: what the checks raised.
    """
    try:
        yield
    except (Exception, KeyboardInterrupt) as exc:
        try:
            sid: int | None = set_id(runtime, process_set, "")
        except ValueError:
            sid = None  # not a member (or no such set): nobody waits for this rank
        if sid is not None:
            message = str(exc)
            for name in names:  # the message names the collective already: keep what follows
                prefix = tensor_label(kind.label, name) + ": "
                if message.startswith(prefix):
                    message = message[len(prefix) :]
            runtime.refuse(kind, names, sid, f"{type(exc).__name__}: {message}", group)
        raise


def full_name(runtime: Runtime, op: str, name: str | None, process_set: ProcessSet) -> str:
    """Returns ``<op>.<name>``, or ``<op>.noname.<set id>.<n>`` for an unnamed tensor."""
    if name is not None:
        return f"{op}.{name}"
    set_id_ = process_set.process_set_id or 0
    return f"{op}.noname.{set_id_}.{runtime.count_unnamed(op, set_id_)}"


def set_id(runtime: Runtime, process_set: ProcessSet, what: str) -> int:
    """Checks that this rank may run a collective in ``process_set``; returns the set id.

    Raises:
        ValueError: the set is not registered, or this rank is not a member.
    """
    return membership(runtime, process_set, what)[0]


def membership(runtime: Runtime, process_set: ProcessSet, what: str) -> tuple[int, tuple[int, ...]]:
    """``set_id``, and the set's global ranks in order.

    Raises:
        ValueError: the set is not registered, or this rank is not a member.
    """
    if process_set.process_set_id is None or process_set._runtime is not runtime:
        raise ValueError(f"{what}: {process_set!r} is not registered with the running job (add it first)")
    members = runtime.engine.sets.get(process_set.process_set_id)
    if members is None:
        raise ValueError(f"{what}: process set {process_set.process_set_id} has been removed")
    if runtime.rank not in members:
        raise ValueError(
            f"{what}: rank {runtime.rank} is not a member of process set {process_set.process_set_id} "
            f"(ranks {list(members)}); only members may run its collectives"
        )
    return process_set.process_set_id, members


def _members(runtime: Runtime, set_id_: int) -> tuple[int, ...]:
    return runtime.engine.sets.ranks(set_id_)


def resolve_op(op: int | None, average: bool | None, default: int = AVERAGE) -> int:
    """Applies Horovod's rules for the deprecated ``average`` argument.

    Raises:
        ValueError: both ``op`` and ``average`` were given.
    """
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        import warnings

        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed in a future release.",
            DeprecationWarning,
            stacklevel=3,
        )
        return AVERAGE if average else SUM
    return default if op is None else int(op)


def _check_reduce(label: str, op: int, tensor: Tensor, allowed: tuple[int, ...]) -> None:
    if op not in OP_NAMES:
        raise ValueError(f"{label}: {op!r} is not a reduce op (use hvd.Average, hvd.Sum, hvd.Min, ...)")
    if op not in allowed:
        names = ", ".join(OP_NAMES[o] for o in allowed)
        raise UnsupportedOperationError(f"{label}: reduce op {OP_NAMES[op]} is not supported here (use {names})")
    if tensor.dtype == DataType.BOOL and op == AVERAGE:
        raise ValueError(f"{label}: Average is not defined for bool tensors (use Sum, Min, Max or Product)")


def allreduce(
    runtime: Runtime,
    tensor: Tensor,
    output: np.ndarray,
    name: str,
    op: int,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
    group: tuple[str, int] = ("", 0),
    label: str | None = None,
) -> Handle:
    """Queues an allreduce of ``tensor`` into ``output`` (a flat view; may be ``tensor.data``).

    Average is a sum with ``postscale`` divided by the set size, as in Horovod.

    Args:
        label: the tensor as messages name it (``tensor_label``), where the caller has it.
    """
    if label is None:
        label = tensor_label("allreduce", name)
    _check_reduce(label, op, tensor, (AVERAGE, SUM, MIN, MAX, PRODUCT, ADASUM))
    sid, members = membership(runtime, process_set, label)
    kind = RequestType.ALLREDUCE
    if op == ADASUM:
        kind = RequestType.ADASUM
        _check_adasum(label, tensor, sid, len(members))
    if op == AVERAGE:
        postscale = postscale / len(members)
    return runtime.submit(
        kind, name, tensor.dtype, tensor.data, output, tensor.shape, sid,
        reduce_op=op, prescale=prescale, postscale=postscale, group=group[0], group_size=group[1],
    )  # fmt: skip


def _check_adasum(label: str, tensor: Tensor, set_id_: int, size: int) -> None:
    if set_id_ != 0:
        raise NotImplementedError(f"{label}: Adasum runs on the global process set only (as in Horovod)")
    if size & (size - 1):
        raise NotImplementedError(f"{label}: Adasum on CPU needs a power-of-two number of ranks; the job has {size}")
    if not tensor.dtype.is_float:
        raise ValueError(f"{label}: Adasum needs floating-point tensors; got {tensor.dtype.label}")


def allgather(
    runtime: Runtime, tensor: Tensor, name: str, process_set: ProcessSet, group: tuple[str, int] = ("", 0)
) -> Handle:
    """Queues an allgather; the handle's result is the concatenation along dimension 0."""
    label = tensor_label("allgather", name)
    sid = set_id(runtime, process_set, label)
    data = tensor.data
    if not tensor.shape:
        raise ValueError(f"{label}: allgather needs a tensor with at least one dimension; got a scalar")
    return runtime.submit(
        RequestType.ALLGATHER, name, tensor.dtype, data, None, tensor.shape, sid, group=group[0], group_size=group[1]
    )


def check_root(runtime: Runtime, root_rank: int, process_set: ProcessSet, label: str) -> int:
    """Checks that ``root_rank``, a global rank as in Horovod, is a member of the set.

    Args:
        label: what the error names (the op and the tensor).

    Returns:
        The root as an int.

    Raises:
        ValueError: this rank is not a member of the set, or the root is not.
    """
    sid = set_id(runtime, process_set, label)
    members = _members(runtime, sid)
    root = int(root_rank)
    if root not in members:
        where = f"size {len(members)}" if sid == 0 else f"ranks {list(members)}"
        raise ValueError(
            f"{label}: root_rank {root_rank} is not a rank of the process set ({where}); root_rank is a global rank"
        )
    return root


def broadcast(
    runtime: Runtime, tensor: Tensor, output: np.ndarray, root_rank: int, name: str, process_set: ProcessSet
) -> Handle:
    """Queues a broadcast from ``root_rank`` into ``output``.

    ``root_rank`` is a rank of the job (a global rank), also inside a process set, as in
    Horovod; it must be a member of the set.

    Raises:
        ValueError: the root is not a member of the set.
    """
    label = tensor_label("broadcast", name)
    sid = set_id(runtime, process_set, label)
    root = check_root(runtime, root_rank, process_set, label)
    return runtime.submit(
        RequestType.BROADCAST, name, tensor.dtype, tensor.data, output, tensor.shape, sid, root_rank=root
    )


def alltoall(
    runtime: Runtime,
    tensor: Tensor,
    splits: Sequence[int] | np.ndarray | None,
    name: str,
    process_set: ProcessSet,
) -> Handle:
    """Queues an alltoall; the result is (received tensor, splits received from each rank)."""
    label = tensor_label("alltoall", name)
    sid = set_id(runtime, process_set, label)
    size = len(_members(runtime, sid))
    if not tensor.shape:
        raise ValueError(f"{label}: alltoall needs a tensor with at least one dimension; got a scalar")
    rows = tensor.shape[0]
    if splits is None:
        if rows % size:
            raise ValueError(
                f"{label}: the first dimension ({rows}) must divide evenly by the number of ranks ({size}) "
                "when splits is not given"
            )
        split_list = [rows // size] * size
    else:
        given = np.asarray(splits).reshape(-1)
        if given.dtype.kind not in "iub" and not all(float(s).is_integer() for s in given):
            raise ValueError(f"{label}: splits must be integers; got {given.tolist()}")
        split_list = [int(s) for s in given]
        if len(split_list) != size:
            raise ValueError(f"{label}: splits has {len(split_list)} entries; the process set has {size} ranks")
        if any(s < 0 for s in split_list):
            raise ValueError(f"{label}: splits must not be negative; got {split_list}")
        if sum(split_list) > rows:
            raise ValueError(f"{label}: splits sum to {sum(split_list)}, more than the first dimension ({rows})")
    row = 1
    for dim in tensor.shape[1:]:
        row *= dim
    data = tensor.data[: sum(split_list) * row]  # rows past the splits are not sent
    return runtime.submit(
        RequestType.ALLTOALL, name, tensor.dtype, data, None, (sum(split_list), *tensor.shape[1:]), sid,
        splits=split_list,
    )  # fmt: skip


def reducescatter(
    runtime: Runtime,
    tensor: Tensor,
    name: str,
    op: int,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
    group: tuple[str, int] = ("", 0),
) -> Handle:
    """Queues a reducescatter; rank ``r`` receives rows ``[r*q + min(r, m), ...)`` of the
    reduced tensor, where ``q, m = divmod(rows, size)`` (the first ``m`` ranks get one more row)."""
    label = tensor_label("reducescatter", name)
    _check_reduce(label, op, tensor, (AVERAGE, SUM))
    sid = set_id(runtime, process_set, label)
    if not tensor.shape:
        raise ValueError(f"{label}: reducescatter needs a tensor with at least one dimension; got a scalar")
    if op == AVERAGE:
        postscale = postscale / len(_members(runtime, sid))
    return runtime.submit(
        RequestType.REDUCESCATTER, name, tensor.dtype, tensor.data, None, tensor.shape, sid,
        reduce_op=op, prescale=prescale, postscale=postscale, group=group[0], group_size=group[1],
    )  # fmt: skip


def reducescatter_grad_scale(op: int, set_size: int, prescale: float, postscale: float) -> float:
    """What every binding multiplies the allgathered upstream gradient of a reducescatter
    by: Horovod's rule, the set size for Sum (1 for Average), times both scale factors.

    Args:
        op: SUM or AVERAGE.
        set_size: the members of the process set.
        prescale, postscale: the collective's scale factors.
    """
    return float(set_size if op == SUM else 1) * prescale * postscale


def barrier(runtime: Runtime, process_set: ProcessSet) -> Handle:
    """Queues a barrier over the set (one barrier per set may be in flight on a rank)."""
    sid = set_id(runtime, process_set, "barrier")
    return runtime.submit(RequestType.BARRIER, "barrier", DataType.UINT8, None, None, (), sid)


def join(runtime: Runtime) -> Handle:
    """Queues this rank's join; the result is the last rank to join."""
    return runtime.submit(RequestType.JOIN, "join", DataType.UINT8, None, None)
