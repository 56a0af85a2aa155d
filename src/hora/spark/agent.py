"""What each Spark task of ``hora.spark.run_elastic`` does: serve as an agent that runs ranks on command.

``run_elastic`` runs one ordinary (not barrier) stage of ``max_num_proc`` tasks
(``hora.spark.elastic``). Each task is an *agent*, a host of one slot to the elastic
driver, named ``spark-<partition>`` (``spark-<partition>.<attempt>`` when Spark re-runs
the task after a failure: a new host, so that the failed attempt's blacklisting does not
keep the new one out). Through the job's rendezvous store (keys under ``spark/elastic/``)
the agent:

1. registers (``agent_key``: its partition, attempt, name and machine) unless the job is
   already over (``DONE_KEY``), which a task Spark schedules late finds at once;
2. beats every ``HEARTBEAT_S`` seconds (``beat_key``): the driver takes an agent whose
   beat stops for ``AGENT_TIMEOUT_S`` seconds as lost (its executor died);
3. follows the driver's commands, numbered from 0 (``command_key``): ``start`` a rank for
   world ``g`` in a given place (a child process ``python -m hora.runner.task DIR``
   with the environment of an elastic worker: ``HORA_ELASTIC=1``,
   ``HORA_ELASTIC_GENERATION=g``, ``HORA_ELASTIC_TIMEOUT``, and ``rank_env``'s), or
   ``stop`` it (its slot left the job). The rank then follows the worlds by itself
   (``hora.core.membership``);
4. reports how each rank it started ended (``exit_key``, a ``RankExit``), its return
   value first, cloudpickled, in pieces of at most ``RESULT_PART`` bytes
   (``result_key``), so a result of any size fits the store's values;
5. ends when the driver says the job is over (``DONE_KEY``) or cannot be reached any more
   (it stopped or died): the rank it runs is stopped (SIGTERM, SIGKILL after ``GRACE``).

A rank is a child process in a session of its own, handed to a guardian
(``hora.runner.lifeline``) that stops it if the task's Python worker dies, as in
``hora.spark.task``; its output goes to the driver's output server.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

from hora.runner import task as rank_task
from hora.runner.hosts import SlotInfo
from hora.runner.lifeline import Lifeline
from hora.runner.output import Sink
from hora.runner.settings import LaunchSettings, rank_env
from hora.runner.workers import Event, Worker
from hora.spark.output import STDERR, STDOUT, OutputClient
from hora.spark.task import DIRECTORY_PREFIX, GRACE, OWNER, error_text, sweep_stale_directories
from hora.transport.rendezvous import RendezvousClient, RendezvousTimeout

HEARTBEAT_S = 1.0
"""Seconds between two beats of an agent."""
AGENT_TIMEOUT_S = 15.0
"""Seconds without a beat after which the driver takes an agent as lost (generous: a busy
executor's Python worker may be slow for a few seconds)."""
RESULT_PART = 1 << 19
"""The largest piece of a rank's result in one value of the store (half its ``MAX_VALUE``)."""
DONE_KEY = "spark/elastic/done"
"""Written by the driver when the job is over: every agent stops its rank and ends."""
_POLL = 0.1  # seconds one look for the next command may wait
_CONNECT_TIMEOUT = 30.0  # seconds an agent keeps trying to reach the driver's servers
_OUTPUT_JOIN = 5.0  # seconds to wait for a rank's output to be drained after it exited


def agent_name(index: int, attempt: int) -> str:
    """The host name of the agent of Spark task ``index`` in its attempt ``attempt``."""
    return f"spark-{index}" if attempt == 0 else f"spark-{index}.{attempt}"


def agent_key(index: int) -> str:
    """The key the latest attempt of task ``index`` registers under (an ``AgentRecord``)."""
    return f"spark/elastic/agent/{index}"


def beat_key(name: str) -> str:
    """The key agent ``name`` beats on (a counter that changes every ``HEARTBEAT_S``)."""
    return f"spark/elastic/beat/{name}"


def command_key(name: str, number: int) -> str:
    """The key of the driver's ``number``-th command to agent ``name`` (a ``Command``)."""
    return f"spark/elastic/command/{name}/{number}"


def exit_key(name: str, number: int) -> str:
    """The key agent ``name`` reports under how the rank of its ``number``-th command ended."""
    return f"spark/elastic/exit/{name}/{number}"


def result_key(name: str, number: int, part: int) -> str:
    """The key of piece ``part`` of the result of the rank of command ``number`` of agent ``name``."""
    return f"spark/elastic/result/{name}/{number}/{part}"


@dataclasses.dataclass(frozen=True)
class AgentSpec:
    """Everything an agent needs, shipped from the driver inside the stage's closure.

    Attributes:
        payload: the cloudpickled ``(fn, args, kwargs)``.
        sys_path: the driver's ``sys.path`` (see ``hora.spark.task.TaskSpec``).
        rendezvous: the address and port of the driver's rendezvous server.
        output: the address and port of the driver's ``OutputServer``.
        secret: the job secret.
        start_timeout: seconds ranks wait for each other at rendezvous.
        elastic_timeout: seconds a rank waits for its next world (``HORA_ELASTIC_TIMEOUT``).
        env: variables added to every rank's environment.
        executable: the Python that runs the ranks; None is the task's own.
        prefix_timestamp: put the local time before forwarded lines.
        network_interfaces: ``nics`` as a comma-separated list, or None.
    """

    payload: bytes
    sys_path: tuple[str, ...]
    rendezvous: tuple[str, int]
    output: tuple[str, int]
    secret: bytes
    start_timeout: float
    elastic_timeout: float
    env: Mapping[str, str]
    executable: str | None = None
    prefix_timestamp: bool = False
    network_interfaces: str | None = None


@dataclasses.dataclass(frozen=True)
class AgentRecord:
    """An agent's registration.

    Attributes:
        index: its Spark partition.
        attempt: its Spark attempt number.
        name: its host name in the job (``agent_name``).
        machine: the host its executor runs on.
    """

    index: int
    attempt: int
    name: str
    machine: str

    def to_json(self) -> bytes:
        """Returns the record as UTF-8 JSON."""
        return json.dumps(dataclasses.asdict(self)).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> AgentRecord:
        """Reads a record written by ``to_json``."""
        return cls(**json.loads(data.decode("utf-8")))


@dataclasses.dataclass(frozen=True)
class Command:
    """A driver's command to an agent.

    Attributes:
        op: ``"start"`` (a rank in ``place`` of world ``generation``) or ``"stop"`` (the
            rank it runs).
        generation: the world the rank is started for.
        place: (rank, size, local_rank, local_size, cross_rank, cross_size) in that world.
    """

    op: str
    generation: int = -1
    place: tuple[int, int, int, int, int, int] = (0, 1, 0, 1, 0, 1)

    def to_json(self) -> bytes:
        """Returns the command as UTF-8 JSON."""
        return json.dumps(dataclasses.asdict(self)).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> Command:
        """Reads a command written by ``to_json``."""
        fields = json.loads(data.decode("utf-8"))
        rank, size, local_rank, local_size, cross_rank, cross_size = (int(value) for value in fields["place"])
        place = (rank, size, local_rank, local_size, cross_rank, cross_size)
        return cls(str(fields["op"]), int(fields["generation"]), place)


@dataclasses.dataclass(frozen=True)
class RankExit:
    """How a rank an agent started ended.

    Attributes:
        returncode: its exit status (minus the signal number if a signal ended it).
        error: its function's traceback, or the last it wrote to stderr, or why it did not
            start, or why the driver counts it as lost; None on success.
        exit_time: ``time.time()`` on the agent's host when it exited.
        parts: the number of pieces of its result in the store (0 unless it succeeded).
        machine: the host it ran on.
        lost: the driver's own record for a rank whose agent was lost (never reported).
    """

    returncode: int
    error: str | None
    exit_time: float
    parts: int = 0
    machine: str = ""
    lost: bool = False

    @property
    def ok(self) -> bool:
        """Whether the rank's function returned."""
        return self.returncode == 0 and self.error is None

    def to_json(self) -> bytes:
        """Returns the record as UTF-8 JSON."""
        return json.dumps(dataclasses.asdict(self)).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> RankExit:
        """Reads a record written by ``to_json``."""
        return cls(**json.loads(data.decode("utf-8")))


@dataclasses.dataclass
class _Rank:
    """A rank the agent runs, until its exit is reported."""

    number: int  # the command that started it
    slot: SlotInfo
    worker: Worker
    directory: str


class _DriverGone(Exception):
    """The driver's rendezvous server cannot be reached any more."""


class Agent:
    """One agent: registers, beats, runs the ranks the driver commands, reports their ends.

    Args:
        spec: the job.
        client: a connection to the driver's rendezvous server.
        index: the Spark partition.
        attempt: the Spark attempt number.
        machine: the host this task runs on.
    """

    def __init__(self, spec: AgentSpec, client: RendezvousClient, index: int, attempt: int, machine: str) -> None:
        self._spec = spec
        self._client = client
        self._record = AgentRecord(index, attempt, agent_name(index, attempt), machine)
        self._rank: _Rank | None = None
        self._commands = 0
        self._started = 0  # ranks started: the number of the next one's command
        self._lifeline: Lifeline | None = None
        self._output: OutputClient | None = None
        self._sinks: tuple[Sink, Sink] | None = None
        self._beats = 0
        self._next_beat = 0.0  # monotonic time of the next beat

    @property
    def name(self) -> str:
        return self._record.name

    def serve(self) -> int:
        """Runs until the job is over or the driver is gone.

        Returns:
            The number of ranks this agent started.
        """
        try:
            if self._get(DONE_KEY) is not None:
                return 0
            self._put(agent_key(self._record.index), self._record.to_json())
            while True:
                if self._beat() and self._get(DONE_KEY) is not None:
                    break
                command = self._get(command_key(self.name, self._commands), _POLL)
                if command is not None:
                    self._commands += 1
                    self._obey(Command.from_json(command))
                if self._rank is not None and not self._rank.worker.running:
                    self._report(self._rank)
        except _DriverGone:
            pass
        finally:
            self._close()
        return self._started

    def _beat(self) -> bool:
        """Beats if the time has come (also while stopping a rank, which may take seconds).

        Returns:
            Whether it beat.

        Raises:
            _DriverGone: the driver's server cannot be reached.
        """
        now = time.monotonic()
        if now < self._next_beat:
            return False
        self._put(beat_key(self.name), str(self._beats).encode())
        self._beats += 1
        self._next_beat = now + HEARTBEAT_S
        return True

    def _beat_quietly(self) -> None:
        """Beats if the time has come; a driver that is gone changes nothing (a rank is
        being stopped, which must finish whatever happens)."""
        try:
            self._beat()
        except _DriverGone:
            pass

    def _get(self, key: str, timeout: float = 0.0) -> bytes | None:
        """The value of ``key``, waiting up to ``timeout`` seconds for it; None if absent.

        Raises:
            _DriverGone: the driver's server cannot be reached.
        """
        try:
            return self._client.wait([key], timeout)[0]
        except RendezvousTimeout:
            return None
        except OSError as exc:  # the connection is gone: the driver stopped or died
            raise _DriverGone(str(exc)) from None

    def _put(self, key: str, value: bytes) -> None:
        """Stores ``value`` under ``key``.

        Raises:
            _DriverGone: the driver's server cannot be reached.
        """
        try:
            self._client.put(key, value)
        except OSError as exc:
            raise _DriverGone(str(exc)) from None

    def _obey(self, command: Command) -> None:
        if command.op == "stop":
            if self._rank is not None:
                self._stop(self._rank)
            return
        if command.op != "start":
            return  # a command this agent does not know: from another version, ignored
        if self._rank is not None:  # the driver starts a rank only where none runs; never two
            self._stop(self._rank)
        rank, size, local_rank, local_size, cross_rank, cross_size = command.place
        slot = SlotInfo(self.name, rank, size, local_rank, local_size, cross_rank, cross_size)
        number = self._started
        self._started += 1
        self._start(number, slot, command.generation)

    def _start(self, number: int, slot: SlotInfo, generation: int) -> None:
        """Starts a rank as a child process; a rank that cannot start is reported at once."""
        spec = self._spec
        sweep_stale_directories()
        directory = tempfile.mkdtemp(prefix=DIRECTORY_PREFIX)
        with open(os.path.join(directory, OWNER), "w", encoding="utf-8") as handle:
            handle.write(str(os.getpid()))
        with open(os.path.join(directory, rank_task.PAYLOAD), "wb") as handle:
            handle.write(spec.payload)
        with open(os.path.join(directory, rank_task.SYS_PATH), "w", encoding="utf-8") as handle:
            json.dump(list(spec.sys_path), handle)
        command = (spec.executable or sys.executable, "-m", "hora.runner.task", directory)
        elastic = {
            "HORA_ELASTIC": "1",
            "HORA_ELASTIC_GENERATION": str(generation),
            "HORA_ELASTIC_TIMEOUT": repr(float(spec.elastic_timeout)),
        }
        settings = LaunchSettings(
            command=command,
            num_proc=slot.size,
            start_timeout=spec.start_timeout,
            env={**spec.env, **elastic},
            network_interfaces=spec.network_interfaces,
        )
        env = rank_env(os.environ, settings, slot, spec.rendezvous, spec.secret)
        stdout, stderr = self._output_sinks(slot.rank)
        if self._lifeline is None:
            try:
                self._lifeline = Lifeline.start(GRACE)
            except OSError:
                self._lifeline = None  # its ranks are then stopped only when this agent ends normally
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()  # unread: the agent polls ``running``
        try:
            worker = Worker.start(slot, command, env, events, stdout, stderr, None, spec.prefix_timestamp)
        except OSError as exc:
            shutil.rmtree(directory, ignore_errors=True)
            error = f"cannot start a rank on {self.name} ({' '.join(command)!r}): {exc.strerror or exc}"
            self._put(exit_key(self.name, number), RankExit(127, error, time.time(), 0, self._record.machine).to_json())
            return
        if self._lifeline is not None:
            self._lifeline.watch(worker.local_pid)
        self._rank = _Rank(number, slot, worker, directory)

    def _output_sinks(self, rank: int) -> tuple[Sink, Sink]:
        """Where ranks' output goes: the driver's output server, else this executor's log."""
        if self._sinks is None:
            try:
                self._output = OutputClient(*self._spec.output, self._spec.secret, _CONNECT_TIMEOUT)
                self._sinks = Sink(self._output.stream(STDOUT)), Sink(self._output.stream(STDERR))
            except (OSError, ValueError) as exc:
                print(f"hora.spark: agent {self.name} (rank {rank}): cannot forward output to the driver ({exc}); "
                      "it stays in this executor's log", file=sys.stderr)  # fmt: skip
                self._sinks = Sink(sys.stdout), Sink(sys.stderr)
        return self._sinks

    def _stop(self, rank: _Rank) -> None:
        """Stops the rank (SIGTERM, SIGKILL after ``GRACE``) and reports its end."""
        worker = rank.worker
        if worker.running:
            worker.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + GRACE
            while worker.running and time.monotonic() < deadline:
                self._beat_quietly()
                time.sleep(0.05)
            if worker.running:
                worker.signal_group(signal.SIGKILL)
                deadline = time.monotonic() + GRACE
                while worker.running and time.monotonic() < deadline:
                    self._beat_quietly()
                    time.sleep(0.05)
        self._report(rank)

    def _report(self, rank: _Rank) -> None:
        """Puts the rank's result (in pieces) and then its ``RankExit`` into the store."""
        self._rank = None
        worker = rank.worker
        exit_time = time.time()
        worker.kill_leftovers()
        worker.join_output(_OUTPUT_JOIN)
        returncode = worker.returncode if worker.returncode is not None else 1
        try:
            path = rank_task.result_path(rank.directory, rank.slot.rank)
            machine = self._record.machine
            if returncode == 0 and os.path.exists(path):
                with open(path, "rb") as handle:
                    result = handle.read()
                parts = max(1, -(-len(result) // RESULT_PART))
                for part in range(parts):
                    chunk = result[part * RESULT_PART : (part + 1) * RESULT_PART]
                    self._put(result_key(self.name, rank.number, part), chunk)
                record = RankExit(0, None, exit_time, parts, machine)
            else:
                error = error_text(rank.directory, rank.slot.rank, returncode, worker)
                record = RankExit(returncode or 1, error, exit_time, 0, machine)
            self._put(exit_key(self.name, rank.number), record.to_json())
        finally:
            shutil.rmtree(rank.directory, ignore_errors=True)

    def _close(self) -> None:
        """Stops the rank still running (the job is over or the driver gone) and lets go of everything."""
        if self._rank is not None:
            rank = self._rank
            try:
                self._stop(rank)
            except _DriverGone:
                pass  # nobody to report to
            finally:
                shutil.rmtree(rank.directory, ignore_errors=True)
        if self._lifeline is not None:
            self._lifeline.close()
        if self._output is not None:
            self._output.close()


def run_agent(spec: AgentSpec) -> dict[str, Any]:
    """Serves as an agent of the job in this Spark task.

    Args:
        spec: the job.

    Returns:
        ``{"name": ..., "ranks": n}``: this agent's name and how many ranks it started.

    Raises:
        RuntimeError: not in a Spark task.
        TimeoutError: the driver's rendezvous server cannot be reached (Spark may re-run
            the task).
    """
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        raise RuntimeError("hora.spark: run_agent must run in a Spark task")
    index, attempt = context.partitionId(), context.attemptNumber()
    with RendezvousClient(*spec.rendezvous, spec.secret, _CONNECT_TIMEOUT) as client:
        agent = Agent(spec, client, index, attempt, socket.gethostname())
        started = agent.serve()
    return {"name": agent.name, "ranks": started}


def agent_main(spec: AgentSpec, iterator: Any) -> Iterator[dict[str, Any]]:
    """The stage's partition function: one summary per agent."""
    yield run_agent(spec)
