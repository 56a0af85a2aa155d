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
with the same warning and shutdown times. The peer a rank waits for may itself be
waiting: in a ring every rank downstream of a frozen one stops within milliseconds,
and whichever clock ran out first would blame its own neighbour. So at the shutdown
time rank 0 asks every worker (a PING, which an alive rank answers from inside its own
data-phase wait) and, a grace period later, ends the job naming the ones that did not
answer. A worker asks rank 0 and gives it twice that grace: rank 0's verdict reaches it
first, unless rank 0 is the frozen one (then the worker names it) or is not in the
collective (then the worker names its own peers).

Both clocks run in rank 0's engine or in a data phase, so neither sees a rank 0 that is
frozen while the workers wait for its responses (its TCP stack still acknowledges what
they send). Each worker keeps a third clock for that (``SilentPeer``): after the warning
time without a word from rank 0 it asks (a PING, which rank 0 answers from any pass or
data-plane wait), and a question left unanswered ends the job like the others. Rank 0,
once it has shut down, keeps one on each worker it still waits for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

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


class Arbiter(Protocol):
    """Finds which ranks stopped, in a data-phase stall: rank 0 asks every worker, a
    worker asks rank 0."""

    def probe(self) -> None:
        """Asks those ranks whether they are alive (a PING each)."""

    def silent(self) -> list[int]:
        """The ranks that have not answered the last probe, sorted."""


MAX_GRACE = 5.0  # seconds an alive rank gets to answer a probe: it answers within a pass


class DataPhaseStall:
    """Reports a data-plane wait that made no progress (``hora.transport.tcp.Watch.on_stall``).

    Args:
        inspector: supplies the warning and shutdown times and the disable flag.
        rank: this process's global rank, for messages.
        describe: names the collective being executed, e.g. ``allreduce 'grad'``.

    Attributes:
        arbiter: what probes the other ranks at the shutdown time (see the module);
            None: the rank names the peers it waits for at once.
    """

    def __init__(self, inspector: StallInspector, rank: int, describe: Callable[[], str]) -> None:
        self._inspector = inspector
        self._rank = rank
        self._describe = describe
        self.arbiter: Arbiter | None = None

    @property
    def grace(self) -> float:
        """How long this rank waits for answers to its probe: rank 0 the warning time (at
        most ``MAX_GRACE``), a worker twice that, so that rank 0's verdict comes first."""
        grace = min(self._inspector.warn_after, MAX_GRACE)
        return grace if self._rank == 0 else 2 * grace

    @property
    def first_check(self) -> float | None:
        """Seconds without progress before the first report (None: stall checks are off)."""
        return self._inspector.warn_after if self._inspector.enabled else None

    def __call__(self, peers: Sequence[int], waited: float) -> float | None:
        """Warns about the stall, or past the shutdown time raises; returns when to look again.

        At the shutdown time it probes (rank 0 every worker, a worker rank 0) and returns
        the end of its grace; a worker's is the longer, so rank 0's verdict reaches it
        first, as an abort. Once the grace is over it raises, naming the ranks that did
        not answer, or if all did, the peers it waits for.

        Raises:
            StalledError: the wait lasted past the stall shutdown time (and the grace).
        """
        shutdown = self._inspector.shutdown_after
        if shutdown is None or waited < shutdown:
            log.warning("%s; it resumes if they do", self._message(peers, waited), extra=logs.at(self._rank))
            due = waited + self._inspector.warn_after
            return due if shutdown is None else min(due, shutdown)
        arbiter = self.arbiter
        if arbiter is not None and waited < shutdown + self.grace:
            arbiter.probe()
            return shutdown + self.grace
        message = self._message(peers, waited)
        silent = arbiter.silent() if arbiter is not None else []
        if silent:
            others = ", ".join(map(str, silent))
            message = (
                f"{self._describe()} has waited {waited:.0f} s in its data phase; rank(s) {others} stopped making "
                f"progress and answer no ping (a process frozen or stopped by a signal, swapping, or a wedged device)"
            )
        raise StalledError(f"{message}; shutting the job down after {shutdown:g} s")

    def _message(self, peers: Sequence[int], waited: float) -> str:
        who = ", ".join(map(str, peers)) or "?"
        return (
            f"{self._describe()} has waited {waited:.0f} s in its data phase for rank(s) {who}, which "
            "stopped making progress (a process frozen or stopped by a signal, swapping, or a wedged device)"
        )


