"""The engine thread: announces submitted tensors, negotiates, and executes in order.

One engine runs per process, on a named daemon thread. It sleeps in ``poll`` on a
wake-up socket (written by every submit) and on the control links, so it uses no CPU
while idle and reacts at once to a submit, a response, or a lost peer. There is no
fixed cycle.

Each pass of the loop:
1. reads control frames: requests (rank 0), responses (other ranks), shutdown, abort;
2. settles this rank's fast-lane proposal, if the other ranks have answered it
   (``hora.engine.fast_lane``: cached small allreduces when every rank shares this
   machine);
3. announces newly submitted tensors to the coordinator (rank 0 runs it in-process),
   or proposes a lone cached small allreduce on the fast lane;
4. on rank 0, hands each ready response to the ranks of its process set;
5. executes this rank's responses in the agreed order.

Who runs a pass: the engine thread, or a user thread. All engine state belongs to
whichever thread holds ``_drive``. A thread that submits announces its tensors itself
when the lock is free (it never executes collectives there, so an asynchronous submit
never waits for peers), and a thread that waits for a handle runs passes itself until
the handle completes (``drive``). A blocking collective thus runs start to end on the
caller's thread, with no hand-off to the engine thread and back: each such hand-off is a
kernel wake-up of tens of microseconds on a small machine, and the engine thread and
the caller no longer compete for the same cores. The engine thread does everything no
caller is waiting for (asynchronous work, serving other ranks' requests on rank 0,
failures, shutdown), and it alone ends the job: a caller that meets a failure hands the
exception to it.

Failure: a lost peer, an abort, or a protocol error ends the job on this rank: every
pending and later operation fails with ``HoraInternalError`` naming the lost rank.
Rank 0 tells every worker (ABORT); a worker that sees a peer fail first reports it to
rank 0 (FAILURE) and waits briefly for rank 0's ABORT so it reports the root cause.

Shutdown: a rank that calls ``shutdown()`` leaves; only collectives that need it fail
(``HoraInternalError`` naming it), and the others go on. (Horovod ends the whole job
instead, the cause of its "Horovod has been shut down" errors.) A worker tells rank 0
(SHUTDOWN), executes the responses rank 0 sent before it read that, and closes once
rank 0 has closed its end, so no frame is lost to a reset. Rank 0 coordinates the
others, so its engine keeps running after its own ``shutdown()`` until every worker
has left.
"""

from __future__ import annotations

import _thread
import logging
import os
import select
import socket
import threading
import time
from collections import deque

from hora.config import Config
from hora.engine import messages
from hora.engine.algorithms import Collectives, HierarchicalCollectives, SharedCollectives, TcpCollectives
from hora.engine.coordinator import Coordinator
from hora.engine.executor import Executor
from hora.engine.fast_lane import FastLane
from hora.engine.handles import Handle, ring
from hora.engine.interrupts import Abandoned, Interrupted, InterruptShield
from hora.engine.mesh_channel import MeshChannel
from hora.engine.messages import Response
from hora.engine.mpi_collectives import MpiWorld
from hora.engine.process_sets import ProcessSetTable
from hora.engine.queue import Entry, TensorQueue, internal_error
from hora.engine.shm_group import ShmGroup
from hora.engine.stall import DataPhaseStall, StalledError, StallInspector
from hora.engine.timeline import Timeline
from hora.errors import ProtocolError
from hora.transport.mesh import Mesh
from hora.transport.shm import Domain
from hora.transport.tcp import Link, LinkClosed, PeerProtocolError, Watch, encode_frame

log = logging.getLogger("hora")

CALLED_SHUTDOWN = "has shut down (it called shutdown())"
ROOT_CAUSE_WAIT = 2.0  # seconds a failing worker waits for rank 0's account of the failure
# After doing work the engine polls without blocking for this long before it sleeps: the
# next request or response usually follows within microseconds, and a kernel wake-up of a
# sleeping thread costs tens of microseconds on small machines. Idle, it does not spin.
SPIN_AFTER_WORK = 100e-6
LINGER_NOTICE = 30.0  # seconds after its shutdown() before rank 0 says whom it waits for
# While a caller drives the engine, and this long after one did, the engine thread leaves
# the control links to callers and sleeps on its wake-up socket alone (parked): a thread
# waiting for a result usually comes back within microseconds, and an engine thread
# woken by every frame only to find a caller reading it costs a core on small machines.
# This bounds how late a parked engine thread serves what no caller waits for.
PARK_SECONDS = 2e-3
LEAVE_WAIT = 60.0  # seconds a leaving worker waits for rank 0 to acknowledge its shutdown
TIMELINE_WAIT = 60.0  # seconds start_timeline/stop_timeline wait for an engine pass to take the request


class _JobFailed(Exception):
    """Ends the engine loop; the message is the reason every pending op fails with.

    Args:
        reason: the message.
        settled: the reason is rank 0's account (an ABORT or another rank's FAILURE):
            it names the root cause already.
    """

    def __init__(self, reason: str, settled: bool = False) -> None:
        super().__init__(reason)
        self.settled = settled


