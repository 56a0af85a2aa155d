"""The stall inspector: names the ranks that have not submitted a tensor others are waiting on.

When some ranks submit a tensor and others do not, the job waits forever. On rank 0,
the inspector warns every ``HORA_STALL_CHECK_TIME_SECONDS`` while that lasts, listing
each missing rank and the tensors it has not submitted; past
``HORA_STALL_SHUTDOWN_TIME_SECONDS`` (when set above the warning time) it fails the
job so that every rank raises instead of hanging. It only wakes the engine while
something waits; an idle engine has no timer.

The data phase has a clock of its own on every rank (``DataPhaseStall``): once every
member has submitted a collective, its transfers wait only for peers that are running
it, so a wait that makes no progress for the warning time means a peer stopped
(frozen by SIGSTOP, swapping, a wedged driver). The rank that waits names those peers,
with the same warning and shutdown times.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from hora import logs
from hora.config import Config
from hora.engine.coordinator import Coordinator, Stall

log = logging.getLogger(__name__)


class StalledError(Exception):
    """Tensors waited past the shutdown time; the message lists them."""


def stall_report(stalls: list[Stall], seconds: float) -> str:
    """Formats the warning: which ranks are missing which tensors."""
    missing: dict[int, list[str]] = {}
    for stall in stalls:
        for rank in stall.missing:
            missing.setdefault(rank, []).append(stall.name)
    lines = [
        f"hora: tensors submitted by some ranks have waited more than {seconds:g} s for the others. "
        "This happens when ranks submit different tensors, or only some ranks submit, and it will not "
        "resolve by itself.",
        "Missing ranks:",
    ]
    for rank in sorted(missing):
        names = missing[rank]
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        lines.append(f"{rank}: [{shown}]")
    return "\n".join(lines)


class StallInspector:
    """Watches the coordinator's pending tensors.

    Args:
        config: supplies the warning and shutdown times and the disable flag.
        clock: returns seconds; injectable for tests.
    """

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = not config.stall_check_disable
        self.warn_after = config.stall_check_time_seconds
        # As in Horovod, a shutdown time at or below the warning time is ignored.
        shutdown = config.stall_shutdown_time_seconds
        self.shutdown_after = shutdown if shutdown > self.warn_after else None
        self._clock = clock
        self._last_warning = float("-inf")

    def seconds_to_next_check(self, coordinator: Coordinator) -> float | None:
        """How long the engine may sleep before the next check; None when nothing waits."""
        oldest = coordinator.next_deadline()
        if not self.enabled or oldest is None:
            return None
        due = max(oldest + self.warn_after, self._last_warning + self.warn_after)
        if self.shutdown_after is not None:
            due = min(due, oldest + self.shutdown_after)
        return max(0.0, due - self._clock())

    def check(self, coordinator: Coordinator) -> None:
        """Warns about stalled tensors; past the shutdown time raises StalledError."""
        if not self.enabled or coordinator.next_deadline() is None:
            return
        stalls = coordinator.stalls(self.warn_after)
        if stalls:
            self.report(stalls)

    def report(self, stalls: list[Stall]) -> None:
        """Warns about tensors that waited at least the warning time (at most once per
        warning time); past the shutdown time raises StalledError."""
        now = self._clock()
        if self.shutdown_after is not None:
            doomed = [s for s in stalls if s.waited >= self.shutdown_after]
            if doomed:
                raise StalledError(
                    stall_report(doomed, self.warn_after)
                    + f"\nThese tensors stalled for longer than {self.shutdown_after:g} s; shutting the job down."
                )
        if now - self._last_warning >= self.warn_after:
            self._last_warning = now
            log.warning("%s", stall_report(stalls, self.warn_after).removeprefix("hora: "))


class DataPhaseStall:
    """Reports a data-plane wait that made no progress (``hora.transport.tcp.Watch.on_stall``).

    Args:
        inspector: supplies the warning and shutdown times and the disable flag.
        rank: this process's global rank, for messages.
        describe: names the collective being executed, e.g. ``allreduce 'grad'``.
    """

    def __init__(self, inspector: StallInspector, rank: int, describe: Callable[[], str]) -> None:
        self._inspector = inspector
        self._rank = rank
        self._describe = describe

    @property
    def first_check(self) -> float | None:
        """Seconds without progress before the first report (None: stall checks are off)."""
        return self._inspector.warn_after if self._inspector.enabled else None

    def __call__(self, peers: Sequence[int], waited: float) -> float | None:
        """Warns about the stall, or past the shutdown time raises; returns when to look again.

        Raises:
            StalledError: the wait lasted past the stall shutdown time.
        """
        who = ", ".join(map(str, peers)) or "?"
        message = (
            f"{self._describe()} has waited {waited:.0f} s in its data phase for rank(s) {who}, which "
            "stopped making progress (a process frozen or stopped by a signal, swapping, or a wedged device)"
        )
        shutdown = self._inspector.shutdown_after
        if shutdown is not None and waited >= shutdown:
            raise StalledError(f"{message}; shutting the job down after {shutdown:g} s")
        log.warning("%s; it resumes if they do", message, extra=logs.at(self._rank))
        due = waited + self._inspector.warn_after
        return due if shutdown is None else min(due, shutdown)
