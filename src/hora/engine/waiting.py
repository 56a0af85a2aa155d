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
import select
import socket
import time
from collections.abc import Callable, Iterable

from hora.engine.control import WaitPlan
from hora.engine.fast_lane import FastLane
from hora.engine.interrupts import InterruptShield
from hora.engine.queue import TensorQueue
from hora.transport.shm import Domain

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
        spin_seconds: how long to spin after work (``spin_after_work``).
    """

    def __init__(
        self,
        control_fds: Iterable[int],
        queue: TensorQueue,
        lane: FastLane | None,
        domain: Domain | None,
        shield: InterruptShield,
        spin_seconds: float,
    ) -> None:
        self.spin_seconds = spin_seconds
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
        # submit need to write a wake-up byte.
        self.sleeping = False
        self.caller_sleeping = False

    def wake(self) -> None:
        """Wakes whoever sleeps (one byte; a pending one is enough)."""
        with contextlib.suppress(OSError):  # a wake-up is already pending, or the engine has closed
            self._wake_w.send(b"\0")

    def wake_if_sleeping(self) -> None:
        if self.sleeping or self.caller_sleeping:
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

        Spins first until ``spin_since + spin_seconds`` (a caller waiting for a result,
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
        spin_until = spin_since + (self.spin_seconds if plan.peers else 0.0)
        queue = self._queue
        while not events and not queue.has_new() and time.perf_counter() < spin_until:
            if proposal is not None and lane is not None and lane.settled_for(proposal):
                return events
            events = poller.poll(0)
        if events or queue.has_new():
            return events
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

    def close(self) -> None:
        self._wake_r.close()
        self._wake_w.close()
