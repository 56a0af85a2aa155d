import random

import pytest

from hora.engine import messages
from hora.engine.messages import Request, RequestType, Response, ResponseType
from hora.errors import ProtocolError
from hora.transport.codec import Reader, Writer
from hora.transport.tcp import FrameReader, encode_frame


def test_request_and_response_round_trip():
    requests = [
        Request(3, RequestType.ALLTOALL, "alltoall.x", 2, 7, (4, 5), 1, 0, 0.5, 2.0, (1, 3), "grp", 2),
        Request(0, RequestType.ALLREDUCE, "allreduce.ünïcode", shape=()),
        Request(1, RequestType.BROADCAST, "broadcast.y", error="ValueError: bad root", scope=5),
    ]
    assert messages.decode_requests(messages.encode_requests(requests)) == (requests, [], [])
    assert messages.decode_requests(messages.encode_requests(requests, [4, 0, 7])) == (requests, [4, 0, 7], [])
    riders = [b"", b"\x00\x01", b"", b"", b"abcd", b""]
    assert messages.decode_requests(messages.encode_requests(requests, [4, 0, 7], riders)) == (requests, [4, 0, 7], riders)
    with pytest.raises(ProtocolError, match="2 riders for 6 tensors"):
        messages.decode_requests(messages.encode_requests(requests, [4, 0, 7], [b"", b"x"]))
    responses = [
        Response(ResponseType.ALLREDUCE, ["a", "b"], 1, 7, 1, 0, 1.0, 0.25, [3, 4]),
        Response(ResponseType.ERROR, ["c"], error="allreduce 'c': shapes differ"),
        Response(ResponseType.BROADCAST, ["d"], root_rank=2, data=b"\x01\x02\x03\x04"),
    ]
    assert messages.decode_responses(messages.encode_responses(responses)) == responses
    assert messages.decode_reason(messages.encode_reason("why")) == "why"


def test_label_strips_the_binding_prefix():
    assert Request(0, RequestType.ALLREDUCE, "allreduce.grad.w").label == "allreduce 'grad.w'"
    assert Request(0, RequestType.ALLGATHER, "other").label == "allgather 'other'"


def test_garbage_never_decodes_into_anything_but_protocol_error():
    rng = random.Random(7)
    valid = messages.encode_requests([Request(1, RequestType.BROADCAST, "broadcast.x", shape=(2, 2))])
    for trial in range(3000):
        if trial % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(60)))
        else:  # a valid message with a few bytes flipped or cut
            data = bytearray(valid[: rng.randrange(len(valid) + 1)])
            for _ in range(3):
                if data:
                    data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        try:
            messages.decode_requests(data)
        except ProtocolError:
            pass


def test_reader_bounds():
    with pytest.raises(ProtocolError, match="truncated"):
        Reader(b"\x01").u32()
    with pytest.raises(ProtocolError, match="longer than any"):
        Reader(Writer().u32(1 << 30).bytes()).string()
    with pytest.raises(ProtocolError, match="unexpected bytes"):
        reader = Reader(b"\x00\x00")
        reader.u8()
        reader.done()


def test_frame_reader_assembles_frames_from_any_split():
    stream = encode_frame(1, b"hello") + encode_frame(2, b"") + encode_frame(3, b"x" * 1000)
    for cut in range(len(stream)):
        reader = FrameReader()
        frames = reader.feed(stream[:cut]) + reader.feed(stream[cut:])
        assert frames == [(1, b"hello"), (2, b""), (3, b"x" * 1000)]


def test_frame_reader_rejects_oversized_frames():
    reader = FrameReader(max_size=10)
    with pytest.raises(ProtocolError, match="exceeds"):
        reader.feed(encode_frame(1, b"x" * 11))
