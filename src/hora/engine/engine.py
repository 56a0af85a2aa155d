"""The engine: who runs engine passes, when, and how a rank's engine starts and ends.

One engine runs per process. Its parts, each in a module of its own:

* ``control.ControlPlane``: what a pass owns (control links, responses, coordinator,
  executor, fast lane) and the pass itself: read control frames, settle the fast lane,
  announce new tensors, hand out ready responses (rank 0), execute this rank's
  responses in the agreed order;
* ``waiting.Sleeper``: how a thread waits for the next thing to do (spin, then ``poll``);
* ``endings``: leaving the job and failing it;
* ``choice.AlgorithmChoice``: each process set's algorithms;
* ``interrupts.InterruptShield``: signal handlers held back while the main thread drives.

Who runs a pass: the engine thread (a named daemon thread), or a user thread. Passes
run under one lock, ``_drive``; everything the control plane holds belongs to the
thread holding it (``hora.engine.control`` lists who may touch which field). A thread
that submits announces its tensors itself when the lock is free (it never executes
collectives there, so an asynchronous submit never waits for peers), and a thread that
waits for a handle runs passes itself until the handle completes (``drive``). A
blocking collective thus runs start to end on the caller's thread, with no hand-off to
the engine thread and back: each such hand-off is a kernel wake-up of tens of
microseconds on a small machine. The engine thread does everything no caller waits for
(asynchronous work, serving other ranks' requests on rank 0, failures, shutdown), and it
alone ends the job: a caller that meets a failure hands the exception to it. The engine
thread sleeps without the lock, on what the last pass published for it.

Failure: a lost peer, an abort, or a protocol error ends the job on this rank: every
pending and later operation fails with ``HoraInternalError`` naming the lost rank
(``endings``). Shutdown: a rank that calls ``shutdown()`` leaves; only collectives that
need it fail, and the others go on (Horovod ends the whole job instead). Rank 0
coordinates the others, so its engine keeps running after its own ``shutdown()`` until
every worker has left.
"""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from hora import logs
from hora.config import Config
from hora.engine import endings
from hora.engine.algorithms import Collectives
from hora.engine.choice import AlgorithmChoice
from hora.engine.control import ControlPlane, JobFailed
from hora.engine.executor import Executor
from hora.engine.fast_lane import FastLane
from hora.engine.handles import Handle, ring
from hora.engine.interrupts import Abandoned, Interrupted, InterruptShield
from hora.engine.mpi_collectives import MpiWorld
from hora.engine.process_sets import ProcessSetTable
from hora.engine.queue import Entry, TensorQueue, internal_error
from hora.engine.stall import DataPhaseStall, StallInspector
from hora.engine.waiting import PARK_SECONDS, Sleeper, Spin, barrier_spin, machine_cpus, spin_after_work
from hora.transport.mesh import Mesh
from hora.transport.shm import Domain
from hora.transport.tcp import Link, Watch

log = logging.getLogger(__name__)

CALLED_SHUTDOWN = "has shut down (it called shutdown())"
TIMELINE_WAIT = 60.0  # seconds start_timeline/stop_timeline wait for an engine pass to take the request


