"""How engine threads wait: spin briefly, then sleep in ``poll`` until something happens.

A thread waits for a wake-up byte (written by a submit, a stop, a timeline request), a
control frame, a fast-lane answer from a peer, or a deadline (the next stall or
mismatch check). The engine thread waits *without* the drive lock, so it reads only
what a pass published for it (``ControlPlane.published``, a ``WaitPlan``), plus the
queue's "new entries" flag and the fast lane's shared memory for a published proposal;
a caller waits holding the lock, with a plan computed there and then.

Sleeping flags: a thread sets its flag before its last look at the queue and at the
published plan, and a submit adds to the queue and publishes its plan (a new fast-lane
proposal) before it reads the flags, so what it did is either seen or followed by a
wake-up byte (the GIL orders these accesses). The lane's watch flags work alike for
peers' entries, with a fence on both sides (``hora.engine.fast_lane``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from hora.engine.control import WaitPlan
from hora.engine.fast_lane import FastLane, Proposal
from hora.engine.interrupts import InterruptShield
from hora.engine.queue import TensorQueue
from hora.transport.shm import SPIN_SECONDS, Domain

log = logging.getLogger(__name__)

# After doing work a thread polls without blocking for this long before it sleeps: the
# next request or response usually follows within a few hundred microseconds, and waking
# a sleeping thread costs tens of microseconds on small machines, on both sides (35-40 us
# on a 2-vCPU VM). Idle, nothing spins. Measured there, a 64 KiB cached allreduce at 2
# ranks: 300 us instead of 100 was 9-12% faster, 1 ms no better (spin_after_work).
SPIN_AFTER_WORK = 300e-6


def spin_after_work(local_ranks: int, cpus: int) -> float:
    """How long a rank's threads spin after work: ``SPIN_AFTER_WORK`` while each of the
    machine's ranks has a CPU, none where they outnumber the CPUs (a spinning rank then
    takes the CPU from the very peer it waits for: at 3 and 4 ranks on 2 CPUs, no spin was
    5-10% faster than 100 us, and 300 us 12-14% slower)."""
    return SPIN_AFTER_WORK if local_ranks <= cpus else 0.0


def machine_cpus(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")) -> int:
    """The CPUs this process's ranks may use: the machine's, or fewer under a CPU quota
    (a container's ``--cpus``, a Kubernetes limit), which ``os.cpu_count()`` does not see.

    Reads the quota of this process's cgroup and of every cgroup above it (v2
    ``cpu.max``, v1 ``cpu.cfs_quota_us``); the smallest wins, rounded up.
    """
    cpus = os.cpu_count() or 1
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return cpus
    for line in lines:
        _, controllers, path = line.split(":", 2)
        files: tuple[str, ...]
        if controllers == "":  # v2: one hierarchy
            base, files = root, ("cpu.max",)
        elif "cpu" in controllers.split(","):
            base, files = root / controllers, ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        node = base / path.lstrip("/")
        while True:
            quota = _cpu_quota(node, files)
            if quota is not None:
                cpus = min(cpus, max(1, math.ceil(quota)))
            if node == base or base not in node.parents:
                break
            node = node.parent
    return cpus


def _cpu_quota(node: Path, files: tuple[str, ...]) -> float | None:
    """One cgroup's CPU quota in CPUs, or None when it sets none (or cannot be read)."""
    try:
        if len(files) == 1:
            quota, period = (node / files[0]).read_text().split()[:2]
        else:
            quota, period = ((node / name).read_text().strip() for name in files)
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


# A spin pays only when the reply it waits for comes before it ends: a caller's spin then
# saves the wake-ups, and one that runs out has burnt its CPU for nothing, CPU that on
# hosts sharing cores (emulated hosts on one machine, a container on a crowded node) the
# peer it waits for needed. Callers' spins therefore keep score: once fewer than
# SPIN_MIN_HITS of the last SPIN_WINDOW ended with their answer, spinning stops for
# SPIN_BACKOFF seconds (doubling up to SPIN_BACKOFF_MAX while the score stays low), then
# tries again. Measured: 99% of them hit at 2 ranks on one machine, 4-55% across 4 hosts
# emulated on 2 cores. The engine thread's spin after work waits for work that may not
# come (the end of a training step) and does not vote.
SPIN_WINDOW = 32
SPIN_MIN_HITS = 0.75
SPIN_BACKOFF = 1.0
SPIN_BACKOFF_MAX = 64.0


