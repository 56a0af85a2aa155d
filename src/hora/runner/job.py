"""Running one job: start every rank, watch them, stop them all when one fails.

``Job.run`` owns everything a job starts and stops all of it before returning:

1. a fresh secret and a ``RendezvousServer`` (stopped at the end), on ``127.0.0.1`` when
   every host is this machine, else on every interface (``hora.runner.placement``);
2. one ``Worker`` per rank, each in its own process group (on a remote host, under
   ``hora.runner.remote`` started over ssh), with its output forwarded; each local rank's
   group is handed to the job's ``Lifeline`` (``hora.runner.lifeline``), whose guardian
   stops them if ``horarun`` dies without doing so (even by SIGKILL);
3. a watch loop on one event queue fed by the waiter threads (a rank exited) and,
   when ``handle_signals`` is on, by SIGINT/SIGTERM/SIGHUP handlers.

The job ends when every rank exited 0, or at the first of: a rank exits non-zero or
by a signal (the root cause: the earliest such rank, passing over ranks whose stderr
ends with ``HoraInternalError``, which hora raises when another rank failed),
``horarun`` receives a signal, the timeout passes. After a failure the other ranks get
``SETTLE_PERIOD`` to fail by themselves (so their own errors, which name the lost rank,
reach the user). Then every rank's process group gets SIGTERM; ranks still running
after ``GRACE_PERIOD`` seconds (or at once, on a second signal) get SIGKILL, and the job
waits until every rank is reaped. No rank outlives ``Job.run``, and neither does anything
a rank started: what is left of each rank's process group gets SIGKILL at the end (on a
remote host its supervisor does the same). Nor does any outlive the launcher's process:
if it dies before ``Job.run`` returns, the lifeline's guardian (here) and the supervisors
(on other hosts) stop every rank.

Invariant: only the thread that calls ``run`` signals ranks or changes the job's
state; the other threads only post events and record exits.
"""

from __future__ import annotations

import dataclasses
import queue
import re
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import FrameType

from hora.runner import hosts
from hora.runner.hosts import SlotInfo
from hora.runner.lifeline import Lifeline
from hora.runner.output import Sink
from hora.runner.placement import Placement, plan_placement
from hora.runner.settings import LaunchSettings
from hora.runner.ssh import SshSettings
from hora.runner.tracebacks import LastTraceback
from hora.runner.workers import Event, Worker, kill_workers, launch, signal_name, stop_workers
from hora.transport import auth
from hora.transport.rendezvous_server import RendezvousServer

GRACE_PERIOD = 5.0  # seconds between SIGTERM and SIGKILL
# After the first failure, seconds the other ranks get to fail by themselves first: a hora
# rank raises within milliseconds of losing a peer, and its own error names the cause.
SETTLE_PERIOD = 1.0
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_POLL = 0.1  # seconds; a signal delivered to another thread does not wake a blocked get
_OUTPUT_TIMEOUT = 2.0  # seconds to wait for pipes a rank's leftovers may hold open


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """How one rank ended.

    Attributes:
        slot: where the rank ran.
        pid: its process id (on its host).
        returncode: its exit code, minus the signal number if a signal ended it, or
            None if it could not be reaped.
        exit_after: seconds from the job's start to its exit, or None.
        signals_sent: the signals the launcher sent it while it ran.
        stderr_tail: the last lines it wrote to stderr.
        remote: it ran on another host, over ssh.
        lost: its ssh connection ended without word from the host (host or network lost).
        traceback: the last Python traceback it wrote to stderr, whole (or cut in its
            middle when long), and what it wrote after it; None if it wrote none.
    """

    slot: SlotInfo
    pid: int
    returncode: int | None
    exit_after: float | None
    signals_sent: tuple[int, ...]
    stderr_tail: tuple[str, ...]
    remote: bool = False
    lost: bool = False
    traceback: LastTraceback | None = None