class SilentPeer:
    """One rank's clock on a peer it waits for over a control link, which only a pass of
    the peer's engine answers.

    A worker keeps one on rank 0 while it waits for rank 0's responses; rank 0, once it
    has shut down, keeps one on each worker it still coordinates until that worker shuts
    down too. The silence starts anew whenever the peer sends anything, or this rank
    sends it work (``heard``). Once this rank, waiting, has heard nothing for the warning
    time, it sends a PING; an alive peer answers within a pass, however long it waits for
    others itself (its stall clocks report those). A PING unanswered for the warning time
    is reported, and again every warning time after; unanswered for the shutdown time
    less the warning time (so the silence lasted the whole shutdown time) it fails the
    job, naming the peer.

    Args:
        inspector: supplies the warning and shutdown times and the disable flag.
        rank: this rank, for messages.
        peer: the peer, as messages name it (``rank 3 on host h``).
        waiting_for: what this rank waits for, as messages say it (``its responses``).
        clock: returns seconds; injectable for tests.

    Attributes:
        due_at: the clock's time of the next step (a PING, a warning, the end); ``inf``
            with stall checks off. A sleep ends by then, waiting or not: one spare
            wake-up per warning time costs less than asking, on every sleep, whether
            anything waits.
        pings: PINGs sent so far: the next one's number.
    """

    def __init__(
        self,
        inspector: StallInspector,
        rank: int,
        peer: str,
        waiting_for: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._inspector = inspector
        self._rank = rank
        self._peer = peer
        self._waiting_for = waiting_for
        self._clock = clock
        self._quiet_since = 0.0
        self._pinged_at: float | None = None  # the unanswered PING's time, if one is
        self.due_at = float("inf")
        self.pings = 0
        self.heard()

    def heard(self) -> None:
        """The peer sent something, or this rank sent it work."""
        self._quiet_since = self._clock()
        self._pinged_at = None
        if self._inspector.enabled:
            self.due_at = self._quiet_since + self._inspector.warn_after

    def check(self, waiting: Callable[[], bool]) -> bool:
        """Takes the step that is due, if any (cheap when none is: a pass calls it).

        Args:
            waiting: says whether this rank waits for the peer (asked only when a step
                is due; not waiting, the silence starts anew).

        Returns:
            True when a PING is due: the caller sends it, numbered ``pings - 1``.

        Raises:
            StalledError: the peer left a PING unanswered past the shutdown time.
        """
        now = self._clock()
        if now < self.due_at:
            return False
        if not waiting():
            self.heard()
            return False
        inspector = self._inspector
        shutdown = inspector.shutdown_after
        pinged_at = self._pinged_at
        ping = pinged_at is None
        if pinged_at is None:
            self._pinged_at = pinged_at = now
            self.pings += 1
        else:
            message = (
                f"{self._peer} has sent nothing for {now - self._quiet_since:.0f} s while rank {self._rank} "
                f"waits for {self._waiting_for}, nor answered a ping for {now - pinged_at:.0f} s "
                "(a process frozen or stopped by a signal, swapping, or a wedged device)"
            )
            if shutdown is not None and now - pinged_at >= shutdown - inspector.warn_after:
                raise StalledError(f"{message}; shutting the job down after {shutdown:g} s")
            log.warning("%s; it resumes if the peer does", message, extra=logs.at(self._rank))
        self.due_at = now + inspector.warn_after
        if shutdown is not None:
            self.due_at = min(self.due_at, pinged_at + shutdown - inspector.warn_after)
        return ping