def check_interpreter() -> None:
    """Refuses an interpreter whose GIL is off.

    The engine's ownership rules (a field read whole while another thread writes it, a
    queue flag read without its lock, flags ordered by the GIL) are checked for
    CPython with the GIL only.

    Raises:
        RuntimeError: the GIL is disabled (a free-threaded build running without it).
    """
    gil_enabled = getattr(sys, "_is_gil_enabled", None)
    if gil_enabled is not None and not gil_enabled():
        raise RuntimeError(
            "hora does not run on a free-threaded Python with the GIL disabled yet: its engine relies on the "
            "GIL to order what its threads share. Run with PYTHON_GIL=1 (or -X gil=1), or a regular build."
        )


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """What an engine has chosen and done, for tests and diagnostics (``Engine.stats``).

    Attributes:
        lane_succeeded: allreduces the fast lane completed; None when there is no lane.
        algorithm: the kind of collectives the global set runs (a class name).
        hierarchical_allreduce: the global set's allreduce is hierarchical.
        hierarchical_allgather: the global set's allgather is hierarchical.
        idle: no engine pass runs and nothing of this rank's is in flight: no tensor
            queued, negotiating, on the fast lane or executing, no response or control
            frame left to handle, and the engine is not stopping or finished. The last
            pass then published this rank as not busy on the fast lane (unless rank 0
            records a timeline), so a peer's lane proposal waits for this rank's next
            allreduce instead of being refused. Read under the engine's lock, taken only
            if free (a thread in a pass, or waiting for a handle, holds it: then False).
            On rank 0 the coordinator may still hold other ranks' requests.
        autotuned: the autotune parameter changes this rank applied, in order, each as
            (fusion threshold in bytes, cycle time in ms, staging bytes): the same on
            every rank once each has executed as far (``hora.engine.autotune``).
        lane_pending: this rank has a fast-lane proposal awaiting the others' answers;
            it stays pending until a pass settles it (every rank answered, or one left)
            or the job fails. Read without the engine's lock (one attribute, racy like
            ``TensorQueue.has_new``): a snapshot, which a thread waiting on the lane
            while holding the lock does not hold up.
    """

    lane_succeeded: int | None
    algorithm: str
    hierarchical_allreduce: bool
    hierarchical_allgather: bool
    idle: bool
    lane_pending: bool
    autotuned: tuple[tuple[int, float, int], ...] = ()


