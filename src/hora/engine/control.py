"""What an engine pass owns: the control links, the responses to run, and one pass.

A *pass* reads control frames, settles this rank's fast-lane proposal, announces new
tensors, hands out ready responses (rank 0), executes this rank's responses in the
agreed order, and reports stalls and a stuck rank. Passes run on whichever thread holds
the engine's lock (``Engine._drive``): the engine thread, or a user thread that submits
or waits. Everything here belongs to that thread.

Who may touch what:

=====================================  ==================================================
field                                  owner
=====================================  ==================================================
``links``, ``by_fd``, ``responses``,   the thread holding the drive lock (in a pass, or in
``received``, ``farewells``,           the data-plane waits a pass runs, which read the
``coordinator``, ``executor``,         links through ``watch``)
``lane`` (its ``pending``),
``timeline``, ``stuck_reported``,
``poller`` registrations
``submitters``                         written by submitting threads (one key each), read
                                       whole (``tuple(d.items())``) under the lock
``waiting``                            added/removed by waiting threads, read under the lock
``published``                          written under the lock (one attribute store), read
                                       by the engine thread while it sleeps without it
``timeline_request``                   written by a user thread, taken under the lock
``cycle_time_ms``, ``applied``,        written under the lock (autotune's changes); read
``tuner``                              by submitting threads and ``stats`` without it
                                       (one attribute, or a copy of the list)
=====================================  ==================================================

Everything a sleeper needs comes from ``plan()`` (under the lock) or ``published`` (the
plan of the last pass): ``hora.engine.waiting`` never walks the tables above.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from hora.config import Config
from hora.engine import messages
from hora.engine.autotune import STEP_KINDS, Params, Tuner, bytes_allreduced
from hora.engine.coordinator import Coordinator
from hora.engine.executor import Executor
from hora.engine.fast_lane import FastLane, Proposal
from hora.engine.handles import Handle
from hora.engine.messages import Response
from hora.engine.queue import Entry, TensorQueue
from hora.engine.riders import riders
from hora.engine.stall import SilentPeer, StallInspector
from hora.engine.timeline import Timeline
from hora.errors import ProtocolError
from hora.transport.shm import Domain
from hora.transport.tcp import Link, PeerProtocolError, Watch

LINGER_NOTICE = 30.0  # seconds after its shutdown() before rank 0 says whom it waits for
# Seconds a rank stays stuck (every submitting thread waiting) before it tells the
# coordinator: most waits end within a millisecond, and a report per wait costs a frame,
# and the CPU to send and read it, on both ranks; the coordinator acts on it only after
# ``coordinator.MISMATCH_GRACE`` (1 s).
STUCK_REPORT_DELAY = 2e-3


class JobFailed(Exception):
    """Ends the engine loop; the message is the reason every pending op fails with.

    Args:
        reason: the message.
        settled: the reason is rank 0's account (an ABORT or another rank's FAILURE):
            it names the root cause already.
    """

    def __init__(self, reason: str, settled: bool = False) -> None:
        super().__init__(reason)
        self.settled = settled


class WaitPlan(NamedTuple):
    """What a thread about to sleep needs to know, computed under the drive lock (a tuple:
    made at least once per blocking collective, so it must be cheap).

    Attributes:
        busy: a pass has work without waiting (responses to run, frames read, a closed link).
        deadline: ``time.monotonic()`` of the next stall or mismatch check or lingering
            notice (None: none), so the sleeper wakes for it.
        proposal: this rank's fast-lane proposal awaiting answers (its outcome is read
            from shared memory, so the sleeper watches for it), or None.
        peers: the job has other ranks (only then is a reply worth spinning for).
    """

    busy: bool = False
    deadline: float | None = None
    proposal: Proposal | None = None
    peers: bool = False


class ControlPlane:
    """The state of one rank's engine that passes own, and the pass itself.

    Args:
        config: the validated configuration.
        control: the control links by peer rank (rank 0: every worker; a worker: rank 0).
        queue: the tensor queue.
        executor: runs responses.
        lane: the fast lane, when this job may use it.
        watch_for: builds the data-plane watch from the check this plane runs on frames
            that arrive while a collective waits.
        hostname: this rank's host, for messages.
    """

    def __init__(
        self,
        config: Config,
        control: dict[int, Link],
        queue: TensorQueue,
        executor: Executor,
        lane: FastLane | None,
        watch_for: Callable[[Callable[[Link], None]], Watch],
        hostname: str,
        domain: Domain | None = None,
    ) -> None:
        self.rank = config.topology.rank
        self.size = config.topology.size
        # Changed by autotune, at the same point of the response sequence on every rank.
        self.cycle_time_ms = config.cycle_time_ms
        self.ride_bytes = config.ride_bytes  # small tensors' data goes with their requests (riders)
        # Larger cached allreduces and groups may go on the lane by id (FastLane.carries_by_id):
        # not under autotune (its changes come from rank 0 alone); groups, which run fused
        # there, not with fusion off.
        self.by_id = not config.autotune
        self.fuses = config.fusion_threshold > 0
        self.hostname = hostname
        self.queue = queue
        self.executor = executor
        self.lane = lane
        self.links = dict(control)
        self.by_fd = {link.fileno(): link for link in self.links.values()}
        self.watch = watch_for(self.check_urgent)
        self.coordinator = (
            Coordinator(self.size, config.fusion_threshold, config.cache_capacity) if self.rank == 0 else None
        )
        self.stall = StallInspector(config) if self.coordinator is not None else None
        # Clocks on silent peers, by rank (SilentPeer): a worker's on rank 0 from the start,
        # rank 0's on each worker once it has shut down (watch_leaving). PINGs are answered
        # once each, by number.
        self.silences: dict[int, SilentPeer] = {}
        if self.coordinator is None and 0 in self.links and not config.stall_check_disable:
            coordinator = f"rank 0 (the coordinator) on host {self.links[0].peer_host}"
            self.silences[0] = SilentPeer(StallInspector(config), self.rank, coordinator, "its responses")
        self.pings_answered: dict[int, int] = {}
        # Probes in a data-phase stall (DataPhaseStall: rank 0 asks every worker, a worker
        # asks rank 0): whom the last one asked, the last PING number a probe sent each
        # peer, and the highest PONG number each peer sent back.
        self.probed: set[int] = set()
        self.probe_pings: dict[int, int] = {}
        self.pongs: dict[int, int] = {}
        # Rank 0 tunes (HORA_AUTOTUNE); every rank applies the changes (hora.engine.autotune).
        self.domain = domain  # its staging size is autotune's to change
        staging = 2 * domain.round_bytes if domain is not None else 0
        self.tuner = Tuner(config, staging_bytes=staging) if config.autotune and self.coordinator is not None else None
        self.applied: list[Params] = []  # the parameter changes this rank applied, in order
        executor.on_params = self.apply_params
        self.responses: deque[Response] = deque()
        self.farewells: set[int] = set()  # peers that sent SHUTDOWN: their hang-up is expected
        self.timeline: Timeline | None = None
        self.timeline_request: tuple[str | None, bool] | None = None
        self.timeline_applied = threading.Event()
        self.timeline_error: OSError | None = None
        if self.coordinator is not None and config.timeline and config.timeline != "DYNAMIC":
            self.use_timeline(Timeline(config.timeline, config.timeline_mark_cycles))
        # Mismatch detection (report_stuck): threads that submitted collectives here, by
        # ident; threads now waiting in Engine.drive; responses received; the count last
        # reported stuck (-1: none since this rank last submitted); and, while this rank
        # is stuck but has not said so yet, when it will (time.monotonic()) and at which count.
        self.submitters: dict[int, threading.Thread] = {}
        self.waiting: set[int] = set()
        self.received = 0
        self.stuck_reported = -1
        self.stuck_due: float | None = None
        self._stuck_count = -1
        self.leaving_since: float | None = None  # set once this rank began to leave
        self.lingering_noted = False
        self.published = WaitPlan(False, None, None, bool(self.links))
        self.on_unregister: Callable[[int], None] = lambda fd: None  # the engine's poll set drops fd

    # ----- a pass -----

    def run_pass(self) -> bool:
        """One pass (the caller holds the drive lock); returns whether it did any work.

        Raises:
            JobFailed, PeerProtocolError, LinkClosed, StalledError: the job fails.
        """
        self.apply_timeline_request()
        self.read_control()
        worked = self.settle_lane() is not None
        new = self.queue.drain()
        worked = worked or bool(new or self.responses)
        if new and self.cycle_time_ms > 0:
            time.sleep(self.cycle_time_ms / 1000.0)  # let more tensors join this batch
            new += self.queue.drain()
        if new:
            self.announce(new)
        if self.coordinator is not None:
            self.coordinator.find_mismatches()
            self.distribute(self.coordinator.take())
        if self.timeline is not None and (new or self.responses):
            self.timeline.cycle()
        while self.responses:
            self.run_next()
        if self.stall is not None and self.coordinator is not None:
            self.stall.check(self.coordinator)
        if self.silences:
            self.check_silences()
        if self.lane is not None:
            self.lane.serve(self.lane_busy())
        if self.waiting:
            self.report_stuck()
        return worked

    def run_next(self) -> None:
        """Executes the next response of the sequence (the caller holds the drive lock)."""
        self.before_response()
        response = self.responses.popleft()
        self.executor.run(response)
        tuner = self.tuner
        if tuner is not None and tuner.active and response.type in STEP_KINDS:
            self.measure(response.names, bytes_allreduced(response))

    def run_delivered(self) -> None:
        """Executes the responses at the head of the sequence that carry their results
        (``hora.engine.riders``): each only copies its result out, with nothing to wait
        for, so a submitting thread runs them rather than wake the engine thread to (a
        wake-up costs a cross-CPU interrupt and the GIL's hand-over, more than the copy).
        Stops at the first response with a data phase, and while a lane proposal is
        pending (settling it may run one)."""
        lane = self.lane
        while self.responses and self.responses[0].data and (lane is None or lane.pending is None):
            self.run_next()

    def plan(self, engine_thread: bool) -> WaitPlan:
        """What a sleeper needs now (under the drive lock); see ``WaitPlan``."""
        deadline = None
        coordinator = self.coordinator
        if coordinator is not None and coordinator.waiting_anything():
            assert self.stall is not None  # invariant: rank 0 has both
            checks = (self.stall.seconds_to_next_check(coordinator), coordinator.seconds_to_mismatch_check())
            seconds = min((c for c in checks if c is not None), default=None)
            deadline = None if seconds is None else time.monotonic() + seconds
        if engine_thread and self.leaving_since is not None and not self.lingering_noted:
            notice = self.leaving_since + LINGER_NOTICE
            deadline = notice if deadline is None else min(deadline, notice)
        if not engine_thread and self.stuck_due is not None:
            deadline = self.stuck_due if deadline is None else min(deadline, self.stuck_due)
        for silence in self.silences.values():  # their times, waiting or not (see SilentPeer.due_at)
            deadline = silence.due_at if deadline is None else min(deadline, silence.due_at)
        lane = self.lane
        return WaitPlan(self.busy(), deadline, None if lane is None else lane.pending, bool(self.links))

    def awaits_coordinator(self) -> bool:
        """A worker: it waits for a response from rank 0 (it has tensors in flight, none
        of them on the fast lane's path, and no response to execute)."""
        return not self.responses and len(self.queue) > self._on_lane()

    def busy(self) -> bool:
        """True when a pass has work without waiting: responses to run, frames read, a link closed."""
        if self.responses:
            return True
        for link in self.links.values():
            if link.frames or link.closed_by_peer:
                return True
        return False

    def settle_timeline(self) -> None:
        """Writes the timeline's pending events once a pass leaves nothing to run now.

        The file on disk then shows every finished collective while the rank waits or
        idles (Horovod's writer thread writes events as they come); during a burst of work
        the events are written together.
        """
        if self.timeline is not None and not self.busy():
            self.timeline.flush()

    def publish(self) -> None:
        """Leaves the engine thread the plan it sleeps by (under the drive lock, before
        letting go of it)."""
        self.published = self.plan(engine_thread=True)

    def absorb(self, events: list[tuple[int, int]]) -> None:
        """Reads the control links a poll found ready (under the drive lock; other
        descriptors are the sleeper's).

        Another thread may have read them first: reads never block, so a stale event
        costs a failed read.
        """
        for fd, _ in events:
            link = self.by_fd.get(fd)
            if link is not None:
                link.pump()
                if link.closed_by_peer:
                    # Its peer hung up: the socket would be ready for ever.
                    del self.by_fd[fd]
                    self.on_unregister(fd)

    def read_control(self) -> None:
        """Handles every control frame read so far, and links whose peer hung up.

        Raises:
            JobFailed: an abort, or a peer lost without saying goodbye.
            PeerProtocolError: a peer sent a frame that makes no sense here.
        """
        for peer, link in list(self.links.items()):
            if link.frames and peer in self.silences:
                self.silences[peer].heard()
            while link.frames and peer in self.links:
                kind, payload = link.frames.popleft()
                try:
                    self._on_frame(link, kind, payload)
                except ProtocolError as exc:
                    raise PeerProtocolError(link, str(exc)) from None
            if link.closed_by_peer and peer in self.links:
                if peer not in self.farewells:
                    raise JobFailed(self.lost(link, link.close_detail))
                self.drop(link)

    def _on_frame(self, link: Link, kind: int, payload: bytes) -> None:
        if kind in (messages.ABORT, messages.FAILURE):
            raise JobFailed(messages.decode_reason(payload), settled=True)
        if self.coordinator is not None and kind == messages.SHUTDOWN:
            self.farewells.add(link.peer)
            # Responses already decided still reach the leaving rank, which runs them.
            self.distribute(self.coordinator.take())
            self.coordinator.depart(link.peer, f"on host {link.peer_host} {messages.decode_reason(payload)}")
            self.drop(link)  # closing our end tells the worker it may go
        elif self.coordinator is not None and kind == messages.REQUESTS:
            requests, cached, along = messages.decode_requests(payload)
            for request in requests:
                if request.rank != link.peer:
                    raise ProtocolError(f"a request in the name of rank {request.rank}")
            self.coordinator.submit_many(requests, cached, link.peer, along)
        elif self.coordinator is not None and kind == messages.STUCK:
            self.coordinator.note_stuck(link.peer, messages.decode_count(payload))
        elif kind == messages.PING:
            self.answer_ping(link, messages.decode_count(payload))
        elif kind == messages.PONG:
            self._note_pong(link, payload)  # read_control restarted the silence too
        elif self.coordinator is None and kind == messages.RESPONSES:
            responses = messages.decode_responses(payload)
            for response in responses:
                if response.type == messages.ResponseType.PARAMS:
                    Params.from_response(response)  # a malformed change fails here, as a protocol error
            self.received += len(responses)
            self.responses.extend(responses)
        else:
            raise ProtocolError(f"an unexpected control frame (kind {kind})")

    def check_urgent(self, link: Link) -> None:
        """Runs while a collective waits: an abort or an unexpected hang-up ends it.

        Raises:
            JobFailed: an abort, or the peer lost.
        """
        pings = []
        for kind, payload in link.frames:
            if kind in (messages.ABORT, messages.FAILURE):
                raise JobFailed(messages.decode_reason(payload), settled=True)
            if kind == messages.SHUTDOWN:
                self.farewells.add(link.peer)
            if kind == messages.PING:
                pings.append(messages.decode_count(payload))
            if kind == messages.PONG:
                self._note_pong(link, payload)
        if link.closed_by_peer and link.peer not in self.farewells:
            raise JobFailed(self.lost(link, link.close_detail))
        # Answered now (this data phase may outlast the peer's patience), after the loop: a
        # send that waits reads this link into ``frames`` again.
        if pings and not link.sending:
            self.answer_ping(link, max(pings))

    def answer_ping(self, link: Link, number: int) -> None:
        """Answers a peer's PING, once (a data-plane wait may see it first, the next
        pass again)."""
        if number > self.pings_answered.get(link.peer, -1):
            self.pings_answered[link.peer] = number
            link.send_frame(messages.PONG, messages.encode_count(number), self.watch)

    def _note_pong(self, link: Link, payload: bytes) -> None:
        number = messages.decode_count(payload)
        if number > self.pongs.get(link.peer, -1):
            self.pongs[link.peer] = number

    def probe(self) -> None:
        """In a data-phase stall: pings every worker (rank 0) or rank 0 (a worker) still
        linked (``hora.engine.stall.Arbiter``).

        A peer answers each PING number once, in increasing order, so the numbers go on
        from the ones this rank's clock on that peer sent (``SilentPeer.pings``). A peer
        whose link is part-way through a frame from this rank gets no PING (it would land
        inside that frame) and counts as silent: it has not read it for the whole stall.
        """
        self.probed = set()
        for peer, link in self.links.items():
            if peer in self.farewells or link.closed_by_peer:
                continue
            silence = self.silences.get(peer)
            number = self.probe_pings.get(peer, -1) + 1
            if silence is not None:
                number = max(number, silence.pings)
                silence.pings = number + 1
            self.probe_pings[peer] = number
            self.probed.add(peer)
            if not link.sending:
                link.send_frame(messages.PING, messages.encode_count(number), self.watch)

    def silent(self) -> list[int]:
        """The peers the last probe asked that have not answered it (``Arbiter``)."""
        return sorted(peer for peer in self.probed if self.pongs.get(peer, -1) < self.probe_pings[peer])

    def check_silences(self) -> None:
        """Pings the silent peers this rank waits for, and fails the job past the stall
        shutdown time (``SilentPeer``).

        Raises:
            StalledError: a peer left a PING unanswered past the shutdown time.
        """
        # A worker waits for rank 0's responses; rank 0 has left and waits for each worker.
        waiting = self.awaits_coordinator if self.coordinator is None else lambda: True
        for peer, silence in list(self.silences.items()):
            if silence.check(waiting) and peer in self.links:
                self.links[peer].send_frame(messages.PING, messages.encode_count(silence.pings - 1), self.watch)

    def watch_leaving(self) -> None:
        """Rank 0, shut down: starts a clock on every worker it still coordinates."""
        if self.stall is None or not self.stall.enabled:
            return
        for peer, link in self.links.items():
            name = f"rank {peer} on host {link.peer_host}"
            self.silences[peer] = SilentPeer(self.stall, self.rank, name, "it to shut down too, having shut down")
            # Its PINGs number on from a data-phase probe's (a peer answers each number once).
            self.silences[peer].pings = self.probe_pings.get(peer, -1) + 1

    def announce(self, entries: list[Entry], lane: bool = True) -> None:
        """Tells the coordinator about new tensors: unchanged cached ones by id only.

        A lone cached allreduce, a whole grouped call of them or a batch of lone ones
        (``FastLane.carries_by_id``), with nothing else of this rank's in flight, is
        proposed on the fast lane instead (unless ``lane`` is False: it came back from
        there), and the coordinator hears of it only if the lane fails it.
        """
        fast_lane = self.lane
        if lane and fast_lane is not None and self._propose(fast_lane, entries):
            return
        requests: list[messages.Request] = []
        cached: list[int] = []
        in_full: list[int] = []  # the entries' indexes, in the frame's order: full requests first
        by_id: list[int] = []
        for index, entry in enumerate(entries):
            cache_id = self.executor.cache.lookup(entry.request)
            if cache_id is None:
                requests.append(entry.request)
                in_full.append(index)
            else:
                cached.append(cache_id)
                by_id.append(index)
        along = riders(entries, self.rank, self.ride_bytes)
        if along and by_id:
            along = [along[i] for i in in_full + by_id]
        if fast_lane is not None and entries:
            fast_lane.serve(busy=True)  # refuse proposals: one may be for a tensor sent here
        self.stuck_reported = -1  # a rank that submits is not stuck
        self.stuck_due = None
        if self.coordinator is not None:
            self.coordinator.submit_many(requests, cached, self.rank, along)
        else:
            payload = messages.encode_requests(requests, cached, along)
            self.links[0].send_frame(messages.REQUESTS, payload, self.watch)
            if 0 in self.silences:
                self.silences[0].heard()  # the wait for rank 0's answer starts now

    def distribute(self, ready: list[tuple[Response, tuple[int, ...]]]) -> None:
        """Hands each ready response to its members: this rank's own to ``responses``."""
        by_rank: dict[int, list[Response]] = {}
        for response, members in ready:
            for member in members:
                if member == self.rank:
                    self.received += 1
                    self.responses.append(response)
                elif member in self.links:
                    by_rank.setdefault(member, []).append(response)
        # Members of the same process sets receive the same responses: encode each
        # distinct sequence once (with one process set, once for every rank).
        encoded: dict[tuple[int, ...], bytes] = {}
        for member, responses in by_rank.items():
            key = tuple(map(id, responses))
            payload = encoded.get(key)
            if payload is None:
                payload = encoded[key] = messages.encode_responses(responses)
            self.links[member].send_frame(messages.RESPONSES, payload, self.watch)

    def report_stuck(self) -> None:
        """Tells the coordinator when every thread that submits collectives here has waited
        for one for ``STUCK_REPORT_DELAY``, with every response sent here executed
        (``Coordinator.note_stuck``): it fails the collectives of ranks that can never
        move again. Threads that ended do not count; a wait with a timeout is not a wait
        here (it never drives). Until the report is due, ``stuck_due`` says when, and a
        caller's wait wakes then (``plan``) to call this again.
        """
        received = self.received
        if not self._stuck(received):
            self.stuck_due = None
            return
        now = time.monotonic()
        if self.stuck_due is None or self._stuck_count != received:
            self.stuck_due, self._stuck_count = now + STUCK_REPORT_DELAY, received
        if now < self.stuck_due:
            return
        self.stuck_due = None
        self.stuck_reported = received
        if self.coordinator is not None:
            self.coordinator.note_stuck(self.rank, received)
        elif 0 in self.links:
            self.links[0].send_frame(messages.STUCK, messages.encode_count(received), self.watch)

    def _stuck(self, received: int) -> bool:
        """Whether every submitting thread waits, with ``received`` responses all executed
        and not yet reported stuck at that count."""
        if received == self.stuck_reported or self.responses:
            return False
        if self.lane is not None and self.lane.pending is not None:
            return False  # the lane may still answer
        waiting = self.waiting
        for ident, thread in tuple(self.submitters.items()):
            if ident not in waiting and thread.is_alive():
                return False
        return True

    # ----- the fast lane -----

    def _propose(self, lane: FastLane, entries: list[Entry]) -> bool:
        """Proposes ``entries`` on the fast lane if it may carry them; returns whether it did."""
        if self.lane_busy(announcing=len(entries)):
            return False
        by_id = (
            self.by_id
            and (self.fuses or len(entries) == 1)
            and not self.responses
            and self.executor.sets.ids() == [0]
            and lane.carries_by_id(entries)
        )
        if not by_id and (len(entries) != 1 or not lane.carries(entries[0])):
            return False
        cache_ids = []
        for entry in entries:
            cache_id = self.executor.cache.lookup(entry.request)
            if cache_id is None:
                return False
            cache_ids.append(cache_id)
        return lane.propose(entries, cache_ids, by_id)

    def settle_lane(self) -> bool | None:
        """Completes this rank's lane proposal once settled, or sends it the coordinator's way.

        A by-id proposal that succeeded runs here, through the executor, before any
        response this rank has yet to run (``FastLane``'s invariants).

        Returns:
            None while it waits; else whether it succeeded.
        """
        lane = self.lane
        if lane is None or lane.pending is None:
            return None
        settled = lane.settle()
        if settled is None:
            return None
        proposal, succeeded = settled
        if not succeeded:
            self.announce(proposal.entries, lane=False)
            return False
        if proposal.count:
            self.executor.run(lane.response(proposal))
        else:
            entry = proposal.entry
            if self.queue.pop(entry.request.process_set_id, entry.request.name) is None:
                return True
            assert entry.output is not None  # invariant: FastLane.carries
            entry.handle.complete(entry.output.reshape(entry.shape))
        if self.tuner is not None and self.tuner.active:
            self.measure([entry.request.name for entry in proposal.entries], proposal.nbytes)
        return True

    def before_response(self) -> None:
        """Keeps data phases in one order on every rank (``FastLane``'s invariants): a
        settled by-id proposal runs before the next response, and a rank with
        collectives in flight refuses a by-id proposal it sees before running one."""
        lane = self.lane
        if lane is None:
            return
        if lane.pending is not None:
            self.settle_lane()
        if self.lane_busy():
            lane.refuse_by_id()

    def settled_on_lane(self, handle: Handle, interrupted: Callable[[], bool], spin_seconds: float) -> bool:
        """The lane's short cut for a caller waiting for its own lane proposal: spins (for
        ``spin_seconds``) on the answers alone and settles it without a full pass. Returns
        False (the caller runs a pass) when anything else needs a pass (``interrupted()``:
        a frame, a wake-up, a new tensor) or the spin runs out.
        """
        lane = self.lane
        pending = lane.pending if lane is not None else None
        if lane is None or pending is None or all(entry.handle is not handle for entry in pending.entries):
            return False
        spin_until = time.perf_counter() + spin_seconds
        while not lane.settled():
            if interrupted() or time.perf_counter() >= spin_until:
                return False
        if self.settle_lane() is False:
            self.run_pass()  # it went the coordinator's way: send it on (on rank 0, match it) now
        return True

    def lane_busy(self, announcing: int = 0) -> bool:
        """True while this rank has collectives on the coordinator's path, besides the lane's
        and ``announcing`` entries being announced now (or rank 0 records a timeline, which
        should show every collective): it then refuses lane proposals, and proposes none."""
        return len(self.queue) > self._on_lane() + announcing or self.timeline is not None

    def lane_runs_data(self) -> bool:
        """True while this rank's lane proposal is by id: settled as a success, it has a
        data phase the other ranks run with this one."""
        lane = self.lane
        return lane is not None and lane.pending is not None and lane.pending.count > 0

    def _on_lane(self) -> int:
        """How many of this rank's queued tensors its lane proposal holds."""
        lane = self.lane
        return 0 if lane is None or lane.pending is None else len(lane.pending.entries)

    # ----- autotune -----

    def measure(self, names: list[str], nbytes: int) -> None:
        """Rank 0: counts a finished collective for the tuner, and sends every rank the
        change that ends a sample, if any, in the global response sequence."""
        assert self.tuner is not None and self.coordinator is not None  # invariant: rank 0 tunes
        change = self.tuner.observe(names, nbytes)
        if change is not None:
            self.coordinator.set_fusion_threshold(change.fusion_threshold)
            self.coordinator.emit_to_all(change.response())
            self.distribute(self.coordinator.take())

    def apply_params(self, response: Response) -> None:
        """Applies a ``PARAMS`` response where the executor reaches it in the sequence.

        Raises:
            ProtocolError: it is malformed (checked on arrival already on workers).
        """
        params = Params.from_response(response)
        self.cycle_time_ms = params.cycle_time_ms
        if params.staging_bytes and self.domain is not None:
            self.domain.use_staging(params.staging_bytes)
        self.applied.append(params)

    # ----- links -----

    def lost(self, link: Link, detail: str) -> str:
        """The reason every rank fails with when ``link``'s peer was lost."""
        role = " (the coordinator)" if link.peer == 0 else ""
        return f"rank {link.peer}{role} on host {link.peer_host} was lost: {detail}"

    def drop(self, link: Link) -> None:
        """Forgets a control link whose peer has left, and closes it."""
        self.links.pop(link.peer, None)
        self.silences.pop(link.peer, None)
        self.watch.links.pop(link.fileno(), None)
        if self.by_fd.pop(link.fileno(), None) is not None:
            self.on_unregister(link.fileno())
        link.close()

    # ----- the timeline (rank 0) -----

    def use_timeline(self, timeline: Timeline | None) -> None:
        if self.timeline is not None:
            self.timeline.close()
        self.timeline = timeline
        if self.coordinator is not None:
            self.coordinator.timeline = timeline
        self.executor.timeline = timeline

    def apply_timeline_request(self) -> None:
        request, self.timeline_request = self.timeline_request, None
        if request is None:
            return
        path, mark_cycles = request
        self.timeline_error = None
        try:
            self.use_timeline(None if path is None else Timeline(path, mark_cycles))
        except OSError as exc:
            self.timeline_error = exc
        self.timeline_applied.set()
