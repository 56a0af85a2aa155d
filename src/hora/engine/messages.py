"""Requests, responses and the control frames that carry them, in compact binary.

A rank describes each tensor it submits with a ``Request``; the coordinator answers
with ``Response`` objects, each naming one or more tensors (several when fused) and
everything a rank needs to execute the collective. Both travel in frames of the kinds
below, encoded with ``hora.transport.codec`` (never pickle).

Request and response type codes are Horovod's (``message.h``), so timeline and logs
read the same; hora's process-set management requests use codes of their own.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import TypeVar

from hora.errors import ProtocolError
from hora.transport.codec import Reader, Writer

# Runs of fixed-size fields, each read or written at once (little-endian, unpadded); the
# layout on the wire is that of the same fields written one by one.
_RANK_TYPE = struct.Struct("<IB")  # Request: rank, type
_SET_DTYPE = struct.Struct("<IB")  # Request: process set, dtype
_OP_SCALES = struct.Struct("<Bqdd")  # Request: reduce op, root rank, prescale, postscale
_RESPONSE_FIELDS = struct.Struct("<IBBqdd")  # Response: set, dtype, reduce op, root, prescale, postscale

# Control frame kinds.
REQUESTS = 1  # worker -> coordinator: RequestList
RESPONSES = 2  # coordinator -> worker: ResponseList
SHUTDOWN = 3  # either way: the sender is shutting down (payload: reason)
ABORT = 4  # coordinator -> worker: the job failed (payload: reason)
FAILURE = 5  # worker -> coordinator: this worker hit an error (payload: reason)
STUCK = 6  # worker -> coordinator: every thread that submits here waits (payload: responses received)
PING = 7  # either way: are you there? (payload: the ping's number; hora.engine.stall.SilentPeer)
PONG = 8  # either way: the answer to a PING (payload: its number)


class RequestType(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    JOIN = 3
    ADASUM = 4
    ALLTOALL = 5
    BARRIER = 6
    REDUCESCATTER = 7
    ADD_PROCESS_SET = 20
    REMOVE_PROCESS_SET = 21

    @property
    def label(self) -> str:
        return self.name.lower()


class ResponseType(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    JOIN = 3
    ADASUM = 4
    ALLTOALL = 5
    BARRIER = 6
    REDUCESCATTER = 7
    ERROR = 8
    ADD_PROCESS_SET = 20
    REMOVE_PROCESS_SET = 21
    ABORTED = 30  # cannot run: a member of its process set has shut down
    PARAMS = 40  # every rank switches engine parameters here (hora.engine.autotune); names no tensor


def tensor_label(op: str, name: str) -> str:
    """Names a tensor for messages, its operation once: ``allreduce.grad`` ->
    ``allreduce 'grad'``; a grouped call's tensor ``grouped_allreduce.g_1`` ->
    ``grouped_allreduce 'g_1'``; a barrier -> ``barrier``."""
    shown_op, shown = split_name(op, name)
    return shown_op if shown is None else f"{shown_op} '{shown}'"


def split_name(op: str, name: str) -> tuple[str, str | None]:
    """A tensor's name as (operation, the name the program gave; None for a barrier)."""
    if name == op:
        return op, None
    # On every tensor's path (its label): plain comparisons, no prefix strings built.
    end = len(op)
    if name.startswith(op) and name.startswith(".", end):
        return op, name[end + 1 :]
    end += 8  # len("grouped_")
    if name.startswith("grouped_") and name.startswith(op, 8) and name.startswith(".", end):
        return name[:end], name[end + 1 :]
    return op, name


@dataclasses.dataclass
class Request:
    """One rank's description of one tensor it submitted.

    Attributes:
        rank: the submitting rank (global).
        type: the collective.
        name: the tensor's name, unique among the rank's in-flight tensors.
        process_set_id: the process set the collective runs in.
        dtype: a ``DataType`` code.
        shape: the tensor's shape.
        reduce_op: a reduce op code (allreduce, reducescatter).
        root_rank: the root (broadcast: a global rank); the set id (remove).
        prescale: factor applied to each rank's input before reducing.
        postscale: factor applied to the result.
        splits: alltoall split sizes; the ranks of a process set to add.
        group: the name of the grouped call this tensor belongs to, or "".
        group_size: the number of tensors in that grouped call.
        error: set when this rank's own checks refused the tensor (bad splits, a root
            out of range, ...): the coordinator then fails it on every rank, naming
            this rank and the message, instead of running it.
        scope: the TF1 graph the tensor's op was built in, numbered by this rank in the
            order its graphs were built (0: not a TF1 graph's op). Names restart in
            every graph, so a refusal sent while a graph was built, for an op nobody ran,
            must not meet a later graph's op of the same name (``Coordinator._record``).
    """

    rank: int
    type: RequestType
    name: str
    process_set_id: int = 0
    dtype: int = 0
    shape: tuple[int, ...] = ()
    reduce_op: int = 0
    root_rank: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] = ()
    group: str = ""
    group_size: int = 0
    error: str = ""
    scope: int = 0

    @property
    def label(self) -> str:
        """``<op> '<name>'`` for messages (see ``tensor_label``)."""
        return tensor_label(self.type.label, self.name)

    def encode(self, writer: Writer) -> None:
        writer.fixed(_RANK_TYPE, self.rank, self.type).string(self.name)
        writer.fixed(_SET_DTYPE, self.process_set_id, self.dtype).i64s(self.shape)
        writer.fixed(_OP_SCALES, self.reduce_op, self.root_rank, self.prescale, self.postscale)
        writer.i64s(self.splits).string(self.group).u32(self.group_size).string(self.error).u32(self.scope)

    @classmethod
    def decode(cls, reader: Reader) -> Request:
        rank, type_ = reader.fixed(_RANK_TYPE)
        name = reader.string()
        set_id, dtype = reader.fixed(_SET_DTYPE)
        shape = tuple(reader.i64s())
        reduce_op, root_rank, prescale, postscale = reader.fixed(_OP_SCALES)
        return cls(
            rank=rank,
            type=_enum(RequestType, type_),
            name=name,
            process_set_id=set_id,
            dtype=dtype,
            shape=shape,
            reduce_op=reduce_op,
            root_rank=root_rank,
            prescale=prescale,
            postscale=postscale,
            splits=tuple(reader.i64s()),
            group=reader.string(),
            group_size=reader.u32(),
            error=reader.string(),
            scope=reader.u32(),
        )


