"""``hora.spark.run_elastic``: Horovod's elastic training on Spark, on hora's elastic protocol.

The job runs as a sequence of worlds, exactly as under ``horarun``'s elastic driver
(``hora.transport.worlds`` describes the records; ``hora.core.membership`` is the rank's
side, unchanged). This module is the driver, with Spark tasks as hosts, and reuses the
elastic driver's pieces: ``HostManager`` (current hosts, their changes, the blacklist)
and ``host_assignments``/``pending_slots``/``world_of`` (surviving hosts first).

* The driver (this process, which holds the active ``SparkContext``) starts the
  rendezvous and output servers and runs one ordinary stage of ``max_num_proc`` tasks
  in a thread of its own. Not a barrier stage: a task that fails (its executor lost)
  does not take the others with it, and Spark may re-run it.
* Each task is an agent (``hora.spark.agent``): a host of one slot, named
  ``spark-<partition>`` (``spark-<partition>.<attempt>`` for a re-run), that registers
  in the rendezvous store, beats every second, starts and stops ranks when the driver
  says so and reports how they ended. Discovery is the registered agents that still
  beat, in partition order; it runs every second.
* World 0 waits (up to ``start_timeout``) until ``num_proc`` agents registered, takes
  every agent up to ``max_num_proc``, is published, and a rank is started on each of
  its slots. A rank that resets (``hvd.elastic.run`` after a peer was lost, or a change
  of hosts at a commit) asks for the next world; a rank that exits is reported by its
  agent; the rank of an agent that stopped beating (its task was lost: the rank died
  with it, stopped by its guardian) counts as failed. Once every rank of the world has
  asked or ended (Horovod's barrier): a rank that returned ends the job (its value and
  those of the others that returned, by rank); all failed ends it with ``RuntimeError``;
  otherwise the failed agents are blacklisted, the reset counts against
  ``reset_limit`` (Horovod's message when it is reached), the driver waits (up to
  ``elastic_timeout``) for ``min_num_proc`` slots and publishes the next world, with
  ranks started on its new slots.
* Never a hang: once one rank of a world reset or ended, the others have
  ``elastic_timeout`` seconds to do the same; the waits for agents are bounded the same
  way; a Spark stage that ended (every agent gone) ends the wait at once; ``timeout``
  bounds the whole job. When the job ends, however it ends, the driver writes
  ``DONE_KEY``: every agent stops its rank and its task returns; a stage still running
  ``END_TIMEOUT`` seconds later is cancelled.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TextIO

from hora.config import knobs
from hora.elastic import HostUpdateResult
from hora.runner.elastic.assignment import host_assignments, pending_slots, world_of
from hora.runner.elastic.discovery import DiscoveredHosts, HostManager
from hora.runner.elastic.settings import RESET_LIMIT_EXCEEDED_MESSAGE
from hora.runner.hosts import SlotInfo
from hora.runner.output import Sink
from hora.runner.run_func import callable_name
from hora.runner.workers import describe_status
from hora.spark.agent import (
    AGENT_TIMEOUT_S,
    DONE_KEY,
    AgentRecord,
    AgentSpec,
    Command,
    RankExit,
    agent_key,
    agent_main,
    beat_key,
    command_key,
    exit_key,
    result_key,
)
from hora.spark.output import OutputServer
from hora.spark.stage import CANCEL_TIMEOUT, Stage, addresses, is_consequence, resolve_start_timeout, short
from hora.transport import auth, worlds
from hora.transport.rendezvous_server import RendezvousServer

log = logging.getLogger(__name__)

DISCOVER_HOSTS_FREQUENCY_S = 1.0
"""Seconds between two looks at the registered agents (Horovod's discovery period)."""
END_TIMEOUT = 30.0
"""Seconds the agents get to stop their ranks and end after the job is over, before the
stage is cancelled (a task Spark had not scheduled yet ends as soon as it starts)."""
_POLL = 0.05  # seconds between two looks at the ranks' reports
_SLOTS_POLL = 0.2  # seconds between two looks at the agents while waiting for slots


def run_elastic(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    start_timeout: float | None = None,
    elastic_timeout: float | None = None,
    reset_limit: int | None = None,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    verbose: int = 1,
    nics: Iterable[str] | None = None,
    prefix_output_with_timestamp: bool = False,
    min_np: int | None = None,
    max_np: int | None = None,
    *,
    executable: str | None = None,
    timeout: float | None = None,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` elastically on hora ranks hosted by Spark tasks.

    ``fn`` is an elastic training function: it calls ``hvd.init()`` and runs its loop
    under ``hvd.elastic.run`` with an elastic state (``hvd.elastic.ObjectState``,
    ``TorchState``, ...), so that the job goes on from the last commit when a rank is
    lost and grows when Spark adds a task (up to ``max_num_proc``). Each rank is a
    fresh Python process started by its Spark task, with the environment of an elastic
    worker of ``horarun``; its output reaches ``stdout``/``stderr`` on the driver,
    prefixed ``[<rank>]<stdout>:`` / ``[<rank>]<stderr>:`` (the rank it started as).

    Args:
        fn: the function; anything cloudpickle can pickle.
        args: positional arguments for ``fn``.
        kwargs: keyword arguments for ``fn``.
        num_proc: the ranks to start with; default ``spark.default.parallelism``.
        min_num_proc: the fewest ranks the job goes on with; default ``num_proc``.
        max_num_proc: the most ranks, and the number of Spark tasks (agents) the job
            runs; default ``num_proc``.
        start_timeout: seconds for Spark to start ``num_proc`` tasks (and for ranks to
            meet at rendezvous); default ``HORA_SPARK_START_TIMEOUT`` or
            ``HOROVOD_SPARK_START_TIMEOUT``, else 600.
        elastic_timeout: seconds to wait for ``min_num_proc`` slots after a reset, and
            for the ranks of a world to reset once one did; default
            ``HORA_ELASTIC_TIMEOUT`` or ``HOROVOD_ELASTIC_TIMEOUT``, else 600.
        reset_limit: the most resets before the job stops; None: no limit.
        env: variables added to every rank's environment (over its task's).
        stdout: where ranks' stdout lines go; default ``sys.stdout``.
        stderr: where ranks' stderr lines go; default ``sys.stderr``.
        verbose: 0 is quiet; 1 logs the job's counts and each new world; 2 also the agents.
        nics: network interfaces the ranks use for their links (``HORA_IFACE``): names,
            or one comma-separated string.
        prefix_output_with_timestamp: put the local time before each forwarded line.
        min_np: Horovod's deprecated name of ``min_num_proc`` (a ``DeprecationWarning``).
        max_np: Horovod's deprecated name of ``max_num_proc`` (a ``DeprecationWarning``).
        executable: (hora only) the Python that runs each rank on the executors; default
            the Python of the Spark task.
        timeout: (hora only) seconds after which the job is stopped; None: no limit.

    Returns:
        The return values of ``fn`` on the ranks of the last world that returned, by rank.

    Raises:
        RuntimeError: there is no active ``SparkContext``; every rank of a world failed,
            or one failed while another returned (the message names the rank that failed
            first, its agent and host, and its traceback); the reset limit was reached;
            no ``min_num_proc`` slots within ``elastic_timeout``; or the Spark stage
            ended (every agent gone).
        TimeoutError: fewer than ``num_proc`` Spark tasks registered within
            ``start_timeout``, or ``timeout`` passed.
        ValueError: an argument is not valid (counts out of order, a negative limit, ...).
    """
    import cloudpickle
    from pyspark import SparkContext

    context = SparkContext._active_spark_context
    if context is None:
        raise RuntimeError(
            "hora.spark.run_elastic: no active SparkContext: start one first "
            "(e.g. SparkSession.builder.getOrCreate()) and call hora.spark.run_elastic from its driver"
        )
    if min_np is not None:
        warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning, stacklevel=2)
        min_num_proc = min_np
    if max_np is not None:
        warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, stacklevel=2)
        max_num_proc = max_np
    counts = _counts(num_proc, min_num_proc, max_num_proc, context.defaultParallelism)
    wait = resolve_start_timeout(start_timeout, os.environ, "hora.spark.run_elastic")
    patience = _elastic_timeout(elastic_timeout, os.environ)
    if reset_limit is not None and (isinstance(reset_limit, bool) or not isinstance(reset_limit, int)
                                    or reset_limit < 0):  # fmt: skip
        raise ValueError(f"hora.spark.run_elastic: reset_limit={reset_limit!r} is not valid: expected an integer >= 0")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"hora.spark.run_elastic: timeout={timeout!r} is not valid: expected a number of seconds > 0")
    interfaces = None if nics is None else nics if isinstance(nics, str) else ",".join(nics)
    name = callable_name(fn)
    if verbose >= 1:
        log.info("hora.spark.run_elastic: running %s on %d ranks (min %d, max %d), %d Spark tasks",
                 name, counts.num_proc, counts.min_np, counts.max_np, counts.max_np)  # fmt: skip

    bind, advertise = addresses(context)
    secret = auth.new_secret()
    server = RendezvousServer(secret, host=bind).start()
    output: OutputServer | None = None
    try:
        output = OutputServer(secret, bind, Sink(stdout or sys.stdout), Sink(stderr or sys.stderr)).start()
        spec = AgentSpec(
            payload=cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}))),
            sys_path=tuple(entry for entry in sys.path if isinstance(entry, str)),
            rendezvous=(advertise, server.port),
            output=(advertise, output.port),
            secret=secret,
            start_timeout=wait,
            elastic_timeout=patience,
            env=dict(env or {}),
            executable=executable,
            prefix_timestamp=prefix_output_with_timestamp,
            network_interfaces=interfaces,
        )
        stage = Stage(context, "hora.spark.run_elastic", counts.max_np, functools.partial(agent_main, spec), barrier=False)
        job = _ElasticJob(server, stage, counts, wait, patience, reset_limit, name, verbose)
        stage.start()
        try:
            return job.run(timeout)
        finally:
            # However the job ended: every agent stops its rank and its task returns.
            server.put(DONE_KEY, b"1")
            if not stage.join(END_TIMEOUT):
                stage.cancel()
                stage.join(CANCEL_TIMEOUT)
    finally:
        server.stop()
        if output is not None:
            output.stop()


@dataclasses.dataclass(frozen=True)
class Counts:
    """The job's numbers of ranks.

    Attributes:
        num_proc: the ranks to start with.
        min_np: the fewest ranks the job goes on with.
        max_np: the most ranks (and the number of Spark tasks).
    """

    num_proc: int
    min_np: int
    max_np: int


def _counts(num_proc: int | None, min_num_proc: int | None, max_num_proc: int | None, default: int) -> Counts:
    """Horovod's defaults (``num_proc`` from Spark, the others from ``num_proc``), checked.

    Raises:
        ValueError: a count is not an integer >= 1, or ``min <= num <= max`` does not hold.
    """
    num = default if num_proc is None else num_proc
    low = num if min_num_proc is None else min_num_proc
    high = num if max_num_proc is None else max_num_proc
    for label, value in (("num_proc", num), ("min_num_proc", low), ("max_num_proc", high)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"hora.spark.run_elastic: {label}={value!r} is not valid: expected an integer >= 1")
    if not low <= num <= high:
        raise ValueError(
            f"hora.spark.run_elastic: expected min_num_proc <= num_proc <= max_num_proc, got "
            f"min_num_proc={low}, num_proc={num}, max_num_proc={high}"
        )
    return Counts(num, low, high)


def _elastic_timeout(elastic_timeout: float | None, environ: Mapping[str, str]) -> float:
    """The elastic timeout: the argument, else ``HORA_ELASTIC_TIMEOUT`` (or Horovod's
    ``HOROVOD_ELASTIC_TIMEOUT``) from the environment, else 600 s.

    Raises:
        ValueError: the value is not a positive number (naming where it came from).
    """
    if elastic_timeout is None:
        try:
            value = float(knobs.read("HORA_ELASTIC_TIMEOUT", environ))
        except ValueError as exc:
            raise ValueError(f"hora.spark.run_elastic: {exc}") from None
    elif isinstance(elastic_timeout, bool) or not isinstance(elastic_timeout, (int, float)):
        raise ValueError(f"hora.spark.run_elastic: elastic_timeout={elastic_timeout!r} is not valid: "
                         "expected a number of seconds > 0")  # fmt: skip
    else:
        value = float(elastic_timeout)
    if not 0 < value < float("inf"):
        raise ValueError(f"hora.spark.run_elastic: elastic_timeout={value!r} is not valid: "
                         "expected a number of seconds > 0")  # fmt: skip
    return value


@dataclasses.dataclass
class _Agent:
    """An agent (a Spark task's attempt) as the driver sees it."""

    record: AgentRecord
    beat_seen: float  # monotonic time its beat last changed (or it registered)
    beat: bytes | None = None
    commands: int = 0  # commands sent to it
    starts: int = 0  # of which "start": the number of its next rank
    gone: str | None = None  # why the driver takes it as lost

    @property
    def name(self) -> str:
        return self.record.name


@dataclasses.dataclass
class _Member:
    """A rank an agent started: the last world it belongs to, and how it ended."""

    agent: _Agent
    number: int  # its number among the agent's ranks (the agent's reports use it)
    generation: int
    outcome: RankExit | None = None
    removed: bool = False  # stopped by the driver: its world no longer holds its slot

    @property
    def slot(self) -> str:
        return worlds.slot_name(self.agent.name, 0)


class _AgentDiscovery:
    """Discovery for ``HostManager``: the agents that beat, one slot each, in partition order."""

    def __init__(self, agents: Mapping[str, _Agent]) -> None:
        self._agents = agents

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        alive = sorted((a for a in self._agents.values() if a.gone is None),
                       key=lambda a: (a.record.index, a.record.attempt))  # fmt: skip
        return {agent.name: 1 for agent in alive}


class _ElasticJob:
    """The driver's loop of one ``run_elastic`` call (see the module docstring)."""

    def __init__(
        self,
        server: RendezvousServer,
        stage: Stage,
        counts: Counts,
        start_timeout: float,
        elastic_timeout: float,
        reset_limit: int | None,
        name: str,
        verbose: int,
    ) -> None:
        self._server = server
        self._stage = stage
        self._counts = counts
        self._start_timeout = start_timeout
        self._elastic_timeout = elastic_timeout
        self._reset_limit = reset_limit
        self._name = name
        self._verbose = verbose
        self._agents: dict[str, _Agent] = {}
        # Horovod's Spark driver blacklists a failed host for good: no cooldown.
        self._hosts = HostManager(_AgentDiscovery(self._agents), None)
        self._members: list[_Member] = []
        self._assignment: list[SlotInfo] = []
        self._generation = -1
        self._resets = 0
        self._host_updates = 0
        self._last_discovery = 0.0
        self._first_news: float | None = None  # when a rank of the current world first reset or ended

    def run(self, timeout: float | None) -> list[Any]:
        """Runs worlds until the job ends.

        Args:
            timeout: seconds after which the job is stopped; None: no limit.

        Returns:
            The values of the ranks of the last world that returned, by rank.

        Raises:
            RuntimeError, TimeoutError: as ``run_elastic`` says.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._activate(self._counts.num_proc, self._start_timeout, first=True)
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                running = ", ".join(m.slot for m in self._alive()) or "none"
                raise TimeoutError(
                    f"hora.spark.run_elastic: {self._name} did not finish within timeout={timeout:g} s; "
                    f"ranks still running: {running} (every rank was stopped)"
                )
            values = self._step()
            if values is not None:
                return values
            time.sleep(_POLL)

    # ----- agents -----

    def _poll_agents(self) -> None:
        """Reads the agents' registrations and beats; takes the silent ones as lost."""
        now = time.monotonic()
        for index in range(self._counts.max_np):
            data = self._server.get(agent_key(index))
            if data is None:
                continue
            record = AgentRecord.from_json(data)
            if record.name in self._agents:
                continue
            for agent in self._agents.values():
                if agent.record.index == index and agent.gone is None:
                    # Spark re-runs a task only after its attempt failed.
                    agent.gone = f"Spark re-ran its task (attempt {record.attempt})"
            self._agents[record.name] = _Agent(record, now)
            if self._verbose >= 2:
                log.info("hora.spark.run_elastic: agent %s registered (Spark task %d, attempt %d, host %s)",
                         record.name, record.index, record.attempt, record.machine)  # fmt: skip
        stage_over = self._stage.ended()
        for agent in self._agents.values():
            if agent.gone is not None:
                continue
            if stage_over:
                agent.gone = "the Spark stage of the agents ended"
                continue
            beat = self._server.get(beat_key(agent.name))
            if beat != agent.beat:
                agent.beat, agent.beat_seen = beat, now
            elif now - agent.beat_seen > AGENT_TIMEOUT_S:
                agent.gone = f"its Spark task stopped beating for {AGENT_TIMEOUT_S:g} s"

    def _discover(self, force: bool = False) -> None:
        """Looks at the agents (at most once a second); tells rank 0 if the ranks would change."""
        now = time.monotonic()
        if not force and now - self._last_discovery < DISCOVER_HOSTS_FREQUENCY_S:
            return
        self._last_discovery = now
        self._poll_agents()
        result = self._hosts.update_available_hosts()
        if result == HostUpdateResult.no_update or not self._assignment:
            return
        current = self._hosts.current_hosts
        if current.count_available_slots() < self._counts.min_np:
            return
        try:
            upcoming = host_assignments(current.host_specs(), self._counts.min_np, self._counts.max_np,
                                        self._assignment)  # fmt: skip
        except (ValueError, RuntimeError):
            return
        if upcoming != self._assignment:
            self._server.put(worlds.hosts_key(self._host_updates), worlds.encode_host_update(time.time(), int(result)))
            self._host_updates += 1

    def _wait_for_slots(self, needed: int, patience: float, first: bool) -> DiscoveredHosts:
        """Waits up to ``patience`` seconds until ``needed`` agents are available.

        Raises:
            TimeoutError: (the first world) not within ``start_timeout``.
            RuntimeError: (a later world) not within ``elastic_timeout``; or the stage ended.
        """
        deadline = time.monotonic() + patience
        while True:
            self._discover(force=True)
            current = self._hosts.current_hosts
            available = current.count_available_slots()
            if available >= needed:
                return current
            if self._stage.ended():
                error = self._stage.error
                why = f":\n{short(error)}" if error is not None else " (every agent returned)"
                raise RuntimeError(
                    f"hora.spark.run_elastic: the Spark stage of the agents ended while {needed} were needed and "
                    f"{available} available{why}"
                )
            if time.monotonic() >= deadline:
                blacklisted = [a.name for a in self._agents.values() if self._hosts.is_blacklisted(a.name)]
                found = ", ".join(spec.name for spec in current.host_specs()) or "none"
                listed = f"; blacklisted: {', '.join(blacklisted)}" if blacklisted else ""
                if first:
                    raise TimeoutError(
                        f"hora.spark.run_elastic: only {available} of {needed} Spark tasks started and registered "
                        f"within start_timeout={patience:g} s (agents: {found}{listed}). Each rank runs in a Spark "
                        "task: give the cluster more executors or cores, lower num_proc, or raise start_timeout "
                        "(HORA_SPARK_START_TIMEOUT) if executors come on demand"
                    )
                raise RuntimeError(
                    f"hora.spark.run_elastic: timed out waiting for the minimum number of slots: {needed} needed "
                    f"after {patience:g} s (elastic_timeout), {available} available (agents: {found}{listed})"
                )
            time.sleep(_SLOTS_POLL)

    # ----- worlds -----

    def _alive(self) -> list[_Member]:
        return [m for m in self._members if m.outcome is None]

    def _world(self) -> list[_Member]:
        return [m for m in self._members if m.generation == self._generation and not m.removed]

    def _activate(self, needed: int, patience: float, first: bool = False) -> None:
        """Waits for slots, publishes the next world and starts ranks on its new slots."""
        current = self._wait_for_slots(needed, patience, first)
        try:
            assignment = host_assignments(current.host_specs(), self._counts.min_np, self._counts.max_np,
                                          self._assignment or None)  # fmt: skip
        except (ValueError, RuntimeError) as exc:
            raise RuntimeError(f"hora.spark.run_elastic: {exc}") from None
        running = {(m.agent.name, 0) for m in self._alive() if not m.removed}
        pending = pending_slots(assignment, running)
        self._generation += 1
        generation = self._generation
        world = world_of(generation, assignment, self._host_updates)
        self._server.put(worlds.world_key(generation), world.encode())
        self._assignment = assignment
        for member in self._alive():
            if member.slot in world.places:
                member.generation = generation
            elif not member.removed:
                member.removed = True
                self._command(member.agent, Command("stop"))
        if self._verbose >= 1 and generation > 0:
            log.info("hora.spark.run_elastic: elastic world %d: %d ranks on %s", generation, len(assignment),
                     ", ".join(slot.hostname for slot in assignment))  # fmt: skip
        for slot in pending:
            agent = self._agents[slot.hostname]
            place = (slot.rank, slot.size, slot.local_rank, slot.local_size, slot.cross_rank, slot.cross_size)
            self._members.append(_Member(agent, agent.starts, generation))
            agent.starts += 1
            self._command(agent, Command("start", generation, place))

    def _command(self, agent: _Agent, command: Command) -> None:
        self._server.put(command_key(agent.name, agent.commands), command.to_json())
        agent.commands += 1

    def _collect(self) -> None:
        """Records how the ranks that ended did (a lost agent's rank counts as failed)."""
        for member in self._alive():
            data = self._server.get(exit_key(member.agent.name, member.number))
            if data is not None:
                member.outcome = RankExit.from_json(data)
            elif member.agent.gone is not None:
                why = f"its agent {member.agent.name} was lost: {member.agent.gone}"
                member.outcome = RankExit(1, why, time.time(), 0, member.agent.record.machine, lost=True)

    def _step(self) -> list[Any] | None:
        """One look at the world: the values once the job ended well, else None.

        Raises:
            RuntimeError: the job failed, or a world's ranks did not all reset or end
                within ``elastic_timeout`` of the first that did.
        """
        self._discover()
        self._collect()
        world = self._world()
        ready = {m.slot for m in world if m.outcome is None
                 and self._server.get(worlds.ready_key(self._generation + 1, m.slot)) is not None}  # fmt: skip
        settled = [m for m in world if m.outcome is not None or m.slot in ready]
        if not settled:
            self._first_news = None
            return None
        if len(settled) < len(world):
            now = time.monotonic()
            if self._first_news is None:
                self._first_news = now
            if now - self._first_news > self._elastic_timeout:
                late = ", ".join(m.slot for m in world if m not in settled)
                raise RuntimeError(
                    f"hora.spark.run_elastic: elastic world {self._generation}: {late} neither reset nor ended "
                    f"within {self._elastic_timeout:g} s (elastic_timeout) of the first rank that did"
                )
            return None
        self._first_news = None
        return self._on_world_settled(world)

    def _on_world_settled(self, world: list[_Member]) -> list[Any] | None:
        """Every rank of the world reset or ended: the values, or None after starting the next world."""
        ended = [m for m in world if m.outcome is not None]
        failed = [m for m in ended if m.outcome is not None and not m.outcome.ok]
        succeeded = [m for m in ended if m.outcome is not None and m.outcome.ok]
        if succeeded:
            if failed:
                raise RuntimeError(self._failure_report(world, failed))
            return [self._result(m) for m in sorted(succeeded, key=self._rank_of)]
        if len(failed) == len(world):
            raise RuntimeError(self._failure_report(world, failed))
        for member in failed:
            assert member.outcome is not None
            self._hosts.blacklist(member.agent.name)
            last = [line for line in (member.outcome.error or "").splitlines() if line.strip()]
            log.warning("hora.spark.run_elastic: rank %d (%s) failed (%s%s): agent %s blacklisted",
                        self._rank_of(member), member.slot, describe_status(member.outcome.returncode),
                        f": {last[-1].strip()}" if last else "", member.agent.name)  # fmt: skip
        if all(self._hosts.is_blacklisted(m.agent.name) for m in world):
            raise RuntimeError(f"hora.spark.run_elastic: every agent of world {self._generation} is blacklisted")
        if self._reset_limit is not None and self._resets >= self._reset_limit:
            raise RuntimeError(RESET_LIMIT_EXCEEDED_MESSAGE.format(self._reset_limit))
        self._resets += 1
        self._activate(self._counts.min_np, self._elastic_timeout)
        return None

    def _rank_of(self, member: _Member) -> int:
        for slot in self._assignment:
            if slot.hostname == member.agent.name:
                return slot.rank
        return -1

    def _result(self, member: _Member) -> Any:
        import cloudpickle

        assert member.outcome is not None
        parts = []
        for part in range(member.outcome.parts):
            data = self._server.get(result_key(member.agent.name, member.number, part))
            if data is None:  # the agent puts every piece before its exit record
                raise RuntimeError(f"hora.spark.run_elastic: piece {part} of the result of {member.slot} is missing")
            parts.append(data)
        return cloudpickle.loads(b"".join(parts))

    def _failure_report(self, world: list[_Member], failures: list[_Member]) -> str:
        """Names the root cause first, with its error, then how every other rank of the world ended."""

        causes = [m for m in failures if not (m.outcome is not None and is_consequence(m.outcome.error))] or failures
        first = min(causes, key=lambda m: (m.outcome.exit_time if m.outcome else 0.0, self._rank_of(m)))
        assert first.outcome is not None
        record = first.agent.record
        lines = [
            f"hora.spark.run_elastic: {self._name} failed in elastic world {self._generation} "
            f"({len(world)} ranks): rank {self._rank_of(first)} ({first.slot}: Spark task {record.index} on host "
            f"{record.machine}) failed first, {describe_status(first.outcome.returncode)}:",
            *(f"  {line}" for line in (first.outcome.error or "").splitlines()),
            "how the other ranks of the world ended:",
        ]
        for member in sorted(world, key=self._rank_of):
            if member is first:
                continue
            outcome = member.outcome
            if outcome is None:
                ending = "waiting for the next world"
            elif outcome.ok:
                ending = "finished"
            else:
                last = [line for line in (outcome.error or "").splitlines() if line.strip()]
                ending = describe_status(outcome.returncode) + (f": {last[-1].strip()}" if last else "")
            lines.append(f"  rank {self._rank_of(member)} ({member.slot}): {ending}")
        return "\n".join(lines)
