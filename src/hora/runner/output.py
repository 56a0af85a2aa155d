"""Forwarding each rank's output, line by line, with Horovod's prefixes.

Every line a rank writes reaches ``horarun``'s own stream as it arrives, prefixed the
way ``horovodrun`` prefixes it: ``[<rank>]<stdout>:<line>`` on stdout and
``[<rank>]<stderr>:<line>`` on stderr; with ``--prefix-output-with-timestamp`` the
local time (``time.asctime()``) comes first. A line ends at ``\\n``, ``\\r\\n`` or a
lone ``\\r`` (so progress bars that redraw with ``\\r`` still show up). Bytes are
forwarded as they are, so output that is not UTF-8 passes through unchanged; a last
line without a newline is forwarded with one added.

With ``--output-filename DIR`` each stream is also written, unprefixed and byte for
byte, to ``DIR/rank.<rank>/stdout`` and ``.../stderr``; the rank number is
zero-padded to the width of ``size - 1`` so the directories sort in rank order.

For a rank on another host the stream is ssh's, and the supervisor there
(``hora.runner.remote``) writes control lines into stderr; a forwarder given a
``control`` callback takes them out and hands their data to it.

The forwarder of a rank's stderr also keeps the last ``TAIL_LINES`` lines and the last
Python traceback whole (``hora.runner.tracebacks``), for the failure summary.

One reader thread per stream drains the rank's pipe (a pipe that is not drained
would block the rank once the kernel buffer fills). ``Sink`` serialises writers so
lines from different ranks never interleave mid-line.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from typing import IO, Any, BinaryIO, TextIO

from hora.runner.control import decode_marker
from hora.runner.tracebacks import TracebackCatcher

TAIL_LINES = 10  # lines of stderr kept per rank for the failure summary
_CHUNK = 1 << 16
_MAX_LINE = 1 << 16  # a line longer than this is forwarded in pieces


class Sink:
    """A text stream that several threads write whole lines to.

    Writes bytes to the stream's binary buffer when it has one (a terminal, a file,
    a pipe), else decoded text (e.g. a notebook's stream). A stream that fails (a
    closed pipe) is dropped quietly so that ranks' pipes keep draining.

    Args:
        stream: the destination, e.g. ``sys.stdout``.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._broken = False

    def write(self, data: bytes) -> None:
        """Writes ``data`` at once and flushes.

        Args:
            data: whole lines.
        """
        with self._lock:
            if self._broken:
                return
            try:
                buffer: BinaryIO | None = getattr(self._stream, "buffer", None)
                if buffer is not None:
                    self._stream.flush()
                    buffer.write(data)
                    buffer.flush()
                else:
                    self._stream.write(data.decode("utf-8", errors="replace"))
                    self._stream.flush()
            except (OSError, ValueError):  # a closed pipe or a closed file
                self._broken = True

    def line(self, text: str) -> None:
        """Writes one line of ``horarun``'s own text.

        Args:
            text: the line, without its newline.
        """
        self.write(text.encode("utf-8", errors="replace") + b"\n")


def rank_dir(directory: str, rank: int, size: int) -> str:
    """Returns ``DIR/rank.<rank>``, the rank zero-padded to the width of ``size - 1``.

    Args:
        directory: the ``--output-filename`` directory.
        rank: the rank.
        size: the number of ranks.

    Returns:
        The rank's output directory, e.g. ``out/rank.03`` for rank 3 of 12.
    """
    width = len(str(max(size - 1, 0)))
    return os.path.join(directory, f"rank.{rank:0{width}d}")


class StreamForwarder:
    """Drains one stream of one rank in a daemon thread.

    Args:
        pipe: the read end of the rank's stdout or stderr pipe.
        rank: the rank, for the prefix.
        name: ``"stdout"`` or ``"stderr"``.
        sink: where prefixed lines go.
        copy: a file that receives the raw bytes too, or None; it is closed at EOF.
        timestamp: prefix each line with the local time.
        control: called with the data of each control line (``hora.runner.remote``),
            which is then not forwarded; None forwards every line.

    Attributes:
        tail: the last ``TAIL_LINES`` lines that are not blank.
        traceback: the stream's last Python traceback (a stderr forwarder only, else None).
    """

    def __init__(
        self,
        pipe: IO[bytes],
        rank: int,
        name: str,
        sink: Sink,
        copy: BinaryIO | None = None,
        timestamp: bool = False,
        control: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self._control = control
        self._pipe = pipe
        self._prefix = f"[{rank}]<{name}>:".encode()
        self._sink = sink
        self._copy = copy
        self._timestamp = timestamp
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.traceback = TracebackCatcher() if name == "stderr" else None
        self._thread = threading.Thread(target=self._run, name=f"hora-rank{rank}-{name}", daemon=True)

    def start(self) -> StreamForwarder:
        """Starts the reader thread and returns self."""
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the stream's end of file.

        Args:
            timeout: seconds to wait at most; None waits until EOF.

        Returns:
            True when the stream was drained to its end.
        """
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        pending = b""
        fd = self._pipe.fileno()
        try:
            while True:
                try:
                    chunk = os.read(fd, _CHUNK)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                if self._control is None:
                    self._save(chunk)
                pending = self._forward(pending + chunk)
            if pending:
                self._emit([pending + b"\n"])
        finally:
            self._pipe.close()
            if self._copy is not None:
                self._copy.close()

    def _save(self, chunk: bytes) -> None:
        if self._copy is None:
            return
        try:
            self._copy.write(chunk)
        except OSError:  # a full disk must not stop the forwarding
            self._copy.close()
            self._copy = None

    def _forward(self, data: bytes) -> bytes:
        """Forwards the complete lines in ``data`` and returns the incomplete rest."""
        lines = data.splitlines(keepends=True)  # bytes split at \n, \r\n and \r only
        rest = lines.pop() if lines and not lines[-1].endswith((b"\n", b"\r")) else b""
        # A lone \r at the very end may be the first half of \r\n: keep it for the next chunk.
        if lines and lines[-1].endswith(b"\r") and not rest:
            rest = lines.pop()
        while len(rest) > _MAX_LINE:
            lines.append(rest[:_MAX_LINE] + b"\n")
            rest = rest[_MAX_LINE:]
        if lines:
            self._emit(lines)
        return rest

    def _emit(self, lines: list[bytes]) -> None:
        if self._control is not None:
            lines = self._take_control(lines)
            if not lines:
                return
            self._save(b"".join(lines))
        head = self._prefix
        if self._timestamp:
            head = time.asctime().encode() + head
        self._sink.write(b"".join(head + line for line in lines))
        for line in lines:
            text = line.rstrip(b"\r\n").decode("utf-8", errors="replace")
            if self.traceback is not None:
                self.traceback.feed(text)
            if text.strip():
                self.tail.append(text)

    def _take_control(self, lines: list[bytes]) -> list[bytes]:
        """Removes control lines, passing their data on; keeps text before a marker."""
        assert self._control is not None
        kept = []
        for line in lines:
            text, data = decode_marker(line)
            if data is None:
                kept.append(line)
                continue
            self._control(data)
            if text:
                kept.append(text + b"\n")
        return kept