@dataclasses.dataclass
class Response:
    """The coordinator's instruction to execute a collective on one or more tensors.

    Attributes:
        type: the collective, or ERROR.
        names: the tensors, in the order their data is laid out when fused.
        process_set_id: the process set it runs in.
        dtype: a ``DataType`` code.
        reduce_op: the reduce op code.
        root_rank: broadcast root (a global rank); JOIN: the last rank to join;
            ADD_PROCESS_SET / REMOVE_PROCESS_SET: the set id.
        prescale: see ``Request``.
        postscale: see ``Request``.
        sizes: ALLREDUCE: element count per tensor; ALLGATHER: first dimension of each
            rank's tensor, tensor-major; ALLTOALL: the splits matrix, row = sender;
            ADD_PROCESS_SET: the set's ranks.
        error: the message, for ERROR responses.
        cache_ids: the response-cache id of each tensor in ``names`` (-1: none).
        data: the result, when the coordinator computed it from the data every member
            sent with its request (``hora.engine.riders``): ALLREDUCE, the reduced and
            scaled tensors end to end; BROADCAST, the root's tensor. Empty otherwise:
            the members move the data themselves.
    """

    type: ResponseType
    names: list[str]
    process_set_id: int = 0
    dtype: int = 0
    reduce_op: int = 0
    root_rank: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    sizes: list[int] = dataclasses.field(default_factory=list)
    error: str = ""
    cache_ids: list[int] = dataclasses.field(default_factory=list)
    data: bytes = b""

    def encode(self, writer: Writer) -> None:
        writer.u8(self.type).u32(len(self.names))
        for name in self.names:
            writer.string(name)
        writer.fixed(
            _RESPONSE_FIELDS,
            self.process_set_id, self.dtype, self.reduce_op, self.root_rank, self.prescale, self.postscale,
        )  # fmt: skip
        writer.i64s(self.sizes).string(self.error).i64s(self.cache_ids).blob(self.data)

    @classmethod
    def decode(cls, reader: Reader) -> Response:
        type_ = _enum(ResponseType, reader.u8())
        names = [reader.string() for _ in range(reader.count())]
        set_id, dtype, reduce_op, root_rank, prescale, postscale = reader.fixed(_RESPONSE_FIELDS)
        return cls(
            type=type_,
            names=names,
            process_set_id=set_id,
            dtype=dtype,
            reduce_op=reduce_op,
            root_rank=root_rank,
            prescale=prescale,
            postscale=postscale,
            sizes=reader.i64s(),
            error=reader.string(),
            cache_ids=reader.i64s(),
            data=reader.blob(),
        )


def encode_requests(requests: list[Request], cached: list[int] | None = None, riders: list[bytes] | None = None) -> bytes:
    """Encodes full requests, the cache ids of tensors sent unchanged, and the data sent
    along (``riders``: one per tensor, full requests first, empty for none; or no list)."""
    writer = Writer().u32(len(requests))
    for request in requests:
        request.encode(writer)
    writer.i64s(cached or [])
    writer.u32(len(riders or ()))
    for rider in riders or ():
        writer.blob(rider)
    return writer.bytes()


def decode_requests(payload: bytes) -> tuple[list[Request], list[int], list[bytes]]:
    """Returns (full requests, cache ids, riders: empty or one per tensor).

    Raises:
        ProtocolError: the riders do not match the tensors one to one.
    """
    reader = Reader(payload)
    requests = [Request.decode(reader) for _ in range(reader.count())]
    cached = reader.i64s()
    riders = [reader.blob() for _ in range(reader.count())]
    reader.done()
    if riders and len(riders) != len(requests) + len(cached):
        raise ProtocolError(f"{len(riders)} riders for {len(requests) + len(cached)} tensors")
    return requests, cached, riders


def encode_responses(responses: list[Response]) -> bytes:
    writer = Writer().u32(len(responses))
    for response in responses:
        response.encode(writer)
    return writer.bytes()


def decode_responses(payload: bytes) -> list[Response]:
    reader = Reader(payload)
    responses = [Response.decode(reader) for _ in range(reader.count())]
    reader.done()
    return responses


def encode_count(count: int) -> bytes:
    return Writer().i64(count).bytes()


def decode_count(payload: bytes) -> int:
    reader = Reader(payload)
    count = reader.i64()
    reader.done()
    return count


def encode_reason(reason: str) -> bytes:
    return Writer().string(reason).bytes()


def decode_reason(payload: bytes) -> str:
    reader = Reader(payload)
    reason = reader.string()
    reader.done()
    return reason


E = TypeVar("E", bound=enum.IntEnum)


def _enum(kind: type[E], value: int) -> E:
    try:
        return kind(value)
    except ValueError:
        raise ProtocolError(f"unknown {kind.__name__} code {value}") from None