class Engine:
    """The background thread of one rank.

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
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.queue = TensorQueue()
        self.sets = ProcessSetTable(self.size)
        self._coordinator = (
            Coordinator(self.size, config.fusion_threshold, config.cache_capacity) if self.rank == 0 else None
        )
        self._stall = StallInspector(config) if self._coordinator is not None else None
        self._links: dict[int, Link] = dict(mesh.control) if mesh is not None else {}
        self._executor = Executor(self.rank, self.sets, self.queue, self._collectives_for)
        data_stall = DataPhaseStall(StallInspector(config), self.rank, self._executor.describe)
        # Holds back signal handlers while the main thread runs engine passes.
        self._shield = InterruptShield()
        self._shielded = False  # True while the main thread holds _drive with the shield up
        self._abandoned: BaseException | None = None  # a handler's exception that cut a collective short
        self._watch = Watch(
            list(self._links.values()),
            self._check_urgent,
            data=mesh.data if mesh is not None else None,
            stall_after=data_stall.first_check,
            on_stall=data_stall,
            interrupts=self._shield,
        )
        self._domain = domain
        self._sharing = sharing or [False] * self.size
        # Unset: hierarchical allreduce/allgather wherever the layout suits it; set: forced on or off.
        self._hierarchical_allreduce = config.hierarchical_allreduce is not False
        self._hierarchical_allgather = config.hierarchical_allgather is not False
        if domain is not None:
            domain.watch = self._watch
        self._collectives: dict[tuple[int, ...], Collectives] = {}
        # HORA_TRANSPORT=mpi: data through MPI communicators (made collectively now).
        self._mpi = MpiWorld(self.rank, self.size) if config.transport == "mpi" else None
        self._responses: deque[Response] = deque()
        # Every rank on this machine, the cache on, the built-in transport: cached small
        # allreduces may skip the coordinator (hora.engine.fast_lane).
        self._lane = (
            FastLane(domain, config)
            if domain is not None
            and self.size > 1
            and domain.ranks == tuple(range(self.size))
            and config.cache_capacity > 0
            and self._mpi is None
            else None
        )
        # The domain's wake-up socket: lane entries from peers arrive as wake-ups on it.
        self._lane_fds = (domain.wake_fileno(),) if self._lane is not None and domain is not None else ()
        self._poller = select.poll()
        self._by_fd = {link.fileno(): link for link in self._links.values()}
        for fd in (self._wake_r.fileno(), *self._lane_fds, *self._by_fd):
            self._poller.register(fd, select.POLLIN)
        self._timeline: Timeline | None = None
        self._timeline_request: tuple[str | None, bool] | None = None
        self._timeline_applied = threading.Event()
        self._timeline_error: OSError | None = None
        if self._coordinator is not None and config.timeline and config.timeline != "DYNAMIC":
            self._use_timeline(Timeline(config.timeline, config.timeline_mark_cycles))
        self._stop_requested = False
        # Held by the thread running an engine pass (the engine thread or a caller).
        self._drive = threading.Lock()
        # Set while the engine thread, or a caller holding _drive, blocks in poll: only
        # then does a submit need to write a wake-up byte (the GIL orders these flags and
        # the queue accesses; see _poll).
        self._sleeping = False
        self._caller_sleeping = False
        self._caller_error: BaseException | None = None  # raised by a caller's pass; the engine fails with it
        self._finished = False  # set under _drive once the engine has failed or closed
        self._driving = False  # set while a caller holds _drive (see drive)
        # Threads in drive() waiting for _drive to come free, by thread id: each sleeps on a
        # held raw lock ("bell") that whoever lets go of _drive releases.
        self._bells: dict[int, _thread.LockType] = {}
        self._caller_left = float("-inf")  # perf_counter time a caller last released _drive
        self._caller_poller: select.poll | None = None  # see _callers_poller
        self._caller_fds: set[int] = set()
        self._park_poller = select.poll()
        self._park_poller.register(self._wake_r.fileno(), select.POLLIN)
        self._last_work = 0.0  # perf_counter time the engine thread's loop last did something
        self._leaving_since: float | None = None  # set once this rank began to leave
        self._leaving_how = CALLED_SHUTDOWN  # what others are told of it (see stop)
        self._hostname = config.topology.hostname
        self._lingering_noted = False
        self._farewells: set[int] = set()  # peers that sent SHUTDOWN: their hang-up is expected
        # Mismatch detection (_report_stuck): threads that submitted collectives here, by
        # ident (written by them, read in passes: whole-dict reads only), threads now in
        # drive(), responses received, and the count last reported stuck (-1: none since
        # the last submission).
        self._submitters: dict[int, threading.Thread] = {}
        self._waiting: set[int] = set()
        self._received = 0
        self._stuck_reported = -1
        self.failure: str | None = None  # why the job failed on this rank, once it has
        self._thread = threading.Thread(target=self._run, name=f"hora-engine-{self.rank}", daemon=True)

    # ----- called from user threads -----

    def start(self) -> None:
        self._thread.start()

    def refuse(self, entries: list[Entry]) -> None:
        """Announces requests this rank refused (``Request.error``) without holding their
        names (see ``TensorQueue.add_refusals``)."""
        self.queue.add_refusals(entries)
        self._wake()

    def submit(self, entry: Entry) -> None:
        """Queues a tensor for negotiation (see ``submit_many``)."""
        self.submit_many([entry])

    def submit_many(self, entries: list[Entry]) -> None:
        """Queues several tensors at once, or none, and announces them.

        When no other thread runs an engine pass, this one announces them itself (and
        on rank 0 sends the responses that became ready to their ranks); it leaves
        executing to a waiting caller or the engine thread. Otherwise the thread in the
        pass sees them; it is woken if it sleeps.

        Raises:
            ValueError: a name is in flight already (see ``TensorQueue.add_many``).
            HoraInternalError: the runtime has shut down or failed.
        """
        if not entries:
            return
        self.queue.add_many(entries)
        thread = threading.current_thread()
        self._submitters[thread.ident or 0] = thread
        # The shield goes up before the lock is taken: no signal handler may raise between
        # taking it and the block that lets it go (it would stay taken for ever).
        shielded = self._shield.enter()
        try:
            # With a cycle time set, the engine thread waits that long to batch tensors.
            if self._config.cycle_time_ms > 0 or not self._drive.acquire(blocking=False):
                self._wake_if_sleeping()
                return
            self._shielded = shielded
            proposed = False
            try:
                if not self._finished and self._caller_error is None:
                    new = self.queue.drain()
                    if new:
                        self._announce(new)
                        proposed = self._lane is not None and self._lane.pending is not None
                    if self._coordinator is not None:
                        self._distribute(self._coordinator.take())
            except BaseException as exc:  # noqa: BLE001 - the engine thread fails the job with it
                self._caller_error = exc
            finally:
                self._shielded = False
                self._let_go()
            if self._responses or self._caller_error is not None:
                self._wake()  # the engine thread executes, unless a waiting caller gets there first
            elif proposed:
                self._wake_if_sleeping()  # a sleeping engine thread does not watch the lane yet
        finally:
            if shielded:
                self._shield.leave()  # runs the signal handlers held back meanwhile (they may raise)

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
        self._waiting.add(me)
        try:
            self._drive_or_sleep(me, handle)
        finally:
            self._waiting.discard(me)

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
                        self._wake()  # the engine thread takes over what this thread leaves
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
        """Releases ``_drive`` and wakes every thread waiting in ``drive`` to try again."""
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
        shield = self._shield
        try:
            while not handle.done() and not self._finished and not self._stop_requested:
                if self._caller_error is not None or shield.pending:
                    break
                poller = self._callers_poller()
                if self._settled_on_lane(handle, poller, spin):
                    continue
                self._report_stuck()  # before this thread may sleep (it is in _waiting)
                events = self._poll(poller, caller=True, spin=spin)
                # Woken by nothing (a lane wait's recheck): the answer is not imminent, so
                # the next wait sleeps at once instead of spinning again.
                spin = bool(events) or self._busy()
                self._absorb(events)
                self._pass()
        except Interrupted:
            pass  # a signal at a safe point: drive() runs its handler once it let go of the lock
        except Abandoned as exc:
            # A handler raised in a data-plane wait whose peers had stopped: this rank cannot
            # finish the collective, so the job fails; the caller gets the handler's exception.
            self._abandoned = exc.error
            self._caller_error = _JobFailed(
                f"rank {self.rank} was interrupted ({type(exc.error).__name__}) in the middle of "
                f"{self._executor.describe()}, whose peers had stopped making progress"
            )
        except BaseException as exc:  # noqa: BLE001 - the engine thread fails the job with it
            self._caller_error = exc
        self._caller_left = time.perf_counter()
        self._driving = False
        lane_waits = self._lane is not None and self._lane.pending is not None
        # The engine thread must see what this thread read and left: a stop among them.
        return (
            self._caller_error is not None or self._stop_requested or self._busy() or self.queue.has_new() or lane_waits
        )

    def stop(self, how: str = CALLED_SHUTDOWN) -> None:
        """Makes this rank leave the job and waits until its engine has finished.

        On rank 0 this returns once every other rank has left too, since they need
        rank 0 to coordinate their remaining collectives.

        Args:
            how: what the others are told of this rank when a collective needs it
                (``Coordinator.depart``).
        """
        self._leaving_how = how
        self._stop_requested = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._shield.restore()

    def set_timeline(self, path: str | None, mark_cycles: bool = False) -> None:
        """Starts recording a timeline into ``path`` (rank 0 only), or stops with None.

        Blocks until an engine pass has switched, so the file is complete on return
        from a stop.

        Raises:
            OSError: the file cannot be created.
            TimeoutError: no pass took the request within ``TIMELINE_WAIT`` seconds.
        """
        if self._coordinator is None or not self._thread.is_alive():
            return
        self._timeline_applied.clear()
        self._timeline_request = (path, mark_cycles)
        self._wake()
        deadline = time.monotonic() + TIMELINE_WAIT
        while not self._timeline_applied.wait(1.0):  # a pass applies it, on any thread
            if not self._thread.is_alive():
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{'stop' if path is None else 'start'}_timeline: the engine did not take the request within "
                    f"{TIMELINE_WAIT:g} s; it is busy with {self._executor.describe()}"
                )
        error = self._timeline_error
        if error is not None:
            raise error

    def _wake_if_sleeping(self) -> None:
        if self._sleeping or self._caller_sleeping:
            self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # a wake-up is already pending, or the engine has closed

    # ----- the engine thread -----

    def _run(self) -> None:
        cores = self._config.thread_affinity
        if cores:
            core = cores[self._config.topology.local_rank % len(cores)]
            try:
                os.sched_setaffinity(0, {core})  # 0: this thread only
            except OSError as exc:
                log.warning("hora: rank %d cannot pin its engine thread to core %d: %s", self.rank, core, exc)
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - every failure must fail the handles, never hang them
            with self._drive:
                self._finished = True
                self._fail(self._reason(exc), settled=isinstance(exc, _JobFailed) and exc.settled)
            self._ring_bells()
        finally:
            with self._drive:
                self._finished = True
                self._close()
            self._ring_bells()

    def _reason(self, exc: BaseException) -> str:
        """What every pending operation fails with, for an exception that ended the engine."""
        if isinstance(exc, (_JobFailed, StalledError)):
            return str(exc)
        if isinstance(exc, LinkClosed):
            return self._lost(exc.link, exc.detail)
        if isinstance(exc, PeerProtocolError):
            link = exc.link
            return (
                f"rank {link.peer} on host {link.peer_host} sent a malformed control message ({exc.detail}); "
                "the job cannot go on with it"
            )
        log.error("hora: the engine on rank %d failed", self.rank, exc_info=exc)
        return f"hora's engine on rank {self.rank} failed: {exc!r}"

    def _use_timeline(self, timeline: Timeline | None) -> None:
        if self._timeline is not None:
            self._timeline.close()
        self._timeline = timeline
        if self._coordinator is not None:
            self._coordinator.timeline = timeline
        self._executor.timeline = timeline

    def _apply_timeline_request(self) -> None:
        request, self._timeline_request = self._timeline_request, None
        if request is None:
            return
        path, mark_cycles = request
        self._timeline_error = None
        try:
            self._use_timeline(None if path is None else Timeline(path, mark_cycles))
        except OSError as exc:
            self._timeline_error = exc
        self._timeline_applied.set()

    def _loop(self) -> None:
        """The engine thread: waits without the lock, then runs a pass holding it."""
        while True:
            if self._driving or time.perf_counter() - self._caller_left < PARK_SECONDS:
                events = self._park()
            else:
                events = self._poll(self._poller, caller=False)
            with self._drive:
                # Invariant: _finished is set before the lock is let go for the last time,
                # so no caller drives an engine that is ending (it would read, and lose, the
                # frames that end it, and wait for ever holding the lock).
                ending = True
                try:
                    ending = self._engine_pass(events)
                finally:
                    self._finished = ending
            self._ring_bells()
            if ending:
                return

    def _engine_pass(self, events: list[tuple[int, int]]) -> bool:
        """The engine thread's pass (holding ``_drive``); returns True when the engine is done."""
        if self._caller_error is not None:
            error, self._caller_error = self._caller_error, None
            raise error
        self._absorb(events)
        self._note_lingering()
        if self._stop_requested and self._leaving_since is None:
            self._begin_leaving()
            if self._coordinator is None:
                self._leave()
                return True
        if self._pass():
            self._last_work = time.perf_counter()
        elif self._timeline is not None:
            self._timeline.flush()  # about to idle: the file on disk is complete
        # Rank 0 is done once it has left and every worker has left too.
        return self._leaving_since is not None and not self._links and not self._responses

    def _pass(self) -> bool:
        """One pass of the loop (the caller holds ``_drive``); returns whether it did any work."""
        self._apply_timeline_request()
        self._read_control()
        worked = self._settle_lane() is not None
        new = self.queue.drain()
        worked = worked or bool(new or self._responses)
        if new and self._config.cycle_time_ms > 0:
            time.sleep(self._config.cycle_time_ms / 1000.0)  # let more tensors join this batch
            new += self.queue.drain()
        if new:
            self._announce(new)
        if self._coordinator is not None:
            self._coordinator.find_mismatches()
            self._distribute(self._coordinator.take())
        if self._timeline is not None and (new or self._responses):
            self._timeline.cycle()
        while self._responses:
            self._executor.run(self._responses.popleft())
        if self._stall is not None and self._coordinator is not None:
            self._stall.check(self._coordinator)
        if self._lane is not None:
            self._lane.serve(self._lane_busy())
        if self._waiting:
            self._report_stuck()
        return worked

    def _report_stuck(self) -> None:
        """Tells the coordinator when every thread that submits collectives here waits for
        one, with every response sent here executed (``Coordinator.note_stuck``): it
        fails the collectives of ranks that can never move again. Threads that ended
        do not count; a wait with a timeout is not a wait here (it never drives)."""
        received = self._received
        if received == self._stuck_reported or self._responses:
            return
        if self._lane is not None and self._lane.pending is not None:
            return  # the lane may still answer
        waiting = self._waiting
        for ident, thread in tuple(self._submitters.items()):
            if ident not in waiting and thread.is_alive():
                return
        self._stuck_reported = received
        if self._coordinator is not None:
            self._coordinator.note_stuck(self.rank, received)
        elif 0 in self._links:
            self._links[0].send_frame(messages.STUCK, messages.encode_count(received), self._watch)

    def _settle_lane(self) -> bool | None:
        """Completes this rank's lane proposal once settled, or sends it the coordinator's way.

        Returns:
            None while it waits; else whether it succeeded.
        """
        lane = self._lane
        if lane is None or lane.pending is None:
            return None
        settled = lane.settle()
        if settled is None:
            return None
        entry, succeeded = settled
        if not succeeded:
            self._announce([entry], lane=False)
            return False
        if self.queue.pop(entry.request.process_set_id, entry.request.name) is not None:
            assert entry.output is not None  # invariant: FastLane.carries
            entry.handle.complete(entry.output.reshape(entry.shape))
        return True

    def _settled_on_lane(self, handle: Handle, poller: select.poll, spin: bool) -> bool:
        """The lane's short cut for a caller waiting for its own lane proposal: spins (if
        ``spin``) on the answers alone and settles it without a full pass. Returns False
        (the caller runs a pass) when anything else needs a pass: a frame, a wake-up, a new
        tensor, or the spin running out.
        """
        lane = self._lane
        if lane is None or lane.pending is None or lane.pending.entry.handle is not handle:
            return False
        spin_until = time.perf_counter() + (SPIN_AFTER_WORK if spin else 0.0)
        while not lane.settled():
            if poller.poll(0) or self.queue.has_new() or time.perf_counter() >= spin_until:
                return False
        if self._settle_lane() is False:
            self._pass()  # it went the coordinator's way: send it on (on rank 0, match it) now
        return True

    def _lane_busy(self, announcing: int = 0) -> bool:
        """True while this rank has collectives on the coordinator's path, besides the lane's
        and ``announcing`` entries being announced now (or rank 0 records a timeline, which
        should show every collective): it then refuses lane proposals, and proposes none."""
        lane = self._lane
        on_lane = 1 if lane is not None and lane.pending is not None else 0
        return len(self.queue) > on_lane + announcing or self._timeline is not None

    def _park(self) -> list[tuple[int, int]]:
        """Sleeps on the wake-up socket alone, at most ``PARK_SECONDS`` (see there)."""
        return [] if self.queue.has_new() else self._park_poller.poll(PARK_SECONDS * 1000.0)

    def _busy(self) -> bool:
        """True when a pass has work without waiting (a racy read: fine for choosing a timeout)."""
        return (
            bool(self._responses)
            or any(link.frames or link.closed_by_peer for link in self._links.values())
            or (self._lane is not None and self._lane.settled())
        )

    def _callers_poller(self) -> select.poll:
        """The poll set callers use (one at a time, holding ``_drive``): the wake-up
        socket and the open control links, rebuilt when a link has closed."""
        if self._caller_poller is None or self._caller_fds != self._by_fd.keys():
            self._caller_poller = select.poll()
            self._caller_fds = set(self._by_fd)
            for fd in (self._wake_r.fileno(), *self._lane_fds, *self._caller_fds):
                self._caller_poller.register(fd, select.POLLIN)
        return self._caller_poller

    def _poll(self, poller: select.poll, caller: bool, spin: bool = True) -> list[tuple[int, int]]:
        """Waits for a wake-up, a control frame, a submit, or a timeout; reads nothing.

        Spins briefly first where a reply is likely soon: a caller (it waits for a
        result) unless ``spin`` is False, the engine thread just after it did work. A job
        of one rank has no peer to hear from, so nothing to spin for.
        """
        lane = self._lane
        busy = self._busy()
        events = poller.poll(0)
        if events or busy:
            return events
        timeout_ms = self._sleep_timeout_ms(caller)
        since = (time.perf_counter() if spin else float("-inf")) if caller else self._last_work
        spin_until = since + (SPIN_AFTER_WORK if self._links else 0.0)
        while not events and not self.queue.has_new() and time.perf_counter() < spin_until:
            if lane is not None and lane.settled():
                return events
            events = poller.poll(0)
        if events or self.queue.has_new():
            return events
        # Invariant: the flag is set before the last look at the queue, and a submit
        # adds before it reads the flag, so a submit either is seen here or writes a
        # wake-up byte. The lane's watch flag works alike for peers' entries (with a
        # fence on both sides, see fast_lane), and a lane wait also wakes for its recheck.
        if caller:
            self._caller_sleeping = True
        else:
            self._sleeping = True
        watched = lane if lane is not None and lane.pending is not None else None
        if watched is not None:
            watched.watch(caller, True)
            recheck = watched.recheck_ms()
            timeout_ms = recheck if timeout_ms is None else min(timeout_ms, recheck)
        try:
            if not self.queue.has_new() and not (watched is not None and watched.settled()):
                # A safe point: nothing is read while blocked here, so a signal may end the
                # main thread's wait at once (InterruptShield raises Interrupted).
                self._shield.safe = caller and self._shielded
                events = poller.poll(timeout_ms)
        finally:
            self._shield.safe = False
            if watched is not None:
                watched.watch(caller, False)
            if caller:
                self._caller_sleeping = False
            else:
                self._sleeping = False
        return events

    def _sleep_timeout_ms(self, caller: bool) -> float | None:
        """How long a wait may block: until the next stall check or lingering notice."""
        timeout_ms: float | None = None
        if self._stall is not None and self._coordinator is not None:
            checks = (self._stall.seconds_to_next_check(self._coordinator), self._coordinator.seconds_to_mismatch_check())
            seconds = min((c for c in checks if c is not None), default=None)
            timeout_ms = None if seconds is None else seconds * 1000.0
        if not caller and self._leaving_since is not None and not self._lingering_noted:
            notice = max(0.0, self._leaving_since + LINGER_NOTICE - time.monotonic()) * 1000.0
            timeout_ms = notice if timeout_ms is None else min(timeout_ms, notice)
        return timeout_ms

    def _note_lingering(self) -> None:
        """On rank 0, says once whom it still waits for, long after its own shutdown()."""
        if self._leaving_since is None or self._lingering_noted or not self._links:
            return
        if time.monotonic() - self._leaving_since >= LINGER_NOTICE:
            self._lingering_noted = True
            waiting = ", ".join(map(str, sorted(self._links)))
            log.warning("hora: rank 0 has shut down; it coordinates rank(s) %s until they shut down too", waiting)

    def _absorb(self, events: list[tuple[int, int]]) -> None:
        """Reads what ``_poll`` found ready (the caller holds ``_drive``).

        Another thread may have read it first: reads never block, so a stale event
        costs a failed read.
        """
        for fd, _ in events:
            if fd == self._wake_r.fileno():
                self._drain_wake()
                continue
            if fd in self._lane_fds and self._domain is not None:
                self._domain.drain_wake()
                continue
            link = self._by_fd.get(fd)
            if link is not None:
                link.pump()
                if link.closed_by_peer:
                    # Its peer hung up: the socket would be ready for ever. Callers'
                    # poll set is rebuilt from _by_fd (_callers_poller).
                    del self._by_fd[fd]
                    self._poller.unregister(fd)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass  # drained: nothing more to read

    def _read_control(self) -> None:
        for peer, link in list(self._links.items()):
            while link.frames and peer in self._links:
                kind, payload = link.frames.popleft()
                try:
                    self._on_frame(link, kind, payload)
                except ProtocolError as exc:
                    raise PeerProtocolError(link, str(exc)) from None
            if link.closed_by_peer and peer in self._links:
                if peer not in self._farewells:
                    raise _JobFailed(self._lost(link, link.close_detail))
                self._drop(link)

    def _on_frame(self, link: Link, kind: int, payload: bytes) -> None:
        if kind in (messages.ABORT, messages.FAILURE):
            raise _JobFailed(messages.decode_reason(payload), settled=True)
        if self._coordinator is not None and kind == messages.SHUTDOWN:
            self._farewells.add(link.peer)
            # Responses already decided still reach the leaving rank, which runs them.
            self._distribute(self._coordinator.take())
            self._coordinator.depart(link.peer, f"on host {link.peer_host} {messages.decode_reason(payload)}")
            self._drop(link)  # closing our end tells the worker it may go
        elif self._coordinator is not None and kind == messages.REQUESTS:
            requests, cached = messages.decode_requests(payload)
            for request in requests:
                if request.rank != link.peer:
                    raise ProtocolError(f"a request in the name of rank {request.rank}")
            self._coordinator.submit_many(requests, cached, link.peer)
        elif self._coordinator is not None and kind == messages.STUCK:
            self._coordinator.note_stuck(link.peer, messages.decode_count(payload))
        elif self._coordinator is None and kind == messages.RESPONSES:
            responses = messages.decode_responses(payload)
            self._received += len(responses)
            self._responses.extend(responses)
        else:
            raise ProtocolError(f"an unexpected control frame (kind {kind})")

    def _check_urgent(self, link: Link) -> None:
        """Runs while a collective waits: an abort or an unexpected hang-up ends it."""
        for kind, payload in link.frames:
            if kind in (messages.ABORT, messages.FAILURE):
                raise _JobFailed(messages.decode_reason(payload), settled=True)
            if kind == messages.SHUTDOWN:
                self._farewells.add(link.peer)
        if link.closed_by_peer and link.peer not in self._farewells:
            raise _JobFailed(self._lost(link, link.close_detail))

    def _announce(self, entries: list[Entry], lane: bool = True) -> None:
        """Tells the coordinator about new tensors: unchanged cached ones by id only.

        A lone cached small allreduce, with nothing else of this rank's in flight, is
        proposed on the fast lane instead (unless ``lane`` is False: it came back from
        there), and the coordinator hears of it only if the lane fails it.
        """
        fast_lane = self._lane
        if lane and fast_lane is not None and len(entries) == 1 and fast_lane.carries(entries[0]):
            cache_id = self._executor.cache.lookup(entries[0].request)
            if cache_id is not None and not self._lane_busy(announcing=1) and fast_lane.propose(entries[0], cache_id):
                return
        requests: list[messages.Request] = []
        cached: list[int] = []
        for entry in entries:
            cache_id = self._executor.cache.lookup(entry.request)
            if cache_id is None:
                requests.append(entry.request)
            else:
                cached.append(cache_id)
        if fast_lane is not None and entries:
            fast_lane.serve(busy=True)  # refuse proposals: one may be for a tensor sent here
        self._stuck_reported = -1  # a rank that submits is not stuck
        if self._coordinator is not None:
            self._coordinator.submit_many(requests, cached, self.rank)
        else:
            payload = messages.encode_requests(requests, cached)
            self._links[0].send_frame(messages.REQUESTS, payload, self._watch)

    def _distribute(self, ready: list[tuple[Response, tuple[int, ...]]]) -> None:
        by_rank: dict[int, list[Response]] = {}
        for response, members in ready:
            for member in members:
                if member == self.rank:
                    self._received += 1
                    self._responses.append(response)
                elif member in self._links:
                    by_rank.setdefault(member, []).append(response)
        for member, responses in by_rank.items():
            self._links[member].send_frame(messages.RESPONSES, messages.encode_responses(responses), self._watch)

    def _collectives_for(self, ranks: tuple[int, ...]) -> Collectives:
        """The algorithms of a process set.

        All members on this machine: shared memory. Members on several hosts, the same
        number on each, more than one per host, and shared memory working on every one
        of them: hierarchical allreduce and allgather (each unless turned off). Otherwise
        the TCP ring. Every member decides
        from the same facts (host names, machines, ``sharing``), so all decide alike.
        """
        collectives = self._collectives.get(ranks)
        if collectives is not None:
            return collectives
        if self._mpi is not None:
            collectives = self._collectives[ranks] = self._mpi.collectives(ranks)
            return collectives
        data = self._mesh.data if self._mesh is not None else {}

        def channel(members: tuple[int, ...]) -> MeshChannel:
            return MeshChannel(members, self.rank, data, self._watch)

        domain = self._domain
        hosts = self._hosts_of(ranks)
        if domain is not None and len(ranks) > 1 and len(hosts) == 1:
            collectives = SharedCollectives(ShmGroup(domain, ranks), channel(ranks))
        elif (
            domain is not None
            and (self._hierarchical_allreduce or self._hierarchical_allgather)
            and self._layered(ranks, hosts)
        ):
            local = next(members for members in hosts if self.rank in members)
            index = local.index(self.rank)
            cross = tuple(members[index] for members in hosts)
            collectives = HierarchicalCollectives(
                SharedCollectives(ShmGroup(domain, local), channel(local)),
                TcpCollectives(channel(cross)),
                channel(ranks),
                layout=[tuple(ranks.index(rank) for rank in members) for members in hosts],
                allreduce=self._hierarchical_allreduce,
                allgather=self._hierarchical_allgather,
            )
        else:
            collectives = TcpCollectives(channel(ranks))
        self._collectives[ranks] = collectives
        return collectives

    def _hosts_of(self, ranks: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The set's members grouped by machine, groups ordered by their first member."""
        if self._mesh is None:
            return [ranks]
        groups: dict[tuple[str, str], list[int]] = {}
        for rank in ranks:
            groups.setdefault((self._mesh.hosts[rank], self._mesh.machines[rank]), []).append(rank)
        return [tuple(members) for members in groups.values()]

    def _layered(self, ranks: tuple[int, ...], hosts: list[tuple[int, ...]]) -> bool:
        """True when the set suits hierarchical allreduce."""
        per_host = {len(members) for members in hosts}
        return (
            len(hosts) > 1
            and len(per_host) == 1
            and per_host.pop() > 1
            and all(self._sharing[rank] for rank in ranks)
        )

    def _lost(self, link: Link, detail: str) -> str:
        role = " (the coordinator)" if link.peer == 0 else ""
        return f"rank {link.peer}{role} on host {link.peer_host} was lost: {detail}"

    def _drop(self, link: Link) -> None:
        """Forgets a control link whose peer has left, and closes it."""
        self._links.pop(link.peer, None)
        self._watch.links.pop(link.fileno(), None)
        if self._by_fd.pop(link.fileno(), None) is not None:
            try:
                self._poller.unregister(link.fileno())
            except (KeyError, ValueError):
                pass  # already unregistered when the peer hung up
        link.close()

    # ----- endings -----

    def _begin_leaving(self) -> None:
        """Refuses new work from this rank's threads; work already submitted goes on."""
        self._leaving_since = time.monotonic()
        if self._lane is not None:
            self._lane.leave()
        self.queue.seal(internal_error(f"hora has shut down on rank {self.rank}"))
        if self._coordinator is not None:
            self._announce(self.queue.drain())
            self._coordinator.depart(self.rank, f"on host {self._hostname} {self._leaving_how}")

    def _leave(self) -> None:
        """A worker's goodbye: tell rank 0, run what it already decided, wait for its close."""
        control = self._links.get(0)
        if control is None:
            return
        self._farewells.add(0)  # rank 0 closes its end once it has read our goodbye
        control.send_frame(messages.SHUTDOWN, messages.encode_reason(self._leaving_how), self._watch)
        try:
            control.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # rank 0 already closed: nothing left to say
        poller = select.poll()
        poller.register(control.fileno(), select.POLLIN)
        deadline = time.monotonic() + LEAVE_WAIT
        while True:
            while control.frames:
                kind, payload = control.frames.popleft()
                if kind in (messages.ABORT, messages.FAILURE):
                    raise _JobFailed(messages.decode_reason(payload), settled=True)
                if kind == messages.RESPONSES:
                    for response in messages.decode_responses(payload):
                        self._executor.run(response)
            if control.closed_by_peer:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning(
                    "hora: rank %d: rank 0 did not answer its shutdown within %g s (frozen?); leaving anyway",
                    self.rank,
                    LEAVE_WAIT,
                )
                return
            if poller.poll(remaining * 1000.0):
                control.pump()

    def _fail(self, reason: str, settled: bool = False) -> None:
        """Fails the job on this rank, telling the others, and settles on the root cause
        (unless ``settled``: the reason is rank 0's account already)."""
        if self._coordinator is not None:
            for link in list(self._links.values()):
                self._send_quietly(link, messages.ABORT, messages.encode_reason(reason))
        elif 0 in self._links and not settled:
            control = self._links[0]
            if not control.closed_by_peer:
                self._send_quietly(control, messages.FAILURE, messages.encode_reason(f"rank {self.rank}: {reason}"))
            reason = self._await_abort(control, reason)
        self.failure = reason
        log.error("hora: rank %d: %s", self.rank, reason)
        self.queue.close(internal_error(reason))
        self._executor.abandon(internal_error(reason))

    def _await_abort(self, control: Link, reason: str) -> str:
        """Waits briefly for rank 0's ABORT, whose reason names the root cause.

        Rank 0 closing its end without one means rank 0 itself was lost: that is then the
        root cause (every rank that failed after it sees it so), not the peer whose loss
        this rank happened to notice first (which may only have failed because rank 0 did).
        """
        deadline = time.monotonic() + ROOT_CAUSE_WAIT
        poller = select.poll()
        poller.register(control.fileno(), select.POLLIN)
        while True:
            for kind, payload in control.frames:
                if kind == messages.ABORT:
                    return messages.decode_reason(payload)
            remaining = deadline - time.monotonic()
            if control.closed_by_peer:
                return reason if 0 in self._farewells else self._lost(control, control.close_detail)
            if remaining <= 0:
                return reason
            if poller.poll(remaining * 1000.0):
                try:
                    control.pump()
                except ProtocolError:
                    return reason

    def _send_quietly(self, link: Link, kind: int, payload: bytes) -> None:
        """Sends a small frame if the socket takes it now; a dead peer is not an error here."""
        try:
            link.sock.send(encode_frame(kind, payload))
        except OSError:
            pass  # the peer is gone or its buffer is full: it learns from the closed link

    def _close(self) -> None:
        self._use_timeline(None)
        self._timeline_applied.set()  # a start_timeline racing with the end does not wait forever
        error = internal_error(self.failure or f"hora has shut down on rank {self.rank}")
        self.queue.close(error)
        self._executor.abandon(error)
        if self._lane is not None:
            self._lane.leave()
            self._lane.close()
        if self._domain is not None:
            self._domain.close()
        if self._mesh is not None:
            self._mesh.close()
        self._wake_r.close()
        self._wake_w.close()
        self._shield.close()
