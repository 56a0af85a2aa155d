"""The failure summary's traceback: caught whole from a rank's stderr lines, bounded when long."""

from __future__ import annotations

import sys
import traceback

import pytest

from hora.runner.tracebacks import FIRST_LINES, LAST_LINES, LINE_CHARS, MAX_CHARS, TracebackCatcher

pytestmark = pytest.mark.timeout(30)


def formatted(exc: BaseException) -> list[str]:
    """The lines Python prints for ``exc`` when it ends a program."""
    return "".join(traceback.format_exception(exc)).splitlines()


def ping(level: int, message: str) -> None:
    if level == 0:
        raise ValueError(message)
    pong(level - 1, message)


def pong(level: int, message: str) -> None:
    ping(level, message)  # alternating frames: Python does not fold them into "[Previous line repeated]"


def raised(depth: int, message: str = "boom") -> BaseException:
    try:
        ping(depth, message)
    except ValueError as exc:
        return exc
    raise AssertionError("unreachable")


def caught(lines: list[str]) -> TracebackCatcher:
    catcher = TracebackCatcher()
    for line in lines:
        catcher.feed(line)
    return catcher


def test_a_traceback_is_kept_whole_with_what_came_after() -> None:
    lines = formatted(raised(8))
    assert len(lines) > 30  # longer than the ten lines of a plain tail
    catcher = caught(["step 1", "  indented noise", "", *lines, "", "rank exiting", "bye"])
    snapshot = catcher.snapshot()
    assert snapshot is not None
    assert list(snapshot.lines) == lines
    assert snapshot.lines[0] == "Traceback (most recent call last):" and snapshot.lines[-1] == "ValueError: boom"
    assert snapshot.after == ("rank exiting", "bye") and snapshot.after_count == 2


def test_no_traceback_no_snapshot() -> None:
    assert caught(["a", "  b", "During handling of the above exception, another exception occurred:"]).snapshot() is None


def test_chained_tracebacks_are_one() -> None:
    for cause in (True, False):
        try:
            try:
                raise KeyError("first")
            except KeyError as first:
                if cause:
                    raise RuntimeError("second") from first
                raise RuntimeError("second")
        except RuntimeError as exc:
            lines = formatted(exc)
        assert sum(line == "Traceback (most recent call last):" for line in lines) == 2
        assert caught(["noise", *lines]).lines() == lines


def test_an_unrelated_later_traceback_replaces_the_first() -> None:
    first, second = formatted(raised(2, "first")), formatted(raised(3, "second"))
    catcher = caught([*first, "logged in between", *second, "after"])
    snapshot = catcher.snapshot()
    assert snapshot is not None and list(snapshot.lines) == second
    assert snapshot.after == ("after",) and snapshot.after_count == 1


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups")
def test_an_exception_group_is_kept_whole() -> None:
    try:
        raise ExceptionGroup("two failures", [ValueError("a"), KeyError("b")])  # noqa: F821 - 3.11+
    except Exception as exc:  # an ExceptionGroup
        lines = formatted(exc)
    assert lines[0] == "  + Exception Group Traceback (most recent call last):"
    catcher = caught([*lines, "after the group"])
    snapshot = catcher.snapshot()
    assert snapshot is not None and list(snapshot.lines) == lines and snapshot.after == ("after the group",)


def test_a_long_traceback_is_cut_in_its_middle_frames_and_says_so() -> None:
    lines = formatted(raised(300, "deep"))
    assert len(lines) > 600
    kept = caught(lines).lines()
    cut = len(lines) - FIRST_LINES - LAST_LINES
    assert kept[:FIRST_LINES] == lines[:FIRST_LINES]
    assert kept[FIRST_LINES] == f"... {cut} lines of the traceback left out (the middle frames) ..."
    assert kept[FIRST_LINES + 1 :] == lines[-LAST_LINES:]
    assert kept[-1] == "ValueError: deep"


def test_long_lines_are_cut_and_the_whole_fits_in_max_chars() -> None:
    lines = formatted(raised(40, "x" * 50_000))
    kept = caught(lines).lines()
    assert kept[0] == "Traceback (most recent call last):"
    exception = f"ValueError: {'x' * 50_000}"
    assert kept[-1] == f"{exception[:LINE_CHARS]} ... ({len(exception) - LINE_CHARS} more characters)"
    assert sum(map(len, kept)) <= MAX_CHARS + 100  # plus the line that says what was left out
    assert "lines of the traceback left out" in kept[FIRST_LINES]


def test_a_traceback_cut_short_by_a_kill_is_kept_as_far_as_it_came() -> None:
    lines = formatted(raised(3))
    assert caught(lines[:-2]).lines() == lines[:-2]


def test_wide_frames_are_dropped_from_the_middle_until_the_whole_fits() -> None:
    frames = [f'  File "{"d" * 600}.py", line {i}, in f{i}' for i in range(100)]
    lines = ["Traceback (most recent call last):", *frames, "OSError: disk full"]
    kept = caught(lines).lines()
    marker = next(line for line in kept if "left out" in line)
    assert sum(len(line) for line in kept if line is not marker) <= MAX_CHARS
    cut = int(marker.split()[1])
    assert len(kept) == len(lines) - cut + 1
    assert kept[0] == lines[0] and kept[-3:] == lines[-3:]