class Spin:
    """How long a thread spins after work, lowered to nothing while callers' spins run out.

    Args:
        seconds: the spin while it pays (``spin_after_work`` or ``HORA_SPIN_US``).
        adapts: whether it keeps score and stops while spins run out (not when
            ``HORA_SPIN_US`` sets the spin: the user chose).
        clock: ``time.monotonic``; injectable for tests.

    The engine thread and a caller may read it at once; only callers (one at a time,
    holding the drive lock) score it.
    """

    def __init__(self, seconds: float, adapts: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self._full = self._seconds = seconds
        self._adapts = adapts and seconds > 0
        self._clock = clock
        self._spins = self._hits = 0
        self._off_until = 0.0
        self._backoff = SPIN_BACKOFF

    @property
    def seconds(self) -> float:
        """The spin now (none while it is off; back on once the backoff is over)."""
        if self._seconds == 0.0 and self._adapts and self._clock() >= self._off_until:
            self._seconds = self._full
        return self._seconds

    def score(self, hit: bool) -> None:
        """Counts a caller's spin: ``hit`` when its answer came before it ran out."""
        if not self._adapts:
            return
        self._spins += 1
        self._hits += hit
        if self._spins < SPIN_WINDOW:
            return
        rate = self._hits / self._spins
        self._spins = self._hits = 0
        if rate >= SPIN_MIN_HITS:
            self._backoff = SPIN_BACKOFF
            return
        self._seconds = 0.0
        self._off_until = self._clock() + self._backoff
        log.debug("%.0f%% of the spins got their answer: none for %g s", 100 * rate, self._backoff)
        self._backoff = min(2 * self._backoff, SPIN_BACKOFF_MAX)


def barrier_spin(spin: Spin) -> Callable[[], float]:
    """How long a shared-memory barrier spins before it sleeps (``Domain.spin``).

    Inside a data phase every rank works through the same rounds, so the peer a barrier
    waits for is usually tens of microseconds behind, and a rank that sleeps there pays a
    wake-up on both sides at every round. While this rank's spin after work is on (each
    local rank has a CPU, and callers' spins get their answers), a barrier spins as long;
    otherwise the domain's own short spin (``SPIN_SECONDS``). Measured on 2 vCPUs (torch
    ``allreduce_`` in place, back to back, 2 ranks, median of 200, three alternating pairs):
    0.5 MiB 543-682 -> 302-369 us, 2 MiB 1.13-1.39 -> 0.88-0.96 ms, 8 MiB 3.55-4.19 ->
    2.70-3.58 ms.
    """
    return lambda: max(SPIN_SECONDS, spin.seconds)


# While a caller drives the engine, and this long after one did, the engine thread leaves
# the control links to callers and sleeps on its wake-up socket alone (parked): a thread
# waiting for a result usually comes back within microseconds, and an engine thread
# woken by every frame only to find a caller reading it costs a core on small machines.
# This bounds how late a parked engine thread serves what no caller waits for.
PARK_SECONDS = 2e-3


class Sleeper:
    """The wake-up socket, the poll sets, and the waiting policy of one engine.

    Args:
        control_fds: the control links' descriptors, watched by the engine thread.
        queue: the tensor queue (its "new entries" flag ends a wait).
        lane: the fast lane, if used (its peers' answers arrive as wake-ups on
            ``domain``'s socket).
        domain: the shared-memory domain, if any.
        shield: the interrupt shield (a caller's blocking poll is a safe point).
        spin: how long to spin after work (``Spin``).
    """

    def __init__(
        self,
        control_fds: Iterable[int],
        queue: TensorQueue,
        lane: FastLane | None,
        domain: Domain | None,
        shield: InterruptShield,
        spin: Spin,
    ) -> None:
        self.spin = spin
        self._queue = queue
        self._lane = lane
        self._domain = domain
        self._shield = shield
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.lane_fds = (domain.wake_fileno(),) if lane is not None and domain is not None else ()
        # The engine thread's poll set (registrations change under the drive lock only).
        self.poller = select.poll()
        for fd in (self._wake_r.fileno(), *self.lane_fds, *control_fds):
            self.poller.register(fd, select.POLLIN)
        self._park_poller = select.poll()
        self._park_poller.register(self._wake_r.fileno(), select.POLLIN)
        self._caller_poller: select.poll | None = None  # see callers_poller
        self._caller_fds: frozenset[int] = frozenset()
        # Set while the engine thread, or a caller, blocks in poll: only then does a
        # submit need to write a wake-up byte, and only one for each sleep (``_rung``).
        self.sleeping = False
        self.caller_sleeping = False
        self._rung = False

    def wake(self) -> None:
        """Wakes whoever sleeps (one byte; a pending one is enough)."""
        with contextlib.suppress(OSError):  # a wake-up is already pending, or the engine has closed
            self._wake_w.send(b"\0")

    def wake_if_sleeping(self) -> None:
        """Writes a wake-up byte if a thread sleeps in ``poll`` and none was written since
        it went to sleep (in a burst of submits, one system call rather than one each,
        each letting go of the GIL).

        Invariant: a sleeper clears ``_rung`` before it sets its flag and takes its last
        look at the queue, so a submit that finds the flag set and ``_rung`` set queued
        its tensor after a byte that wakes the sleeper, or that the thread which read it
        follows with a pass, which drains the queue.
        """
        if (self.sleeping or self.caller_sleeping) and not self._rung:
            self._rung = True
            self.wake()

    def unregister(self, fd: int) -> None:
        """Drops a control link from the engine thread's poll set (under the drive lock)."""
        with contextlib.suppress(KeyError, ValueError):
            self.poller.unregister(fd)

    def drain(self, events: list[tuple[int, int]]) -> None:
        """Reads the wake-up bytes among ``events`` (under the drive lock)."""
        for fd, _ in events:
            if fd == self._wake_r.fileno():
                with contextlib.suppress(OSError):
                    while self._wake_r.recv(4096):
                        pass
            elif fd in self.lane_fds and self._domain is not None:
                self._domain.drain_wake()

    def callers_poller(self, control_fds: Iterable[int]) -> select.poll:
        """The poll set callers use (one at a time, holding the drive lock): the wake-up
        socket and the open control links, rebuilt when a link has closed."""
        fds = frozenset(control_fds)
        if self._caller_poller is None or self._caller_fds != fds:
            self._caller_poller = select.poll()
            self._caller_fds = fds
            for fd in (self._wake_r.fileno(), *self.lane_fds, *fds):
                self._caller_poller.register(fd, select.POLLIN)
        return self._caller_poller

    def park(self) -> list[tuple[int, int]]:
        """The engine thread sleeps on the wake-up socket alone, at most ``PARK_SECONDS``."""
        return [] if self._queue.has_new() else self._park_poller.poll(PARK_SECONDS * 1000.0)

    def poll(
        self,
        poller: select.poll,
        plan_now: Callable[[], WaitPlan],
        caller: bool,
        spin_since: float,
        shielded: bool = False,
    ) -> list[tuple[int, int]]:
        """Waits for a wake-up, a control frame, a submit, a lane answer, or the plan's
        deadline; reads nothing.

        Spins first until ``spin_since + spin.seconds`` (a caller waiting for a result,
        the engine thread just after it did work), when the job has peers to hear from.

        Args:
            poller: ``poller`` (the engine thread) or ``callers_poller()`` (a caller).
            plan_now: what to wait for: the plan a caller made, or for the engine thread
                ``ControlPlane.published``, read again once its sleeping flag is set (a
                thread that publishes a new plan, a fast-lane proposal say, reads the flag
                after publishing: so the plan is seen, or the sleeper is woken).
            caller: a user thread holding the drive lock, rather than the engine thread.
            spin_since: ``time.perf_counter()`` the spin counts from.
            shielded: the main thread with the interrupt shield up: the blocking poll is
                a safe point where a signal ends the wait (``Interrupted`` propagates).
        """
        lane, plan = self._lane, plan_now()
        proposal = plan.proposal
        events = poller.poll(0)
        if events or plan.busy or (proposal is not None and lane is not None and lane.settled_for(proposal)):
            return events
        spin_until = spin_since + (self.spin.seconds if plan.peers else 0.0)
        events, settled = self._spin(poller, spin_until, proposal, caller)
        queue = self._queue
        if settled or events or queue.has_new():
            return events
        self._rung = False  # before the flag (see wake_if_sleeping)
        if caller:
            self.caller_sleeping = True
        else:
            self.sleeping = True
        plan = plan_now()  # the last look, after the flag (see plan_now)
        proposal = plan.proposal
        timeout_ms = None if plan.deadline is None else max(0.0, (plan.deadline - time.monotonic()) * 1000.0)
        watched = lane if proposal is not None else None
        if watched is not None:
            watched.watch(caller, True)
            recheck = watched.recheck_ms()
            timeout_ms = recheck if timeout_ms is None else min(timeout_ms, recheck)
        try:
            if plan.busy:
                pass  # a pass left work after all: no sleep
            elif not queue.has_new() and not (watched is not None and proposal is not None and watched.settled_for(proposal)):
                self._shield.safe = caller and shielded
                events = poller.poll(timeout_ms)
        finally:
            self._shield.safe = False
            if watched is not None:
                watched.watch(caller, False)
            if caller:
                self.caller_sleeping = False
            else:
                self.sleeping = False
        return events

    def _spin(
        self, poller: select.poll, until: float, proposal: Proposal | None, caller: bool
    ) -> tuple[list[tuple[int, int]], bool]:
        """Polls without blocking until ``until`` (``perf_counter``), a frame, a submit or
        the lane's answer to ``proposal``; a caller's spin scores itself (``Spin``).

        Returns:
            The events, and whether the proposal settled.
        """
        if time.perf_counter() >= until:
            return [], False
        lane, queue = self._lane, self._queue
        events: list[tuple[int, int]] = []
        settled = False
        while not events and not queue.has_new() and time.perf_counter() < until:
            if proposal is not None and lane is not None and lane.settled_for(proposal):
                settled = True
                break
            events = poller.poll(0)
        if caller:
            self.spin.score(settled or bool(events) or queue.has_new())
        return events, settled

    def close(self) -> None:
        self._wake_r.close()
        self._wake_w.close()
