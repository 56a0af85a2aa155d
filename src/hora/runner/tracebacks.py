"""A rank's last Python traceback, caught whole (and bounded) from its stderr for the failure summary.

A crashed Python rank's stderr ends with a traceback, which is often longer than the ten
lines ``horarun`` keeps of every rank's stderr, so a plain tail starts mid-traceback.
``TracebackCatcher`` reads every stderr line as it is forwarded and keeps the last
traceback from its ``Traceback (most recent call last):`` line to the exception line.

How a traceback is told apart from other output:

* It starts at a line that is exactly ``Traceback (most recent call last):`` (or, for an
  exception group, ``  + Exception Group Traceback (most recent call last):``).
* It goes on while lines are indented (frames, source lines, carets; every line of an
  exception group is), and ends at the first line that is not: the exception line
  (``ValueError: boom``), which belongs to it, except after an exception group, which
  ends with its last indented line.
* A traceback that Python chains to the one before (the line ``During handling of the
  above exception, another exception occurred:`` or ``The above exception was the
  direct cause of the following exception:`` between them, and nothing else but blank
  lines) continues the same one: the chain is what Python printed for one error.
* Any other traceback replaces the one kept before it.

Lines written after the traceback ended are counted and the last ``AFTER_LINES`` kept,
so the summary can show them after it (``snapshot`` returns both).

Bounds: the first ``FIRST_LINES`` and the last ``LAST_LINES`` lines of a traceback are
kept while it streams, with a count of the lines between (the middle frames), each line
cut at ``LINE_CHARS`` characters; ``lines()`` then fits the whole into ``MAX_CHARS``. A
traceback of ten thousand frames costs no more memory than one of sixty lines.
"""

from __future__ import annotations

import collections
import dataclasses

FIRST_LINES = 10  # the traceback's first lines: where the program entered (the outer frames)
LAST_LINES = 50  # its last lines: the innermost frames and the exception
LINE_CHARS = 1000  # a longer line is cut (an exception message naming every rank fits)
MAX_CHARS = 8192  # the most ``lines()`` returns, cut from the middle frames
AFTER_LINES = 10  # lines after the traceback kept for the summary
_MIN_TAIL = 4  # lines at the end ``lines()`` keeps however long they are

_STARTS = ("Traceback (most recent call last):", "  + Exception Group Traceback (most recent call last):")
_CHAINS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)


@dataclasses.dataclass(frozen=True)
class LastTraceback:
    """A rank's last traceback and what it wrote after it.

    Attributes:
        lines: the traceback (``TracebackCatcher.lines``).
        after: the last ``AFTER_LINES`` lines that are not blank written after it.
        after_count: how many such lines were written after it in all.
    """

    lines: tuple[str, ...]
    after: tuple[str, ...] = ()
    after_count: int = 0


def _cut(line: str) -> str:
    if len(line) <= LINE_CHARS:
        return line
    return f"{line[:LINE_CHARS]} ... ({len(line) - LINE_CHARS} more characters)"


class TracebackCatcher:
    """Keeps the last traceback in a stream of lines, and the lines after it.

    Invariant: ``_head``, ``_cut_lines`` and ``_tail`` describe the last traceback seen (all
    empty before the first); ``_in_traceback`` is True while it is still being read;
    ``_chain`` holds the lines since it ended while they may still lead into a chained
    traceback (blank lines and chaining lines only), and is None once another line came.
    """

    def __init__(self) -> None:
        self._head: list[str] = []
        self._tail: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        self._cut_lines = 0
        self._in_traceback = False
        self._group = False
        self._chain: list[str] | None = None
        self._after: collections.deque[str] = collections.deque(maxlen=AFTER_LINES)
        self._after_count = 0  # lines that are not blank after the traceback, kept or not

    def feed(self, line: str) -> None:
        """Reads one line of the stream.

        Args:
            line: the line without its line ending.
        """
        if self._in_traceback:
            if line.startswith((" ", "\t")):
                self._add(line)
                return
            self._in_traceback = False
            self._chain = []
            if not self._group:
                self._add(line)  # the exception line ends the traceback
                return
        if line in _STARTS:
            chained = self._chain is not None and any(text.strip() in _CHAINS for text in self._chain)
            if chained:
                assert self._chain is not None
                for text in self._chain:
                    self._add(text)
            else:
                self._head.clear()
                self._tail.clear()
                self._cut_lines = 0
            self._after.clear()
            self._after_count = 0
            self._in_traceback = True
            self._group = line != _STARTS[0]
            self._chain = None
            self._add(line)
            return
        if not self._head:
            return
        if self._chain is not None:
            if not line.strip() or line.strip() in _CHAINS:
                self._chain.append(line)
            else:
                self._chain = None
        if line.strip():
            self._after.append(_cut(line))
            self._after_count += 1

    def _add(self, line: str) -> None:
        if len(self._head) < FIRST_LINES:
            self._head.append(_cut(line))
            return
        if len(self._tail) == self._tail.maxlen:
            self._cut_lines += 1
        self._tail.append(_cut(line))

    def lines(self) -> list[str]:
        """The last traceback, whole if it fits in ``MAX_CHARS``; else cut in its middle.

        Returns:
            Its lines, with one line saying how many were left out if any were; empty
            when the stream had no traceback.
        """
        head = list(self._head)
        tail = list(self._tail)
        cut = self._cut_lines
        # Fit the characters: drop the outermost of the kept inner lines first, then the
        # innermost of the outer ones, never the last few (the exception and its frame).
        while sum(map(len, head)) + sum(map(len, tail)) > MAX_CHARS and len(head) + len(tail) > _MIN_TAIL:
            if len(tail) > _MIN_TAIL:
                tail.pop(0)
            else:
                head.pop()
            cut += 1
        if not cut:
            return head + tail
        frames = f"... {cut} line{'s' if cut != 1 else ''} of the traceback left out (the middle frames) ..."
        return [*head, frames, *tail]

    def snapshot(self) -> LastTraceback | None:
        """The last traceback and the lines after it; None when there was none."""
        lines = self.lines()
        if not lines:
            return None
        return LastTraceback(tuple(lines), tuple(self._after), self._after_count)
