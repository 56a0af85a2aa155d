"""The report ``horarun`` prints when a job does not succeed, root cause first.

A failed job reads like this (a rank raised, the others were stopped)::

    horarun: rank 1 failed first: exit code 1 (host localhost, pid 4242, 0.41 s after start)
    horarun: rank 1's last traceback (from its stderr):
        Traceback (most recent call last):
          File "train.py", line 12, in <module>
            main()
          ...
        ValueError: boom
    horarun: the other ranks:
        rank 0 (host localhost, pid 4241): stopped by SIGTERM
        rank 2 (host localhost, pid 4243): did not stop within 5 s of SIGTERM: killed by SIGKILL

The first line names the rank that failed on its own earliest, its host, pid (on that
host) and exit code or signal, or, for a rank on another host whose ssh connection ended
without word from the host, that the connection to the host was lost. The lines after it
show, when the rank wrote a Python traceback to stderr, its last one whole, from
``Traceback (most recent call last):`` to the exception line (a long one is cut in its
middle frames, and says so: ``hora.runner.tracebacks``), then the lines it wrote after
it, if any; else the last lines of its stderr; or the caller's ``detail`` instead (e.g.
the traceback ``hora.run`` collected). Then one line per other rank says how it ended.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

from hora.runner.job import JobResult, RankOutcome
from hora.runner.workers import describe_status, signal_name

PREFIX = "horarun: "
INDENT = "    "


def _where(rank: RankOutcome) -> str:
    if rank.remote:
        return f"host {rank.slot.hostname} over ssh, pid {rank.pid}"
    return f"host {rank.slot.hostname}, pid {rank.pid}"


def _cause(rank: RankOutcome, code: int) -> str:
    if rank.lost:
        return (
            f"lost the ssh connection to host {rank.slot.hostname} (ssh {describe_status(code)}: the host, its sshd "
            "or the network went away)"
        )
    return describe_status(code)


def rank_status(rank: RankOutcome, grace: float) -> str:
    """Says how a rank that was not the root cause ended.

    Args:
        rank: the rank's outcome.
        grace: the seconds between SIGTERM and SIGKILL.

    Returns:
        e.g. ``"stopped by SIGTERM"`` or ``"had finished (exit code 0)"``.
    """
    code = rank.returncode
    if code is None:
        return "still running: it could not be reaped, even after SIGKILL"
    if not rank.signals_sent:
        return "had finished (exit code 0)" if code == 0 else f"also failed: {describe_status(code)}"
    if code == -signal.SIGKILL and signal.SIGKILL in rank.signals_sent:
        return f"did not stop within {grace:g} s of SIGTERM: killed by SIGKILL"
    if code == -signal.SIGTERM:
        return "stopped by SIGTERM"
    return f"stopped after SIGTERM ({describe_status(code)})"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


def _last_words(rank: RankOutcome) -> list[str]:
    """What the root-cause rank last wrote to stderr: its last traceback whole, else its tail."""
    number = rank.slot.rank
    caught = rank.traceback
    if caught is None:
        tail = rank.stderr_tail
        if not tail:
            return [f"{PREFIX}rank {number} wrote nothing to stderr"]
        heading = f"{PREFIX}last {_plural(len(tail), 'line')} of rank {number}'s stderr:"
        return [heading, *(INDENT + line for line in tail)]
    lines = [f"{PREFIX}rank {number}'s last traceback (from its stderr):", *(INDENT + line for line in caught.lines)]
    if caught.after:
        shown = "" if len(caught.after) == caught.after_count else f"; the last {len(caught.after)}"
        more = _plural(caught.after_count, "more line")
        lines.append(f"{PREFIX}rank {number} wrote {more} to stderr after it{shown}:")
        lines.extend(INDENT + line for line in caught.after)
    return lines


def failure_lines(result: JobResult, detail: Sequence[str] | None = None, detail_title: str | None = None) -> list[str]:
    """Formats the report of a job that did not succeed.

    Args:
        result: how the job ended.
        detail: lines to show under the root cause instead of its stderr tail.
        detail_title: the heading of ``detail``.

    Returns:
        The report's lines (without newlines); empty when the job succeeded.
    """
    lines: list[str] = []
    shown: set[int] = set()
    if result.start_error is not None:
        lines.append(f"{PREFIX}error: {result.start_error}")
    if result.first_failure is not None:
        first = result.ranks[result.first_failure]
        shown.add(first.slot.rank)
        when = "" if first.exit_after is None else f", {first.exit_after:.2f} s after start"
        code = first.returncode if first.returncode is not None else 1
        lines.append(f"{PREFIX}rank {first.slot.rank} failed first: {_cause(first, code)} ({_where(first)}{when})")
        if detail is None:
            lines.extend(_last_words(first))
        else:
            lines.append(f"{PREFIX}{detail_title or 'details'}:")
            lines.extend(INDENT + line for line in detail)
    if result.interrupted_by is not None:
        lines.insert(0, f"{PREFIX}interrupted by {signal_name(result.interrupted_by)}: every rank was stopped")
    if result.timed_out:
        running = ", ".join(str(rank) for rank in result.running_at_stop) or "none"
        lines.insert(0, f"{PREFIX}timed out: ranks still running: {running}; every rank was stopped")
    others = [rank for rank in result.ranks if rank.slot.rank not in shown]
    if lines and others:
        lines.append(f"{PREFIX}the other ranks:" if shown else f"{PREFIX}the ranks:")
        lines.extend(
            f"{INDENT}rank {rank.slot.rank} ({_where(rank)}): {rank_status(rank, result.grace)}" for rank in others
        )
    return lines