class Engine:
    """One rank's engine and its thread.

    Args:
        config: the validated configuration.
        mesh: the connections to the other ranks; None for a job of one rank.
        domain: shared memory with the ranks on this machine, if any.
        sharing: by rank, whether that rank's host shares memory (``local.sharing_everywhere``).
    """

    def __init__(
        self,
        config: Config,
        mesh: Mesh | None,
        domain: Domain | None = None,
        sharing: list[bool] | None = None,
    ) -> None:
        self.rank = config.topology.rank
        self.size = config.topology.size
        self._config = config
        self._mesh = mesh
        self._domain = domain
        # Shared segments left mapped at close (``Domain.close``); see ``stop``.
        self._segments_left_mapped = 0
        self.queue = TensorQueue()
        self.sets = ProcessSetTable(self.size)
        # Holds back signal handlers while the main thread runs engine passes.
        self._shield = InterruptShield()
        # HORA_TRANSPORT=mpi: data through MPI communicators (made collectively now).
        mpi = MpiWorld(self.rank, self.size, config.mpi_comm) if config.transport == "mpi" else None
        self._executor = Executor(self.rank, self.sets, self.queue, self._collectives_for)
        # Every rank on this machine, the cache on, the built-in transport: cached small
        # allreduces may skip the coordinator (hora.engine.fast_lane).
        lane = (
            FastLane(domain, config)
            if domain is not None
            and self.size > 1
            and domain.ranks == tuple(range(self.size))
            and config.cache_capacity > 0
            and mpi is None
            else None
        )
        data_stall = DataPhaseStall(StallInspector(config), self.rank, self._executor.describe)

        def watch_for(check_urgent: Callable[[Link], None]) -> Watch:
            return Watch(
                list(mesh.control.values()) if mesh is not None else [],
                check_urgent,
                data=mesh.data if mesh is not None else None,
                stall_after=data_stall.first_check,
                on_stall=data_stall,
                interrupts=self._shield,
            )

        self.control = ControlPlane(
            config, dict(mesh.control) if mesh is not None else {}, self.queue, self._executor, lane, watch_for,
            config.topology.hostname, domain,
        )  # fmt: skip
        if domain is not None:
            domain.watch = self.control.watch
        if self.size > 1:
            data_stall.arbiter = self.control  # finds out who stopped (DataPhaseStall)
        self._choice = AlgorithmChoice(config, mesh, domain, sharing or [False] * self.size, self.control.watch, mpi)
        local_ranks = len(domain.ranks) if domain is not None else config.topology.local_size
        if config.spin_us is not None:
            spin = Spin(config.spin_us * 1e-6, adapts=False)  # HORA_SPIN_US: the user's choice
        else:
            spin = Spin(spin_after_work(local_ranks, machine_cpus()), adapts=True)
        if domain is not None:
            domain.spin = barrier_spin(spin)
        self._sleeper = Sleeper(self.control.by_fd, self.queue, lane, domain, self._shield, spin)
        self.control.on_unregister = self._sleeper.unregister
        # Held by the thread running an engine pass (the engine thread or a caller).
        self._drive = threading.Lock()
        self._shielded = False  # True while the main thread holds _drive with the shield up
        self._abandoned: BaseException | None = None  # a handler's exception that cut a collective short
        self._caller_error: BaseException | None = None  # raised by a caller's pass; the engine fails with it
        self._stop_requested = False
        self._leaving_how = CALLED_SHUTDOWN  # what others are told of this rank (see stop)
        self._leaving_lost = False  # its program failed: rank 0 then fails the job (see stop)
        self._finished = False  # set under _drive once the engine has failed or closed
        self._driving = False  # set while a caller holds _drive (see drive)
        # Threads in drive() waiting for _drive to come free, by thread id: each sleeps on a
        # held raw lock ("bell") that whoever lets go of _drive releases.
        self._bells: dict[int, _thread.LockType] = {}
        self._caller_left = float("-inf")  # perf_counter time a caller last released _drive
        self._last_work = 0.0  # perf_counter time the engine thread's loop last did something
        # The engine thread spins after work only when the process may run on more than one
        # CPU: bound to one (horarun --bind-to core on a host with as many cores as ranks),
        # its spin takes the only CPU from the thread it waits with, the rank's own caller.
        self._engine_spins = len(os.sched_getaffinity(0)) > 1
        # Threads inside caller_drives(): their submits leave executing to their own drive.
        self._drivers = threading.local()
        self.failure: str | None = None  # why the job failed on this rank, once it has
        self._thread = threading.Thread(target=self._run, name=f"hora-engine-{self.rank}", daemon=True)

    def _collectives_for(self, ranks: tuple[int, ...]) -> Collectives:
        return self._choice(ranks)

    def stats(self) -> EngineStats:
        """What this engine has chosen and done so far (see ``EngineStats``)."""
        lane = self.control.lane
        collectives = self._collectives_for(tuple(range(self.size)))
        return EngineStats(
            lane_succeeded=None if lane is None else lane.succeeded,
            algorithm=type(collectives).__name__,
            hierarchical_allreduce=bool(getattr(collectives, "hierarchical_allreduce", False)),
            hierarchical_allgather=bool(getattr(collectives, "hierarchical_allgather", False)),
            idle=self._idle(),
            lane_pending=lane is not None and lane.pending is not None,
            autotuned=tuple((p.fusion_threshold, p.cycle_time_ms, p.staging_bytes) for p in list(self.control.applied)),
        )

    def _idle(self) -> bool:
        """``EngineStats.idle``: looks under ``_drive`` if it is free, and never waits for it.

        Every pass that executes a response ends by publishing whether this rank is busy
        on the fast lane (``ControlPlane.run_pass``), and every tensor sent the
        coordinator's way stays queued until a pass executes it; so with the lock free
        and the queue empty, the last word published is "not busy". Nothing changes
        here, so the plan published last stays valid; letting go rings the bells as
        every release must (``drive``), and on the main thread the shield is up while
        the lock is held (``submit_many``): raised only before ``stop`` (which restores
        the handlers the shield wraps).
        """
        if self._finished or self._stop_requested:
            return False
        shielded = self._shield.enter()
        try:
            if not self._drive.acquire(blocking=False):
                return False  # a pass runs, or a caller waits for a handle holding the lock
            try:
                control = self.control
                return not (
                    self._finished
                    or self._stop_requested
                    or self._caller_error is not None
                    or len(self.queue) > 0
                    or self.queue.has_new()
                    or control.busy()
                    or (control.lane is not None and control.lane.pending is not None)
                )
            finally:
                self._drive.release()
                self._ring_bells()
        finally:
            if shielded:
                self._shield.leave()  # runs the signal handlers held back meanwhile (they may raise)

    # ----- called from user threads -----

    def start(self) -> None:
        self._thread.start()

    def refuse(self, entries: list[Entry]) -> None:
        """Announces requests this rank refused (``Request.error``) without holding their
        names (see ``TensorQueue.add_refusals``)."""
        self.queue.add_refusals(entries)
        self._sleeper.wake()

    def submit(self, entry: Entry) -> None:
        """Queues a tensor for negotiation (see ``submit_many``)."""
        self.submit_many([entry])

    def submit_many(self, entries: list[Entry]) -> None:
        """Queues several tensors at once, or none, and announces them.

        When no other thread runs an engine pass and this rank has no other tensor in
        flight, this one announces them itself (and on rank 0 sends the responses that
        became ready to their ranks); it leaves executing to a waiting caller or the
        engine thread. Otherwise the thread in the pass, or the engine thread, sees them
        (it is woken if it sleeps): in a burst of calls (Horovod's gradient hooks, a loop
        of ``*_async`` calls) the tensors submitted while earlier ones are in flight
        gather and go out together, in one frame that rank 0 answers with one fused
        response, rather than a round through rank 0 per tensor run between the calls.
        A thread that drives its submits at once (``caller_drives``) announces them
        itself: it is about to run the passes anyway.

        Raises:
            ValueError: a name is in flight already (see ``TensorQueue.add_many``).
            HoraInternalError: the runtime has shut down or failed.
        """
        if not entries:
            return
        self.queue.add_many(entries)
        thread = threading.current_thread()
        control = self.control
        control.submitters[thread.ident or 0] = thread
        # The shield goes up before the lock is taken: no signal handler may raise between
        # taking it and the block that lets it go (it would stay taken for ever).
        shielded = self._shield.enter()
        try:
            drives = getattr(self._drivers, "on", False)
            # With a cycle time set, the engine thread waits that long to batch tensors;
            # without, tensors submitted while others are in flight wait for its next pass.
            burst = len(self.queue) > len(entries) and not drives
            if control.cycle_time_ms > 0 or burst or not self._drive.acquire(blocking=False):
                self._sleeper.wake_if_sleeping()
                return
            self._shielded = shielded
            proposed = False
            try:
                if not self._finished and self._caller_error is None:
                    new = self.queue.drain()
                    if new:
                        control.announce(new)
                        proposed = control.lane is not None and control.lane.pending is not None
                    if control.coordinator is not None:
                        control.distribute(control.coordinator.take())
                    control.run_delivered()
            except BaseException as exc:  # noqa: BLE001 - the engine thread fails the job with it
                self._caller_error = exc
            finally:
                self._shielded = False
                self._let_go()
            if self._caller_error is not None or (control.responses and not drives):
                self._sleeper.wake()  # the engine thread executes, unless a waiting caller gets there first
            elif proposed and not drives:
                self._sleeper.wake_if_sleeping()  # a sleeping engine thread does not watch the lane yet
        finally:
            if shielded:
                self._shield.leave()  # runs the signal handlers held back meanwhile (they may raise)

    @contextlib.contextmanager
    def caller_drives(self) -> Iterator[None]:
        """Marks the block's submits as this thread's to execute: it waits for them at once.

        A kernel of a compiled program (a JAX custom call) submits and then drives its
        handles straight away, on a thread that shares its CPU with the engine thread when
        the rank is bound to one core. Waking the engine thread to execute what this thread
        is about to execute itself only costs two context switches and a contended lock per
        call. Inside the block a submit does not wake it for responses ready to execute,
        nor to watch the fast lane for the answers to its proposal: ``drive`` executes
        them and watches the lane, and wakes the engine thread for anything it leaves. A
        block that raises wakes it, so what it queued and did not wait for is still
        executed.
        """
        self._drivers.on = True
        try:
            yield
        except BaseException:
            self._sleeper.wake()  # left before (or while) driving: the engine thread takes over
            raise
        finally:
            self._drivers.on = False

    def drive(self, handle: Handle) -> None:
        """Waits until ``handle`` completes, running engine passes on this thread if it can.

        While another thread runs a pass, this one sleeps until that thread lets go of the
        lock or the handle completes, whichever comes first, and then looks again: waiting
        for the lock alone could deadlock, since the driver may wait for a collective that
        the peers start only after this thread's next one. Once it stops driving early
        (the engine finished or is stopping, or a pass failed and the engine thread fails
        the job with the error), it blocks on the handle, which the engine thread completes.
        On the engine thread, returns at once.

        Invariant: a thread sleeps on its bell only after registering it and then failing
        to take the lock, and every release of the lock rings every registered bell, so no
        thread sleeps while the lock is free and its handle unfinished. On the main thread
        the interrupt shield is up from before the lock is taken until after it is let go
        (``hora.engine.interrupts``).
        """
        if threading.current_thread() is self._thread:
            return
        me = threading.get_ident()
        self.control.waiting.add(me)
        try:
            self._drive_or_sleep(me, handle)
        finally:
            self.control.waiting.discard(me)

    def _drive_or_sleep(self, me: int, handle: Handle) -> None:
        """``drive``'s loop."""
        while not handle.done():
            # The shield goes up before the lock is taken and comes down after it is let
            # go (see submit_many); in between, only the bell wait is a safe point.
            shielded = self._shield.enter()
            drove = False
            try:
                if self._drive.acquire(blocking=False):
                    drove = True
                    self._shielded = shielded
                    try:
                        leftover = self._drive_until(handle)
                    finally:
                        self._shielded = False
                        self._let_go()
                    if leftover:
                        self._sleeper.wake()  # the engine thread takes over what this thread leaves
                else:
                    self._sleep_on_bell(me, handle, shielded)
            finally:
                if shielded:
                    self._shield.leave()  # runs the signal handlers held back meanwhile (they may raise)
            if drove:
                if self._abandoned is not None:
                    error, self._abandoned = self._abandoned, None
                    raise error
                if handle.done():
                    return
                if self._finished or self._stop_requested or self._caller_error is not None:
                    handle.block()  # stopped early: the engine thread completes it
                    return
                # Else a held-back signal's handler did not raise: drive on.

    def _sleep_on_bell(self, me: int, handle: Handle, shielded: bool) -> None:
        """Another thread is in a pass: sleeps until it lets go of the lock or the handle
        completes, whichever comes first (a bell both ring); the caller then looks again."""
        bell = _thread.allocate_lock()
        bell.acquire()
        self._bells[me] = bell
        handle.set_bell(bell)
        try:
            if not self._drive.acquire(blocking=False):
                self._shield.safe = shielded  # holding nothing: a signal may end the wait
                bell.acquire()  # rung by the holder letting go, or by completion
            else:
                self._let_go()  # free after all: the caller loops round and drives
        except Interrupted:
            pass  # drive() runs the signal's handler as the shield comes down
        finally:
            self._shield.safe = False
            handle.set_bell(None)
            del self._bells[me]

    def _let_go(self) -> None:
        """Publishes the engine thread's plan, releases ``_drive`` and wakes every thread
        waiting in ``drive`` to try again."""
        self.control.publish()
        self._drive.release()
        self._ring_bells()

    def _ring_bells(self) -> None:
        if self._bells:  # on every pass of the engine thread: usually empty
            for bell in list(self._bells.values()):
                ring(bell)

    def _drive_until(self, handle: Handle) -> bool:
        """``drive``'s passes (holding ``_drive``); returns whether work is left for the engine thread."""
        self._driving = True
        spin = True
        control, sleeper, shield = self.control, self._sleeper, self._shield
        try:
            while not handle.done() and not self._finished and not self._stop_requested:
                if self._caller_error is not None or shield.pending:
                    break
                poller = sleeper.callers_poller(control.by_fd)
                if control.settled_on_lane(
                    handle, lambda: bool(poller.poll(0)) or self.queue.has_new(), sleeper.spin.seconds if spin else 0.0
                ):
                    continue
                # Before this thread may sleep (it is in control.waiting): the report is due
                # now, or the plan's deadline wakes the wait when it is.
                control.report_stuck()
                plan = control.plan(engine_thread=False)
                since = time.perf_counter() if spin else float("-inf")
                events = sleeper.poll(poller, lambda: plan, caller=True, spin_since=since, shielded=self._shielded)
                # Woken by nothing (a lane wait's recheck): the answer is not imminent, so
                # the next wait sleeps at once instead of spinning again.
                spin = bool(events) or plan.busy
                sleeper.drain(events)
                control.absorb(events)
                control.run_pass()
        except Interrupted:
            pass  # a signal at a safe point: drive() runs its handler once it let go of the lock
        except Abandoned as exc:
            # A handler raised in a data-plane wait whose peers had stopped: this rank cannot
            # finish the collective, so the job fails; the caller gets the handler's exception.
            self._abandoned = exc.error
            self._caller_error = JobFailed(
                f"rank {self.rank} was interrupted ({type(exc.error).__name__}) in the middle of "
                f"{self._executor.describe()}, whose peers had stopped making progress"
            )
        except BaseException as exc:  # noqa: BLE001 - the engine thread fails the job with it
            self._caller_error = exc
        control.settle_timeline()  # the engine thread may sleep next: the file shows this call's work
        self._caller_left = time.perf_counter()
        self._driving = False
        lane_waits = control.lane is not None and control.lane.pending is not None
        # The engine thread must see what this thread read and left: a stop among them.
        return (
            self._caller_error is not None
            or self._stop_requested
            or control.busy()
            or self.queue.has_new()
            or lane_waits
        )

    def stop(self, how: str = CALLED_SHUTDOWN, lost: bool = False) -> int:
        """Makes this rank leave the job and waits until its engine has finished.

        On rank 0 this returns once every other rank has left too, since they need
        rank 0 to coordinate their remaining collectives; but a rank 0 that is ``lost``
        fails the job instead, so that every rank learns why at once: waiting for
        the others would hang where they wait on rank 0 outside hora (an MPI call of
        the program's own, under an mpirun that ends the job only once rank 0 exits).

        Args:
            how: what the others are told of this rank when a collective needs it
                (``Coordinator.depart``).
            lost: the rank leaves because its program failed (an uncaught exception).

        Returns:
            How many shared segments stayed mapped: the engine's objects refer to each
            other (bound methods, closures), so the arrays they made from the segments
            live until Python's cycle collector runs (``hora.core.api.shutdown`` runs it
            then, so a reset gives the memory back at once).
        """
        self._leaving_how = how
        self._leaving_lost = lost
        self._stop_requested = True
        self._sleeper.wake()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._shield.restore()
        return self._segments_left_mapped

    def set_timeline(self, path: str | None, mark_cycles: bool = False) -> None:
        """Starts recording a timeline into ``path`` (rank 0 only), or stops with None.

        Blocks until an engine pass has switched, so the file is complete on return
        from a stop.

        Raises:
            OSError: the file cannot be created.
            TimeoutError: no pass took the request within ``TIMELINE_WAIT`` seconds.
        """
        control = self.control
        if control.coordinator is None or not self._thread.is_alive():
            return
        control.timeline_applied.clear()
        control.timeline_request = (path, mark_cycles)
        self._sleeper.wake()
        deadline = time.monotonic() + TIMELINE_WAIT
        while not control.timeline_applied.wait(1.0):  # a pass applies it, on any thread
            if not self._thread.is_alive():
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{'stop' if path is None else 'start'}_timeline: the engine did not take the request within "
                    f"{TIMELINE_WAIT:g} s; it is busy with {self._executor.describe()}"
                )
        error = control.timeline_error
        if error is not None:
            raise error

    # ----- the engine thread -----

    def _run(self) -> None:
        cores = self._config.thread_affinity
        if cores:
            core = cores[self._config.topology.local_rank % len(cores)]
            try:
                os.sched_setaffinity(0, {core})  # 0: this thread only
            except OSError as exc:
                log.warning("cannot pin its engine thread to core %d: %s", core, exc, extra=logs.at(self.rank))
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - every failure must fail the handles, never hang them
            with self._drive:
                self._finished = True
                settled = isinstance(exc, JobFailed) and exc.settled
                self.failure = endings.fail(self.control, endings.reason_for(self.control, exc), settled)
            self._ring_bells()
        finally:
            with self._drive:
                self._finished = True
                self._close()
            self._ring_bells()

    def _loop(self) -> None:
        """The engine thread: waits without the lock, then runs a pass holding it."""
        sleeper, control = self._sleeper, self.control
        while True:
            if self._driving or time.perf_counter() - self._caller_left < PARK_SECONDS:
                events = sleeper.park()
            else:
                spin_since = self._last_work if self._engine_spins else float("-inf")
                events = sleeper.poll(sleeper.poller, lambda: control.published, caller=False, spin_since=spin_since)
            with self._drive:
                # Invariant: _finished is set before the lock is let go for the last time,
                # so no caller drives an engine that is ending (it would read, and lose, the
                # frames that end it, and wait for ever holding the lock).
                ending = True
                try:
                    ending = self._engine_pass(events)
                finally:
                    self._finished = ending
                    control.publish()
            self._ring_bells()
            if ending:
                return

    def _engine_pass(self, events: list[tuple[int, int]]) -> bool:
        """The engine thread's pass (holding ``_drive``); returns True when the engine is done."""
        if self._caller_error is not None:
            error, self._caller_error = self._caller_error, None
            raise error
        control = self.control
        self._sleeper.drain(events)
        control.absorb(events)
        endings.note_lingering(control)
        if self._leaving_due():
            if self._leaving_lost and control.coordinator is not None and control.links:  # others to tell
                raise JobFailed(f"rank {self.rank} on host {control.hostname} {self._leaving_how}")
            endings.begin_leaving(control, self._leaving_how)
            if control.coordinator is None:
                endings.leave(control, self._leaving_how)
                return True
        if control.run_pass():
            self._last_work = time.perf_counter()
        control.settle_timeline()
        if self._leaving_due():
            # The proposal that deferred leaving has settled in this pass: the next one
            # leaves, now rather than whenever something next wakes this thread.
            self._sleeper.wake()
        # Rank 0 is done once it has left and every worker has left too.
        return control.leaving_since is not None and not control.links and not control.responses

    def _leaving_due(self) -> bool:
        """Whether this rank should begin leaving now: asked to stop, not yet leaving, and
        no by-id lane proposal pending (it may have succeeded on the others, who then run
        its data phase with this rank: it settles first, as a collective in flight would)."""
        control = self.control
        return self._stop_requested and control.leaving_since is None and not control.lane_runs_data()

    def _close(self) -> None:
        control = self.control
        control.use_timeline(None)
        if control.tuner is not None:
            control.tuner.close()
        control.timeline_applied.set()  # a start_timeline racing with the end does not wait forever
        error = internal_error(self.failure or f"hora has shut down on rank {self.rank}")
        self.queue.close(error)
        self._executor.abandon(error)
        if control.lane is not None:
            control.lane.leave()
            control.lane.close()
        if self._domain is not None:
            self._segments_left_mapped = self._domain.close()
        if self._mesh is not None:
            self._mesh.close()
        self._sleeper.close()
        self._shield.close()