@dataclasses.dataclass(frozen=True)
class JobResult:
    """How a job ended.

    Attributes:
        ranks: every rank that was started, by rank.
        first_failure: the rank that failed first (the root cause), or None.
        interrupted_by: the signal that stopped the job, or None.
        timed_out: the job was stopped because its timeout passed.
        running_at_stop: the ranks still running when the job was stopped.
        start_error: why a rank could not be started, or None.
        grace: the seconds ranks had between SIGTERM and SIGKILL.
    """

    ranks: tuple[RankOutcome, ...]
    first_failure: int | None = None
    interrupted_by: int | None = None
    timed_out: bool = False
    running_at_stop: tuple[int, ...] = ()
    start_error: str | None = None
    grace: float = GRACE_PERIOD

    @property
    def exit_code(self) -> int:
        """The launcher's exit code: 0 on success; 128+signum when interrupted; the
        failed rank's exit code (128+signum when a signal ended it); 124 on timeout;
        127 when a rank could not be started."""
        if self.interrupted_by is not None:
            return 128 + self.interrupted_by
        if self.start_error is not None:
            return 127
        if self.first_failure is not None:
            code = self.ranks[self.first_failure].returncode
            return 1 if code is None else (code if code > 0 else 128 - code)
        if self.timed_out:
            return 124
        return 0


