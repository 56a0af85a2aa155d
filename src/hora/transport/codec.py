"""Compact binary encoding for control messages (never pickle).

``Writer`` appends little-endian fields to a bytearray; ``Reader`` reads them back
and raises ``ProtocolError`` on any malformed input (short buffer, bad UTF-8, a
length that runs past the end), so a corrupt or hostile frame can never crash the
reader with anything but a clear error.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from hora.errors import ProtocolError

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")

# Upper bounds that no legitimate message reaches; they stop a corrupt length
# field from making the reader allocate gigabytes.
MAX_STRING = 1 << 20
MAX_LIST = 1 << 24


class Writer:
    """Builds one message."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def u8(self, value: int) -> Writer:
        self.buffer += _U8.pack(value)
        return self

    def u32(self, value: int) -> Writer:
        self.buffer += _U32.pack(value)
        return self

    def i64(self, value: int) -> Writer:
        self.buffer += _I64.pack(value)
        return self

    def f64(self, value: float) -> Writer:
        self.buffer += _F64.pack(value)
        return self

    def blob(self, value: bytes) -> Writer:
        self.u32(len(value))
        self.buffer += value
        return self

    def string(self, value: str) -> Writer:
        return self.blob(value.encode("utf-8"))

    def i64s(self, values: Sequence[int]) -> Writer:
        self.u32(len(values))
        self.buffer += struct.pack(f"<{len(values)}q", *values)
        return self

    def fixed(self, layout: struct.Struct, *values: object) -> Writer:
        """Appends several fixed-size fields at once (``layout`` little-endian, unpadded)."""
        self.buffer += layout.pack(*values)
        return self

    def bytes(self) -> bytes:
        return bytes(self.buffer)


class Reader:
    """Reads one message; every method raises ProtocolError on malformed input."""

    def __init__(self, data: bytes | memoryview) -> None:
        self._data = memoryview(data)
        self._offset = 0

    def _take(self, count: int) -> memoryview:
        end = self._offset + count
        if count < 0 or end > len(self._data):
            raise ProtocolError(f"message truncated: wanted {count} bytes at offset {self._offset} of {len(self._data)}")
        view = self._data[self._offset : end]
        self._offset = end
        return view

    def u8(self) -> int:
        return int(_U8.unpack(self._take(1))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self._take(4))[0])

    def i64(self) -> int:
        return int(_I64.unpack(self._take(8))[0])

    def f64(self) -> float:
        return float(_F64.unpack(self._take(8))[0])

    def fixed(self, layout: struct.Struct) -> tuple[Any, ...]:
        """Reads several fixed-size fields at once (``layout`` little-endian, unpadded)."""
        return layout.unpack(self._take(layout.size))

    def blob(self) -> bytes:
        length = self.u32()
        if length > MAX_LIST * 8:
            raise ProtocolError(f"blob of {length} bytes is larger than any hora message")
        return bytes(self._take(length))

    def string(self) -> str:
        length = self.u32()
        if length > MAX_STRING:
            raise ProtocolError(f"string of {length} bytes is longer than any hora name")
        try:
            return str(self._take(length), "utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"string is not valid UTF-8: {exc}") from None

    def i64s(self) -> list[int]:
        count = self.u32()
        if count > MAX_LIST:
            raise ProtocolError(f"list of {count} integers is longer than any hora message")
        return list(struct.unpack(f"<{count}q", self._take(8 * count)))

    def count(self, limit: int = MAX_LIST) -> int:
        """Reads a u32 element count and checks it against ``limit``."""
        value = self.u32()
        if value > limit:
            raise ProtocolError(f"count {value} exceeds the limit {limit}")
        return value

    def done(self) -> None:
        """Checks that the whole message was consumed."""
        if self._offset != len(self._data):
            raise ProtocolError(f"{len(self._data) - self._offset} unexpected bytes at the end of a message")
