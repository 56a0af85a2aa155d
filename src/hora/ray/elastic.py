"""Elastic jobs on Ray (Horovod's ``ElasticRayExecutor`` semantics), on hora's elastic protocol.

The job runs as a sequence of worlds, exactly as under ``horarun``'s elastic driver
(``hora.transport.worlds`` describes the records; ``hora.core.membership`` is the
worker's side, unchanged): this module plays the driver with Ray actors instead of
processes, and reuses the driver's pieces: ``HostManager`` (current hosts, their
changes, the blacklist and its cooldown) and ``host_assignments``/``pending_slots``
(surviving hosts first).

* Discovery (``RayHostDiscovery``): the alive nodes of the Ray cluster, each with
  ``CPU // cpus_per_worker`` slots (and no more than its GPUs allow with ``use_gpu``),
  a node named by its label (``hora.ray.topology.node_label``). It runs every second.
* Each ``run`` starts a rendezvous server with a fresh secret, waits (up to
  ``elastic_timeout``) for ``min_workers`` slots, publishes world 0 over every slot up
  to ``max_workers`` and starts one actor per slot, pinned to its node.
* A worker that resets (``hvd.elastic.run`` after a peer was lost, or a change of
  hosts at a commit) asks for the next world; an actor whose function raised is
  killed at once (so its peers' collectives fail and they reset), and an actor that
  died is recorded. Once every worker of the world has asked or ended: a worker that
  returned ends the job (its value and those of the others that returned, by rank);
  all failed ends it with ``WorkerError``; otherwise the failed nodes are blacklisted,
  the reset counts against ``reset_limit``, and the next world is published, with new
  actors on its new slots.
* Never a hang: once one worker of a world reset or ended, the rest have
  ``elastic_timeout`` seconds to do the same; the wait for slots is bounded the same
  way; ``run(timeout=...)`` bounds the whole call. Every actor is killed and the server
  stopped before ``run`` returns.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hora.elastic import HostUpdateResult
from hora.ray.outcome import Outcome, WorkerError
from hora.ray.static import WORKER_ENV
from hora.ray.topology import node_label
from hora.ray.worker import BaseHoraWorker, node_ip_address
from hora.runner.elastic.assignment import host_assignments, pending_slots, world_of
from hora.runner.elastic.discovery import DiscoveredHosts, HostManager
from hora.runner.elastic.settings import RESET_LIMIT_EXCEEDED_MESSAGE
from hora.runner.hosts import SlotInfo
from hora.runner.placement import ANY, LOOPBACK
from hora.runner.rendezvous import RendezvousServer
from hora.runner.settings import LaunchSettings, rank_env
from hora.transport import auth, worlds

if TYPE_CHECKING:
    from hora.ray.executor import RayExecutor

DISCOVER_HOSTS_FREQUENCY_S = 1.0
"""Seconds between two looks at the Ray cluster's nodes (Horovod's)."""
_POLL = 0.1  # seconds of one wait for workers' results


def _nothing(executable: Any) -> None:
    """The function of an elastic job before its first ``run``."""


class RayHostDiscovery:
    """The slots of the Ray cluster's alive nodes (Horovod's ``RayHostDiscovery``).

    Args:
        use_gpu: count a node's GPUs too.
        cpus_per_slot: CPUs of one slot.
        gpus_per_slot: GPUs of one slot with ``use_gpu``.
    """

    def __init__(self, use_gpu: bool = False, cpus_per_slot: float = 1, gpus_per_slot: float = 1) -> None:
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot
        self.node_ids: dict[str, str] = {}  # label -> full node id, of every node seen

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """Returns ``{node label: slots}`` for every alive node with at least one slot."""
        found: dict[str, int] = {}
        for node in ray.nodes():  # type: ignore[no-untyped-call]  # untyped in Ray
            if not node.get("Alive"):
                continue
            resources = node.get("Resources", {})
            slots = resources.get("CPU", 0) // self.cpus_per_slot
            if self.use_gpu:
                slots = min(slots, resources.get("GPU", 0) // self.gpus_per_slot)
            if slots >= 1:
                label = node_label(node["NodeID"])
                self.node_ids[label] = node["NodeID"]
                found[label] = int(math.floor(slots))
        return found


class TestDiscovery(RayHostDiscovery):
    """Horovod's ``TestDiscovery``: the Ray cluster's nodes, some hidden, changing over time.

    For trying elastic jobs on a fixed cluster (Horovod's examples/ray/basic_ray_elastic.py):
    every ``change_frequency_s`` seconds it hides one more node (at most down to
    ``min_hosts`` visible) or shows a hidden one again (at most ``max_hosts``), at random
    in between. A hidden node's workers are removed from the job as if it had left.

    Args:
        min_hosts: the fewest nodes shown.
        max_hosts: the most nodes shown.
        change_frequency_s: seconds between two changes.
        use_gpu: as ``RayHostDiscovery``.
        cpus_per_slot: as ``RayHostDiscovery``.
        gpus_per_slot: as ``RayHostDiscovery``.
        verbose: print the nodes found and those shown at every look.
        _graceful: False stops a node for real (Ray's autoscaler ``kill_node``, on a
            cluster started by Ray's cluster launcher) instead of hiding one.
    """

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(
        self,
        min_hosts: int,
        max_hosts: int,
        change_frequency_s: float,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: float = 1,
        verbose: bool = True,
        _graceful: bool = True,
    ) -> None:
        super().__init__(use_gpu=use_gpu, cpus_per_slot=cpus_per_slot, gpus_per_slot=gpus_per_slot)
        self._min_hosts = min_hosts
        self._max_hosts = max_hosts
        self._change_frequency_s = change_frequency_s
        self._graceful = _graceful
        self._last_reset_t: float | None = None
        self.verbose = verbose
        self._removed_hosts: set[str] = set()
        self._random = random.Random()

    def add_host(self, hosts: Mapping[str, int]) -> None:
        """Shows one hidden node of ``hosts`` again, if any."""
        hidden = sorted(self._removed_hosts & hosts.keys())
        if hidden:
            self._removed_hosts.remove(self._random.choice(hidden))
        else:
            print("No hosts to add.")

    def remove_host(self, hosts: Mapping[str, int]) -> None:
        """Hides one shown node of ``hosts`` (or, not graceful, has Ray stop a node)."""
        shown = sorted(host for host in hosts if host not in self._removed_hosts)
        if not shown:
            return
        if self._graceful:
            self._removed_hosts.add(self._random.choice(shown))
            return
        import os

        from ray.autoscaler._private.commands import kill_node

        killed = kill_node(os.path.expanduser("~/ray_bootstrap_config.yaml"), True, False, None)
        if killed is not None:
            self._removed_hosts.add(killed)

    def change_hosts(self, hosts: Mapping[str, int]) -> None:
        """Makes one change: a node shown or hidden, within ``[min_hosts, max_hosts]``."""
        self._removed_hosts &= hosts.keys()  # a node gone from the cluster is not hidden any more
        shown = len(hosts) - len(self._removed_hosts)
        if shown <= self._min_hosts:
            self.add_host(hosts)
        elif shown >= self._max_hosts:
            self.remove_host(hosts)
        elif self._random.random() < 0.5:
            self.add_host(hosts)
        else:
            self.remove_host(hosts)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """The shown nodes' slots, after a change if one is due."""
        now = time.time()
        if self._last_reset_t is None:
            self._last_reset_t = now
        hosts = super().find_available_hosts_and_slots()
        if now - self._last_reset_t >= self._change_frequency_s:
            self.change_hosts(hosts)
            self._last_reset_t = now
        remaining = {host: slots for host, slots in hosts.items() if host not in self._removed_hosts}
        if self.verbose:
            print(f"Total hosts: {len(hosts)}")
            print(f"Remaining hosts: {len(remaining)} -- {remaining}")
        return remaining


@dataclasses.dataclass
class _Member:
    """An actor of the job: its slot, its call, and the last world it belongs to."""

    actor: Any
    ref: Any
    host: str
    local_rank: int
    generation: int
    started: Any  # the ref of its first answer (``node``): resolves once Ray placed and started it
    start_by: float  # monotonic time by which it must have started
    outcome: Outcome | None = None
    removed: bool = False  # killed by the driver: its world no longer holds its slot

    @property
    def slot(self) -> str:
        return worlds.slot_name(self.host, self.local_rank)


class _Stopped(Exception):
    """The job ends now with this error (raised out of ``run``)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class ElasticJob:
    """Runs elastic calls for a ``RayExecutor`` made with ``min_workers``.

    Args:
        executor: the executor (its counts and settings).
        executable: ``(cls, args, kwargs)`` to build in every actor, or None.
        extra_env: variables for every actor.
    """

    def __init__(
        self,
        executor: RayExecutor,
        executable: tuple[type | None, Sequence[Any], Mapping[str, Any]],
        extra_env: Mapping[str, Any] | None,
    ) -> None:
        assert executor.min_workers is not None  # elastic
        self._x = executor
        self._min = executor.min_workers
        self._max = executor.max_workers
        self._executable = executable
        self._extra_env = {name: str(value) for name, value in (extra_env or {}).items()}
        if executor.override_discovery or executor.settings.discovery is None:
            self._discovery: Any = RayHostDiscovery(executor.use_gpu, executor.cpus_per_worker,
                                                    executor.gpus_per_worker or 1)  # fmt: skip
        else:
            self._discovery = executor.settings.discovery
        self._reset_state()

    def _reset_state(self) -> None:
        self._hosts = HostManager(self._discovery, self._x.cooldown_range)
        self._members: list[_Member] = []
        self._assignment: list[SlotInfo] = []
        self._generation = -1
        self._resets = 0
        self._host_updates = 0
        self._server: RendezvousServer | None = None
        self._secret = b""
        self._address = LOOPBACK
        self._last_discovery = 0.0
        self._func: Callable[[Any], Any] = _nothing

    # ----- life cycle -----

    def start(self) -> None:
        """Waits until the cluster offers ``min_workers`` slots (Horovod's start).

        Raises:
            RuntimeError: not within ``elastic_timeout``.
        """
        try:
            self._wait_for_slots(self._min)
        except _Stopped as stop:
            raise stop.error from None
        finally:
            self._reset_state()

    def shutdown(self) -> None:
        """Nothing outlives a ``run``: every actor was killed and the server stopped."""
        self._end()

    def run(self, func: Callable[[Any], Any], name: str, timeout: float | None) -> list[Any]:
        """Runs ``func(executable)`` elastically until a worker returns.

        Args:
            func: the function (it calls ``hvd.elastic.run``-decorated training).
            name: its name, for errors.
            timeout: seconds after which the job is stopped; None: no limit.

        Returns:
            The values of the workers of the last world that returned, by rank.

        Raises:
            WorkerError: every worker of a world failed, or one failed while another
                returned; names the root cause's rank.
            RuntimeError: no slots in time, the reset limit was reached, or every node
                of a world is blacklisted.
            TimeoutError: ``timeout`` passed.
        """
        self._reset_state()
        self._secret = auth.new_secret()
        # Nodes may join later from other machines, so the server listens on every
        # interface (every connection must pass the secret's challenge) and the
        # workers reach it at this node's Ray address.
        self._address = node_ip_address()
        self._server = RendezvousServer(self._secret, host=ANY).start()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._func = func
        try:
            self._activate(self._min)
            return self._watch(name, deadline, timeout)
        except _Stopped as stop:
            cause = stop.error.cause if isinstance(stop.error, WorkerError) else None
            raise stop.error from cause
        finally:
            self._end()

    def _end(self) -> None:
        for member in self._members:
            ray.kill(member.actor)
        self._members = []
        if self._server is not None:
            self._server.stop()
            self._server = None

    # ----- hosts -----

    def _discover(self, force: bool = False) -> None:
        """Looks at the cluster (at most once a second); tells rank 0 if the ranks would change."""
        now = time.monotonic()
        if not force and now - self._last_discovery < DISCOVER_HOSTS_FREQUENCY_S:
            return
        self._last_discovery = now
        result = self._hosts.update_available_hosts()
        if result == HostUpdateResult.no_update or not self._assignment or self._server is None:
            return
        current = self._hosts.current_hosts
        if current.count_available_slots() < self._min:
            return
        try:
            upcoming = host_assignments(current.host_specs(), self._min, self._max, self._assignment)
        except (ValueError, RuntimeError):
            return
        if upcoming != self._assignment:
            self._server.put(worlds.hosts_key(self._host_updates), worlds.encode_host_update(time.time(), int(result)))
            self._host_updates += 1

    def _wait_for_slots(self, needed: int) -> DiscoveredHosts:
        deadline = time.monotonic() + self._x.elastic_timeout
        while True:
            self._discover(force=True)
            current = self._hosts.current_hosts
            if current.count_available_slots() >= needed:
                return current
            if time.monotonic() >= deadline:
                found = ", ".join(str(spec) for spec in current.host_specs()) or "none"
                raise _Stopped(RuntimeError(
                    f"hora.ray: timed out waiting for the minimum number of slots: {needed} needed after "
                    f"{self._x.elastic_timeout} s (elastic_timeout), {current.count_available_slots()} available "
                    f"(nodes: {found}). Check that the Ray cluster has enough resources for {needed} workers of "
                    f"{self._x.cpus_per_worker} CPU(s)"
                ))  # fmt: skip
            time.sleep(DISCOVER_HOSTS_FREQUENCY_S)

    # ----- worlds -----

    def _alive(self) -> list[_Member]:
        return [m for m in self._members if m.outcome is None]

    def _world(self) -> list[_Member]:
        return [m for m in self._members if m.generation == self._generation and not m.removed]

    def _activate(self, needed: int) -> None:
        """Waits for slots, publishes the next world and starts actors on its new slots."""
        current = self._wait_for_slots(needed)
        try:
            assignment = host_assignments(current.host_specs(), self._min, self._max, self._assignment or None)
        except (ValueError, RuntimeError) as exc:
            raise _Stopped(RuntimeError(f"hora.ray: {exc}")) from None
        running = {(m.host, m.local_rank) for m in self._alive() if not m.removed}
        pending = pending_slots(assignment, running)
        self._generation += 1
        generation = self._generation
        world = world_of(generation, assignment, self._host_updates)
        places = world.places
        assert self._server is not None
        self._server.put(worlds.world_key(generation), world.encode())
        self._assignment = assignment
        for member in self._alive():
            if member.slot in places:
                member.generation = generation
            elif not member.removed:
                member.removed = True
                ray.kill(member.actor)
        if self._x.settings.verbose and generation > 0:
            hosts = ", ".join(dict.fromkeys(slot.hostname for slot in assignment))
            print(f"hora.ray: elastic world {generation}: {len(assignment)} ranks on {hosts}", flush=True)
        for slot in pending:
            self._start_worker(slot, generation)

    def _start_worker(self, slot: SlotInfo, generation: int) -> None:
        assert self._server is not None
        launch = LaunchSettings(
            command=("ray",),
            num_proc=slot.size,
            start_timeout=float(self._x.settings.timeout_s),
            network_interfaces=",".join(sorted(self._x.settings.nics)) if self._x.settings.nics else None,
            env={
                "HORA_ELASTIC": "1",
                "HORA_ELASTIC_GENERATION": str(generation),
                "HORA_ELASTIC_TIMEOUT": repr(float(self._x.elastic_timeout)),
            },
        )
        env = {**WORKER_ENV, **self._extra_env}
        env.update(rank_env({}, launch, slot, (self._address, self._server.port), self._secret))
        node_id = getattr(self._discovery, "node_ids", {}).get(slot.hostname)
        options: dict[str, Any] = {"num_cpus": self._x.cpus_per_worker, "num_gpus": self._x.gpus_per_worker}
        if node_id is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        cls: Any = ray.remote(BaseHoraWorker)  # handles are Any: Ray's stubs do not type actor methods
        actor = cls.options(**options).remote(env)
        executable, args, kwargs = self._executable
        if executable is not None:
            actor.start_executable.remote(executable, args, kwargs)  # runs before the call: same caller, in order
        started = actor.node.remote()
        ref = actor.call.remote(self._func, slot.rank)
        start_by = time.monotonic() + float(self._x.settings.placement_group_timeout_s)
        self._members.append(_Member(actor, ref, slot.hostname, slot.local_rank, generation, started, start_by))

    # ----- the watch loop -----

    def _collect(self, timeout: float) -> None:
        """Records the outcomes of the calls that ended within ``timeout`` seconds.

        An actor that Ray has not started by its ``start_by`` (its node went away, or
        its resources are taken) counts as failed: it is killed, so its node is
        blacklisted and the job goes on without it instead of waiting for ever.
        """
        now = time.monotonic()
        for member in self._alive():
            if member.started is None or now < member.start_by:
                continue
            ready, _ = ray.wait([member.started], timeout=0)
            if ready:
                member.started = None
                continue
            ray.kill(member.actor)
            member.outcome = Outcome.gone(-1, "Ray did not start its actor within "
                                              f"{self._x.settings.placement_group_timeout_s:g} s "
                                              "(placement_group_timeout_s)")  # fmt: skip
        running = {m.ref: m for m in self._alive()}
        if not running:
            time.sleep(timeout)
            return
        ready, _ = ray.wait(list(running), num_returns=len(running), timeout=timeout)
        for ref in ready:
            member = running[ref]
            try:
                outcome = ray.get(ref)
            except ray.exceptions.RayActorError as error:
                first_line = (str(error).splitlines() or [repr(error)])[0]
                outcome = Outcome.gone(-1, f"its Ray actor died: {first_line}")
            except ray.exceptions.RayError as error:
                outcome = Outcome(-1, summary=f"{type(error).__name__}: {error}", traceback=str(error))
            member.outcome = outcome
            if not outcome.ok and not outcome.lost:
                ray.kill(member.actor)  # its peers' collectives fail now, and they reset

    def _watch(self, name: str, deadline: float | None, timeout: float | None) -> list[Any]:
        """Runs worlds until the job ends: returns the values, or raises ``_Stopped``."""
        first_news: float | None = None  # when a worker of this world first reset or ended
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                running = ", ".join(m.slot for m in self._alive())
                raise _Stopped(TimeoutError(
                    f"hora.ray: {name} did not finish within {timeout:g} s; workers still running: {running} "
                    "(every worker was stopped)"
                ))  # fmt: skip
            self._discover()
            self._collect(_POLL)
            world = self._world()
            assert self._server is not None
            asked = {m.slot for m in world if m.outcome is None
                     and self._server.get(worlds.ready_key(self._generation + 1, m.slot)) is not None}  # fmt: skip
            settled = [m for m in world if m.outcome is not None or m.slot in asked]
            if not settled:
                first_news = None
                continue
            if len(settled) < len(world):
                first_news = first_news or time.monotonic()
                if time.monotonic() - first_news > self._x.elastic_timeout:
                    late = ", ".join(m.slot for m in world if m not in settled)
                    raise _Stopped(RuntimeError(
                        f"hora.ray: elastic world {self._generation}: {late} neither reset nor ended within "
                        f"{self._x.elastic_timeout} s of the first worker that did"
                    ))  # fmt: skip
                continue
            first_news = None
            values = self._on_world_settled(world, name)
            if values is not None:
                return values

    def _on_world_settled(self, world: list[_Member], name: str) -> list[Any] | None:
        """Every worker of the world reset or ended: the values, or None after starting the next world."""
        ended = [m for m in world if m.outcome is not None]
        failed = [m for m in ended if m.outcome is not None and not m.outcome.ok]
        succeeded = [m for m in ended if m.outcome is not None and m.outcome.ok]
        if succeeded:
            if failed:
                raise _Stopped(self._error(name, failed))
            return [m.outcome.value for m in sorted(succeeded, key=self._rank_of) if m.outcome is not None]
        if len(failed) == len(world):
            raise _Stopped(self._error(name, failed))
        for member in failed:
            self._hosts.blacklist(member.host)
        if all(self._hosts.is_blacklisted(m.host) for m in world):
            raise _Stopped(RuntimeError(f"hora.ray: elastic job failed: every node of world {self._generation} "
                                        "is blacklisted"))  # fmt: skip
        limit = self._x.reset_limit
        if limit is not None and self._resets >= limit:
            raise _Stopped(RuntimeError(RESET_LIMIT_EXCEEDED_MESSAGE.format(limit)))
        self._resets += 1
        self._activate(self._min)
        return None

    def _rank_of(self, member: _Member) -> int:
        for slot in self._assignment:
            if slot.hostname == member.host and slot.local_rank == member.local_rank:
                return slot.rank
        return -1

    def _error(self, name: str, members: Sequence[_Member]) -> WorkerError:
        hosts = [slot.hostname for slot in self._assignment]
        failures = []
        for member in members:
            assert member.outcome is not None
            failures.append(dataclasses.replace(member.outcome, rank=self._rank_of(member)))
        return WorkerError(name, len(self._assignment), failures, hosts)