class Job:
    """One run of ``settings.command`` on the ranks of ``slots``; ``run`` it once.

    Args:
        settings: the launch settings.
        slots: where each rank runs, by rank.
        stdout: where ranks' prefixed stdout lines go.
        stderr: where ranks' prefixed stderr lines and the launcher's notes go.
        base_env: the environment ranks inherit.
        grace: seconds between SIGTERM and SIGKILL when stopping ranks.
        placement: how the hosts are reached; None works it out (probing remote
            hosts over ssh, which raises ``placement.HostsError`` for a host that
            cannot take part).
    """

    def __init__(
        self,
        settings: LaunchSettings,
        slots: list[SlotInfo],
        stdout: Sink,
        stderr: Sink,
        base_env: Mapping[str, str],
        grace: float = GRACE_PERIOD,
        placement: Placement | None = None,
    ) -> None:
        if placement is None:
            ssh = SshSettings.from_env(settings.ssh_port, settings.ssh_identity_file, base_env)
            placement = plan_placement(slots, ssh, hosts.is_local_host)
        self._placement = placement
        self._settings = settings
        self._slots = slots
        self._stdout = stdout
        self._stderr = stderr
        self._base_env = base_env
        self._grace = grace
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._workers: list[Worker] = []
        self._start = time.monotonic()
        self._stop_time: float | None = None
        self._running_at_stop: tuple[int, ...] = ()
        self._lifeline: Lifeline | None = None

    def run(self, timeout: float | None = None, handle_signals: bool = False) -> JobResult:
        """Runs the job to its end and stops every rank before returning.

        Args:
            timeout: seconds after which the job is stopped; None waits forever.
            handle_signals: catch SIGINT, SIGTERM and SIGHUP to stop the ranks
                (only possible in the main thread; ignored elsewhere).

        Returns:
            How the job ended.
        """
        self._start = time.monotonic()
        deadline = None if timeout is None else self._start + timeout
        secret = auth.new_secret()
        server = RendezvousServer(secret, host=self._placement.server_bind).start()
        interrupted: int | None = None
        timed_out = False
        start_error: str | None = None
        try:
            self._lifeline = self._start_lifeline()
            with self._signals(handle_signals):
                if self._settings.verbose:
                    self._print_plan(server.port)
                start_error = self._start_all(server.port, secret)
                if start_error is None:
                    interrupted, timed_out = self._watch(deadline)
                self._stop_all()
        finally:
            if any(worker.running for worker in self._workers):
                # An exception (KeyboardInterrupt in hora.run) is on its way out.
                if self._stop_time is None:
                    self._stop_all()
                else:
                    self._kill_all()
            server.stop()
            for worker in self._workers:
                worker.kill_leftovers()
            if self._lifeline is not None:
                self._lifeline.close()  # only now: every rank was reaped, its group killed
        output_deadline = time.monotonic() + _OUTPUT_TIMEOUT
        for worker in self._workers:
            worker.join_output(max(0.0, output_deadline - time.monotonic()))
        return self._result(interrupted, timed_out, start_error)

    def _start_lifeline(self) -> Lifeline | None:
        """Starts the guardian that stops local ranks if this process dies; None if it cannot."""
        if all(self._placement.is_remote(slot.hostname) for slot in self._slots):
            return None  # remote ranks have their supervisors
        try:
            return Lifeline.start(self._grace)
        except OSError as exc:
            self._stderr.line(
                f"horarun: warning: cannot start the lifeline that stops this machine's ranks if horarun is killed "
                f"({exc.strerror or exc}); a SIGKILL of horarun would leave them running"
            )
            return None

    @contextmanager
    def _signals(self, enabled: bool) -> Iterator[None]:
        if not enabled or threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: FrameType | None) -> None:
            self._events.put(("signal", signum))  # SimpleQueue.put is reentrant

        previous = {signum: signal.signal(signum, handler) for signum in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for signum, old in previous.items():
                signal.signal(signum, old)

    def _print_plan(self, port: int) -> None:
        placement = self._placement
        hosts = dict.fromkeys(slot.hostname for slot in self._slots)
        self._stderr.line(
            f"horarun: {len(self._slots)} rank{'s' if len(self._slots) != 1 else ''} on {len(hosts)} "
            f"host{'s' if len(hosts) != 1 else ''}; rendezvous server on {placement.server_bind}:{port}"
        )
        for host in hosts:
            how = "over ssh" if placement.is_remote(host) else "on this machine"
            self._stderr.line(
                f"horarun:   host {host}: {how}, reaches the rendezvous at {placement.rendezvous_addr[host]}:{port}"
            )
        for slot in self._slots:
            self._stderr.line(
                f"horarun:   rank {slot.rank}: host {slot.hostname}, local rank {slot.local_rank} of "
                f"{slot.local_size}, cross rank {slot.cross_rank} of {slot.cross_size}"
            )

    def _start_all(self, port: int, secret: bytes) -> str | None:
        settings = self._settings
        placement = self._placement
        for slot in self._slots:
            rendezvous = (placement.rendezvous_addr[slot.hostname], port)
            ssh = placement.ssh if placement.is_remote(slot.hostname) else None
            assert ssh is not None or not placement.is_remote(slot.hostname)
            try:
                worker = launch(
                    slot, settings, self._base_env, rendezvous, secret, ssh, self._events, self._stdout, self._stderr,
                    self._grace, self._lifeline,
                )  # fmt: skip
            except OSError as exc:
                program = "ssh" if ssh is not None else " ".join(settings.command)
                return f"cannot start rank {slot.rank} ({program!r}): {exc.strerror or exc}"
            self._workers.append(worker)
        return None

    def _watch(self, deadline: float | None) -> tuple[int | None, bool]:
        """Waits until every rank exited 0, a rank failed, a signal came, or the deadline.

        Returns:
            (the signal that interrupted the job or None, whether the deadline passed).
        """
        while any(worker.running for worker in self._workers):
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None, True
            wait = _POLL if deadline is None else min(_POLL, deadline - now)
            try:
                kind, value = self._events.get(timeout=wait)
            except queue.Empty:
                continue
            if kind == "signal":
                self._stderr.line(f"horarun: received {signal_name(value)}: stopping every rank")
                return value, False
            if self._workers[value].returncode != 0:
                return self._settle(deadline), False
        return None, False

    def _settle(self, deadline: float | None) -> int | None:
        """Gives the other ranks ``SETTLE_PERIOD`` to exit by themselves after a failure.

        Returns:
            The signal that interrupted the wait, or None.
        """
        end = time.monotonic() + SETTLE_PERIOD
        if deadline is not None:
            end = min(end, deadline)
        while any(worker.running for worker in self._workers):
            remaining = end - time.monotonic()
            if remaining <= 0:
                return None
            try:
                kind, value = self._events.get(timeout=min(_POLL, remaining))
            except queue.Empty:
                continue
            if kind == "signal":
                self._stderr.line(f"horarun: received {signal_name(value)}: stopping every rank")
                return value
        return None

    def _stop_all(self) -> None:
        """SIGTERM to every rank's group; SIGKILL after the grace period; reap all."""
        if self._stop_time is not None:
            return
        self._stop_time = time.monotonic()
        self._running_at_stop = tuple(worker.slot.rank for worker in self._workers if worker.running)
        if not self._running_at_stop:
            return
        stop_workers(self._workers, self._events, self._grace, "rank", self._stderr)

    def _kill_all(self) -> None:
        """SIGKILL to every rank's group; waits until every rank is reaped."""
        kill_workers(self._workers, self._events)

    def _result(self, interrupted: int | None, timed_out: bool, start_error: str | None) -> JobResult:
        ranks = tuple(
            RankOutcome(
                slot=worker.slot,
                pid=worker.pid,
                returncode=worker.returncode,
                exit_after=None if worker.exit_time is None else worker.exit_time - self._start,
                signals_sent=tuple(worker.signals_sent),
                stderr_tail=tuple(worker.stderr_tail),
                remote=worker.remote,
                lost=worker.lost,
                traceback=worker.stderr_traceback,
            )
            for worker in self._workers
        )
        stop_after = None if self._stop_time is None else self._stop_time - self._start
        # The root cause: the earliest rank that failed on its own (before the launcher
        # signalled anything).
        failed = [
            rank
            for rank in ranks
            if rank.returncode not in (None, 0)
            and rank.exit_after is not None
            and (stop_after is None or not rank.signals_sent or rank.exit_after <= stop_after)
        ]
        # A rank whose last words are hora's HoraInternalError failed because another rank
        # did (a peer left or died); the rank that failed for its own reason is the cause,
        # even when it exits later (a rank leaving after sys.exit(3) says goodbye first).
        causes = [rank for rank in failed if not _is_consequence(rank)]
        if not causes:  # every rank failed for another's reason: the one their messages name
            causes = [rank for rank in failed if rank.slot.rank == _named_culprit(failed)] or failed
        first = min(causes, key=lambda rank: rank.exit_after or 0.0) if causes else None
        return JobResult(
            ranks=ranks,
            first_failure=None if first is None else first.slot.rank,
            interrupted_by=interrupted,
            timed_out=timed_out,
            running_at_stop=self._running_at_stop,
            start_error=start_error,
            grace=self._grace,
        )


_CONSEQUENCES = ("HoraInternalError", "HorovodInternalError")


# How hora's HoraInternalError names the rank at the root of a failure.
_CULPRIT = re.compile(r"rank (\d+) (?:\(the coordinator\) )?(?:on host \S+ (?:sent|was lost)|was interrupted)")


def _named_culprit(ranks: list[RankOutcome]) -> int | None:
    """The rank most of these ranks' last hora errors name as the cause, if any."""
    votes: dict[int, int] = {}
    for rank in ranks:
        for line in rank.stderr_tail[-3:]:
            found = _CULPRIT.search(line) if any(name in line for name in _CONSEQUENCES) else None
            if found:
                votes[int(found.group(1))] = votes.get(int(found.group(1)), 0) + 1
                break
    return max(votes, key=lambda culprit: votes[culprit]) if votes else None


def _is_consequence(rank: RankOutcome) -> bool:
    """True when the rank's stderr ends with hora's error for a failure elsewhere in the job."""
    return any(name in line for line in rank.stderr_tail[-3:] for name in _CONSEQUENCES)
