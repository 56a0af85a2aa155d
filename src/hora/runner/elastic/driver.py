"""horarun's elastic driver: runs a job whose workers come and go (Horovod's ``ElasticDriver``).

The driver runs the rendezvous server and a sequence of worlds (``hora.transport.worlds``
describes the records). ``run``:

1. waits (up to ``--elastic-timeout``) until discovery finds ``-np`` slots, assigns
   ranks to every slot up to ``--max-np``, publishes world 0 and starts one worker per
   slot (``HORA_ELASTIC_GENERATION=0``);
2. a discovery thread runs the script every second; when the hosts change so that the
   next assignment would differ, the driver publishes a change of hosts, which rank 0
   reads at its next ``commit()`` and every rank raises ``HostsUpdatedInterrupt``;
3. the loop watches the workers of the current world ``g``. A worker that resets asks
   for world ``g + 1``; one that exits is recorded. Once every worker of world ``g``
   has asked or exited (Horovod's registry barrier):

   * a worker that exited 0 ends the job (training is over): the others are stopped;
   * every worker failed: the job fails;
   * otherwise the hosts of failed workers are blacklisted (for a cooldown with
     ``--blacklist-cooldown-range``), the reset is counted against ``--reset-limit``,
     the driver waits for ``--min-np`` slots, publishes world ``g + 1`` (surviving hosts
     first) and starts workers on its new slots; a waiting worker whose slot it does
     not hold is stopped (removed from the job).

Never a hang: once one worker of a world has reset or exited, the rest have
``--elastic-timeout`` seconds to do the same, else the job stops naming them; the wait
for slots is bounded the same way; a worker waits for its next world at most that long
plus the start timeout. Every worker is stopped (SIGTERM, SIGKILL after the grace
period) and reaped before ``run`` returns, and the lifeline stops this machine's
workers if horarun itself dies.

Invariant: only the thread that calls ``run`` starts, signals or records workers and
publishes worlds; the discovery thread only updates the host manager (under ``_lock``)
and posts events.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

from hora.elastic import HostUpdateResult
from hora.runner import hosts as hostnames
from hora.runner.elastic.assignment import host_assignments, pending_slots, world_of
from hora.runner.elastic.discovery import DiscoveredHosts, FixedHosts, HostManager, make_discovery
from hora.runner.elastic.settings import RESET_LIMIT_EXCEEDED_MESSAGE, ElasticSettings
from hora.runner.hosts import SlotInfo
from hora.runner.job import GRACE_PERIOD
from hora.runner.lifeline import Lifeline
from hora.runner.output import Sink
from hora.runner.placement import ANY, LOOPBACK, HostsError, plan_placement
from hora.runner.settings import LaunchSettings
from hora.runner.ssh import HostInfo, SshSettings, probe_hosts
from hora.runner.workers import Event, Worker, describe_status, launch, signal_name, stop_workers
from hora.transport import auth, worlds
from hora.transport.rendezvous_server import RendezvousServer

DISCOVER_HOSTS_FREQUENCY_S = 1.0
"""Seconds between two runs of the discovery script (Horovod's)."""
_POLL = 0.05  # seconds between two looks at the workers' ready marks
_OUTPUT_TIMEOUT = 2.0

_LOG = logging.getLogger(__name__)


class JobStopped(Exception):
    """The job ends now; ``reason`` says why in one line, ``exit_code`` is horarun's."""

    def __init__(self, reason: str, exit_code: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code


@dataclasses.dataclass
class _Member:
    """A worker process of the job: its slot, and the last world it belongs to."""

    worker: Worker
    host: str
    local_rank: int
    generation: int
    removed: bool = False  # stopped by the driver: its world no longer holds its slot

    @property
    def slot(self) -> str:
        return worlds.slot_name(self.host, self.local_rank)


@dataclasses.dataclass(frozen=True)
class ElasticResult:
    """How an elastic job ended.

    Attributes:
        exit_code: horarun's exit code (0: a worker finished and none failed).
        reason: one line saying how it ended.
        generations: the worlds published (1 + resets).
        sizes: each world's number of ranks, in order.
    """

    exit_code: int
    reason: str
    generations: int
    sizes: tuple[int, ...]


class ElasticDriver:
    """Runs one elastic job; ``run`` it once.

    Args:
        settings: the launch settings (command, output, knobs, ssh).
        elastic: the elastic flags, validated.
        stdout: where workers' prefixed stdout lines go.
        stderr: where workers' prefixed stderr lines and the driver's notes go.
        base_env: the environment workers inherit.
        grace: seconds between SIGTERM and SIGKILL when stopping workers.
        is_local: tells whether a host name names this machine.
        probe: probes remote hosts over ssh (injectable for tests).
    """

    def __init__(
        self,
        settings: LaunchSettings,
        elastic: ElasticSettings,
        stdout: Sink,
        stderr: Sink,
        base_env: Mapping[str, str],
        grace: float = GRACE_PERIOD,
        is_local: Callable[[str], bool] = hostnames.is_local_host,
        probe: Callable[[Sequence[str], SshSettings], Mapping[str, HostInfo | str]] = probe_hosts,
    ) -> None:
        assert elastic.num_proc is not None and elastic.min_np is not None  # validated
        self._settings = settings
        self._elastic = elastic
        self._num_proc = elastic.num_proc
        self._min_np = elastic.min_np
        self._stdout = stdout
        self._stderr = stderr
        self._base_env = base_env
        self._grace = grace
        self._is_local = is_local
        self._probe = probe
        self._ssh = SshSettings.from_env(settings.ssh_port, settings.ssh_identity_file, base_env)
        self._discovery = make_discovery(elastic)
        self._hosts = HostManager(self._discovery, elastic.blacklist_cooldown_range)
        self._lock = threading.Lock()  # guards self._hosts
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._shutdown = threading.Event()
        self._discovery_error: str | None = None
        self._members: dict[int, _Member] = {}
        self._assignment: list[SlotInfo] = []
        self._generation = -1
        self._sizes: list[int] = []
        self._resets = 0
        self._host_updates = 0
        self._reach: dict[str, str] = {}  # host -> the address its workers reach the server at
        self._remote: set[str] = set()
        self._server: RendezvousServer | None = None
        self._secret = b""
        self._lifeline: Lifeline | None = None

    # ----- the job -----

    def run(self, handle_signals: bool = False) -> ElasticResult:
        """Runs the job to its end; every worker is stopped and reaped before it returns.

        Args:
            handle_signals: catch SIGINT, SIGTERM and SIGHUP to stop the job (main
                thread only).

        Returns:
            How the job ended.
        """
        self._secret = auth.new_secret()
        # Fixed hosts that are all this machine keep the server on loopback; a discovery
        # script may name other hosts later.
        local_only = isinstance(self._discovery, FixedHosts) and all(
            self._is_local(host) for host in self._discovery.find_available_hosts_and_slots()
        )
        self._server = RendezvousServer(self._secret, host=LOOPBACK if local_only else ANY).start()
        previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        in_main = threading.current_thread() is threading.main_thread()
        if handle_signals and in_main:
            for signum in previous:
                signal.signal(signum, lambda number, frame: self._events.put(("signal", number)))
        discovery = threading.Thread(target=self._discover, name="hora-elastic-discovery", daemon=True)
        try:
            self._lifeline = self._start_lifeline()
            discovery.start()
            try:
                self._activate(self._num_proc)
                self._watch()
            except JobStopped as stop:
                outcome = stop
        finally:
            self._shutdown.set()
            self._stop_all()
            self._server.stop()
            for member in self._members.values():
                member.worker.kill_leftovers()
            if self._lifeline is not None:
                self._lifeline.close()
            if handle_signals and in_main:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
        deadline = time.monotonic() + _OUTPUT_TIMEOUT
        for member in self._members.values():
            member.worker.join_output(max(0.0, deadline - time.monotonic()))
        if discovery.is_alive():
            discovery.join(timeout=1.0)
        self._stderr.line(f"horarun: {outcome.reason}")
        return ElasticResult(outcome.exit_code, outcome.reason, self._generation + 1, tuple(self._sizes))

    def _start_lifeline(self) -> Lifeline | None:
        try:
            return Lifeline.start(self._grace)
        except OSError as exc:
            self._stderr.line(
                f"horarun: warning: cannot start the lifeline that stops this machine's workers if horarun is killed "
                f"({exc.strerror or exc})"
            )
            return None

    # ----- discovery -----

    def _discover(self) -> None:
        """The discovery thread: updates the hosts every second, posts their changes."""
        first = True
        while not self._shutdown.is_set():
            try:
                with self._lock:
                    result = self._hosts.update_available_hosts()
                if result != HostUpdateResult.no_update:
                    self._events.put(("hosts", int(result)))
            except Exception as exc:  # noqa: BLE001 - a failing script must not end the thread silently
                if first:
                    self._discovery_error = str(exc)
                    self._events.put(("hosts", -1))
                    return
                _LOG.warning("host discovery failed (will retry): %s", exc)
            first = False
            self._shutdown.wait(DISCOVER_HOSTS_FREQUENCY_S)

    def _on_hosts_changed(self, result: int) -> None:
        """Tells the workers when the change of hosts would change the assignment."""
        if result < 0:
            raise JobStopped(f"host discovery failed: {self._discovery_error}", 1)
        with self._lock:
            current = self._hosts.current_hosts
        if not self._assignment or current.count_available_slots() < self._min_np:
            return
        try:
            upcoming = host_assignments(current.host_specs(), self._min_np, self._elastic.max_num_proc, self._assignment)
        except (ValueError, RuntimeError):
            return
        if upcoming == self._assignment:
            return
        assert self._server is not None
        self._server.put(worlds.hosts_key(self._host_updates), worlds.encode_host_update(time.time(), result))
        self._host_updates += 1
        if self._settings.verbose:
            self._stderr.line(f"horarun: hosts changed ({HostUpdateResult(result).name}): workers reset at their next commit")

    # ----- worlds -----

    def _activate(self, min_slots: int) -> None:
        """Waits for slots, publishes the next world and starts its new workers."""
        current = self._wait_for_slots(min_slots)
        try:
            assignment = host_assignments(
                current.host_specs(), self._min_np, self._elastic.max_num_proc, self._assignment or None
            )
        except (ValueError, RuntimeError) as exc:
            raise JobStopped(str(exc), 1) from None
        running = {(member.host, member.local_rank) for member in self._alive() if not member.removed}
        pending = pending_slots(assignment, running)
        self._place([slot for slot in pending if slot.hostname not in self._reach])
        self._generation += 1
        generation = self._generation
        world = world_of(generation, assignment, self._host_updates)
        places = world.places
        assert self._server is not None
        self._server.put(worlds.world_key(generation), world.encode())
        self._assignment = assignment
        self._sizes.append(len(assignment))
        for member in self._alive():
            if member.slot in places:
                member.generation = generation
            elif not member.removed:
                member.removed = True
                member.worker.signal_group(signal.SIGTERM)
        if self._settings.verbose or generation > 0:
            hosts = ", ".join(dict.fromkeys(slot.hostname for slot in assignment))
            self._stderr.line(f"horarun: elastic world {generation}: {len(assignment)} ranks on {hosts}")
        for slot in pending:
            self._start_worker(slot, generation)

    def _wait_for_slots(self, needed: int) -> DiscoveredHosts:
        """Waits up to ``--elastic-timeout`` until the hosts have ``needed`` slots.

        Raises:
            JobStopped: the time passed, a signal came, or discovery failed.
        """
        deadline = time.monotonic() + self._elastic.elastic_timeout
        while True:
            with self._lock:
                current = self._hosts.current_hosts
            if current.count_available_slots() >= needed:
                return current
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                with self._lock:
                    blacklisted = [host for host in current.host_slots if self._hosts.is_blacklisted(host)]
                found = ", ".join(str(spec) for spec in current.host_specs()) or "none"
                raise JobStopped(
                    f"Timed out waiting for minimum number of slots to become available: {needed} needed after "
                    f"{self._elastic.elastic_timeout} s (--elastic-timeout), "
                    f"{current.count_available_slots()} available (hosts: {found}"
                    + (f"; blacklisted: {', '.join(blacklisted)}" if blacklisted else "")
                    + f"). Please check that you have enough resources to run at least {needed} hora processes.",
                    1,
                )
            self._next_event(min(remaining, 0.5))

    def _place(self, slots: Sequence[SlotInfo]) -> None:
        """Works out how new hosts are reached (probing remote ones over ssh)."""
        if not slots:
            return
        try:
            placement = plan_placement(slots, self._ssh, self._is_local, self._probe)
        except HostsError as exc:
            raise JobStopped("; ".join(exc.lines), 1) from None
        self._remote.update(placement.remote_hosts)
        for host in dict.fromkeys(slot.hostname for slot in slots):
            self._reach[host] = placement.rendezvous_addr[host]

    def _start_worker(self, slot: SlotInfo, generation: int) -> None:
        assert self._server is not None
        env_extra = {
            "HORA_ELASTIC": "1",
            "HORA_ELASTIC_GENERATION": str(generation),
            "HORA_ELASTIC_TIMEOUT": repr(float(self._elastic.elastic_timeout)),
        }
        settings = dataclasses.replace(self._settings, env={**(self._settings.env or {}), **env_extra})
        rendezvous = (self._reach[slot.hostname], self._server.port)
        ssh = self._ssh if slot.hostname in self._remote else None
        number = len(self._members)
        try:
            worker = launch(
                slot, settings, self._base_env, rendezvous, self._secret, ssh, self._events, self._stdout,
                self._stderr, self._grace, self._lifeline, event_id=number,
            )  # fmt: skip
        except OSError as exc:
            raise JobStopped(f"cannot start a worker on {slot.hostname}: {exc.strerror or exc}", 127) from None
        self._members[number] = _Member(worker, slot.hostname, slot.local_rank, generation)

    # ----- the watch loop -----

    def _alive(self) -> list[_Member]:
        return [member for member in self._members.values() if member.worker.running]

    def _world(self) -> list[_Member]:
        """The workers of the current world (running or exited), not removed."""
        return [m for m in self._members.values() if m.generation == self._generation and not m.removed]

    def _next_event(self, timeout: float) -> None:
        """Handles the next event, if one comes within ``timeout`` seconds."""
        try:
            kind, value = self._events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return
        if kind == "signal":
            raise JobStopped(f"received {signal_name(value)}: stopped every worker", 128 + value)
        if kind == "hosts":
            self._on_hosts_changed(value)

    def _watch(self) -> NoReturn:
        """Runs worlds until the job ends, which ``JobStopped`` says."""
        first_news: float | None = None  # when a worker of this world first reset or exited
        while True:
            self._next_event(_POLL)
            world = self._world()
            assert self._server is not None
            asked = {m.slot for m in world if m.worker.running and self._server.get(worlds.ready_key(self._generation + 1, m.slot)) is not None}  # fmt: skip
            settled = [m for m in world if not m.worker.running or m.slot in asked]
            if not settled:
                first_news = None
                continue
            if len(settled) < len(world):
                first_news = first_news or time.monotonic()
                if time.monotonic() - first_news > self._elastic.elastic_timeout:
                    late = ", ".join(m.slot for m in world if m not in settled)
                    raise JobStopped(
                        f"elastic world {self._generation}: {late} neither reset nor exited within "
                        f"{self._elastic.elastic_timeout} s of the first worker that did",
                        1,
                    )
                continue
            first_news = None
            self._on_world_settled(world)

    def _on_world_settled(self, world: list[_Member]) -> None:
        """Every worker of the world reset or exited: end the job or start the next world."""
        exited = [m for m in world if not m.worker.running]
        failed = [m for m in exited if m.worker.returncode != 0]
        if any(m.worker.returncode == 0 for m in exited):
            if failed:
                first = min(failed, key=lambda m: m.worker.exit_time or 0.0)
                code = first.worker.returncode or 1
                raise JobStopped(
                    f"elastic job ended: {first.slot} failed ({describe_status(code)}) in world {self._generation}",
                    code if code > 0 else 128 - code,
                )
            raise JobStopped(f"elastic job finished: {len(exited)} worker(s) of world {self._generation} succeeded", 0)
        if len(failed) == len(world):
            first = min(failed, key=lambda m: m.worker.exit_time or 0.0)
            code = first.worker.returncode or 1
            raise JobStopped(
                f"elastic job failed: every worker of world {self._generation} failed; the first: {first.slot} "
                f"({describe_status(code)})",
                code if code > 0 else 128 - code,
            )
        with self._lock:
            for member in failed:
                self._hosts.blacklist(member.host)
            blacklisted = all(self._hosts.is_blacklisted(m.host) for m in world)
        for member in failed:
            self._stderr.line(
                f"horarun: {member.slot} failed ({describe_status(member.worker.returncode or 1)}): host "
                f"{member.host} blacklisted"
            )
        if blacklisted:
            raise JobStopped(f"elastic job failed: every host of world {self._generation} is blacklisted", 1)
        limit = self._elastic.reset_limit
        if limit is not None and self._resets >= limit:
            raise JobStopped(RESET_LIMIT_EXCEEDED_MESSAGE.format(limit), 1)
        self._resets += 1
        self._activate(self._min_np)

    # ----- the end -----

    def _stop_all(self) -> None:
        """SIGTERM to every worker's group, SIGKILL after the grace period; reap all."""
        if self._alive():
            workers = [member.worker for member in self._members.values()]
            stop_workers(workers, self._events, self._grace, "worker", self._stderr)
