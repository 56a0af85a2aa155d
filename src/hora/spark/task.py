"""What each Spark task of ``hora.spark.run`` does on its executor: start one rank and wait for it.

The driver runs one barrier-mode stage of ``num_proc`` tasks (``runner``). Each task:

1. tells the driver it started (``started_key``, through the job's rendezvous store), so
   the driver can bound the wait for Spark to schedule every task by ``start_timeout``;
2. learns every task's host with ``BarrierTaskContext.allGather`` and works out its
   rank: ranks are grouped by host (hosts in the order of their first task), so that
   the ranks of one host are consecutive, as Horovod's Spark runner numbers them; local
   and cross ranks follow (``hora.runner.hosts.assign_slots``);
3. writes the cloudpickled function into a temporary directory and starts the rank as a
   child process, ``python -m hora.runner.task DIR``, with the environment ``horarun``
   gives a rank (``hora.runner.settings.rank_env``), exactly as ``hora.run`` does. A fresh
   interpreter per rank keeps the rank's runtime, threads and memory out of Spark's
   reused Python workers. The child runs in a session of its own, handed to a guardian
   (``hora.runner.lifeline``) that stops it if the task's Python worker dies (Spark
   kills the worker of a cancelled or failed task; the next task on that machine removes
   the directory such a task left behind);
4. forwards the rank's output, prefixed ``[<rank>]<stdout>:`` and ``[<rank>]<stderr>:``,
   to the driver (``output``);
5. when the rank exits, records how it ended under ``exit_key`` (the driver watches
   these to stop the job soon after a failure) and returns a ``TaskOutcome`` with the
   pickled return value, which reaches the driver through ``collect()``.

A rank's failure is reported, not raised: a task that raised would make Spark abort
the stage and kill the other tasks before their ranks could report the error hora
raises in them, and the driver would only see Spark's summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hora.runner import task as rank_task
from hora.runner.hosts import HostSpec, SlotInfo, assign_slots
from hora.runner.lifeline import Lifeline
from hora.runner.output import Sink
from hora.runner.settings import LaunchSettings, rank_env
from hora.runner.workers import Event, Worker
from hora.spark.output import STDERR, STDOUT, OutputClient
from hora.transport.rendezvous import RendezvousClient

GRACE = 5.0  # seconds between SIGTERM and SIGKILL when the guardian stops a rank
# Characters of a rank's traceback kept in its exit record: at most 6 bytes each in JSON,
# so the record stays well under the rendezvous store's MAX_VALUE (1 MiB).
MAX_ERROR = 64 * 1024
_OUTPUT_JOIN = 5.0  # seconds to wait for a rank's output to be drained after it exited
_CONNECT_TIMEOUT = 30.0  # seconds a task keeps trying to reach the driver's servers
DIRECTORY_PREFIX = "hora-spark-"  # of each task's temporary directory (payload, result)
OWNER = "owner"  # the file in it that names the Python worker (pid) that made it


def started_key(index: int) -> str:
    """The rendezvous key a task writes (its host) once it runs; by partition index."""
    return f"spark/started/{index}"


def exit_key(rank: int) -> str:
    """The rendezvous key a task writes (an ``ExitRecord`` as JSON) when its rank exited."""
    return f"spark/exit/{rank}"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs, shipped from the driver inside the stage's closure.

    Attributes:
        payload: the cloudpickled ``(fn, args, kwargs)``.
        sys_path: the driver's ``sys.path``, so that functions pickled by reference to
            the driver's modules import in the rank too (entries missing there are harmless).
        rendezvous: the address and port of the driver's rendezvous server.
        output: the address and port of the driver's ``OutputServer``.
        secret: the job secret.
        num_proc: the number of ranks (= tasks).
        start_timeout: seconds ranks wait for each other at rendezvous.
        env: variables added to every rank's environment.
        executable: the Python that runs the rank; None is the task's own.
        prefix_timestamp: put the local time before forwarded lines.
        network_interfaces: ``nics`` as a comma-separated list, or None.
    """

    payload: bytes
    sys_path: tuple[str, ...]
    rendezvous: tuple[str, int]
    output: tuple[str, int]
    secret: bytes
    num_proc: int
    start_timeout: float
    env: Mapping[str, str]
    executable: str | None = None
    prefix_timestamp: bool = False
    network_interfaces: str | None = None


@dataclasses.dataclass(frozen=True)
class ExitRecord:
    """How one rank ended, as its task saw it.

    Attributes:
        rank: the rank.
        index: its Spark partition (task) index.
        host: its host.
        returncode: the rank's exit status (minus the signal number if a signal ended it).
        error: the traceback of what the rank's function raised, or the last traceback
            or lines it wrote to stderr, or why it could not start; None on success.
        exit_time: ``time.time()`` on the task's host when the rank exited.
    """

    rank: int
    index: int
    host: str
    returncode: int
    error: str | None
    exit_time: float

    def to_json(self) -> bytes:
        """Returns the record as UTF-8 JSON."""
        return json.dumps(dataclasses.asdict(self)).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> ExitRecord:
        """Reads a record written by ``to_json``."""
        fields = json.loads(data.decode("utf-8"))
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class TaskOutcome:
    """What a task returns to the driver through ``collect()``.

    Attributes:
        record: how its rank ended.
        result: the cloudpickled return value of ``fn`` when the rank succeeded, else None.
    """

    record: ExitRecord
    result: bytes | None


def place(hosts_by_index: Sequence[str]) -> list[SlotInfo]:
    """Numbers the ranks of a job from the host of each task.

    Hosts come in the order of their lowest task index; each host's ranks are
    consecutive, in task order, so rank 0 is task 0 and a host's ranks share a
    contiguous block (what Horovod does, and what hierarchical collectives expect).

    Args:
        hosts_by_index: the host of each task, by partition index.

    Returns:
        Each task's place in the job, by partition index.

    Example: hosts ``["a", "b", "a"]`` give task 0 rank 0 and task 2 rank 1 (local
    ranks 0 and 1 on ``a``), and task 1 rank 2 (local rank 0 on ``b``).
    """
    indices_by_host: dict[str, list[int]] = {}
    for index, host in enumerate(hosts_by_index):
        indices_by_host.setdefault(host, []).append(index)
    slots = assign_slots([HostSpec(host, len(indices)) for host, indices in indices_by_host.items()],
                         len(hosts_by_index))  # fmt: skip
    order = [index for indices in indices_by_host.values() for index in indices]  # rank -> task index
    by_index: list[SlotInfo | None] = [None] * len(hosts_by_index)
    for rank, index in enumerate(order):
        by_index[index] = slots[rank]
    return [slot for slot in by_index if slot is not None]


def rank_environment(spec: TaskSpec, slot: SlotInfo, base: Mapping[str, str], command: Sequence[str]) -> dict[str, str]:
    """Builds the environment of one rank started by a task.

    Args:
        spec: the job.
        slot: the rank's place.
        base: the task's own environment.
        command: the rank's command line.

    Returns:
        ``rank_env``'s environment; ``OMP_NUM_THREADS=1`` unless ``env`` sets it or the
        rank is alone on its host (torchrun's rule: ranks sharing a host would otherwise
        each start a thread per core). Spark sets ``OMP_NUM_THREADS`` in its Python
        workers to the task's cores; a rank alone on its host keeps that value.
    """
    settings = LaunchSettings(
        command=tuple(command),
        num_proc=spec.num_proc,
        start_timeout=spec.start_timeout,
        env=dict(spec.env),
        network_interfaces=spec.network_interfaces,
    )
    env = rank_env(base, settings, slot, spec.rendezvous, spec.secret)
    if "OMP_NUM_THREADS" not in spec.env and slot.local_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    return env


def run_task(spec: TaskSpec) -> TaskOutcome:
    """Runs one rank of the job in this Spark task and returns how it ended.

    Must run inside a barrier-mode task (``rdd.barrier().mapPartitions``).

    Args:
        spec: the job.

    Returns:
        The rank's outcome; a failing rank is an outcome, not an exception.

    Raises:
        RuntimeError: not in a barrier task, or this is a re-attempt of the task (Spark
            re-runs a task only after a failure, and a rank must not run twice).
        TimeoutError: the driver's rendezvous server cannot be reached.
    """
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    if context is None:
        raise RuntimeError("hora.spark: run_task must run in a barrier-mode Spark task")
    index = context.partitionId()
    if context.attemptNumber() > 0:
        raise RuntimeError(
            f"hora.spark: Spark re-attempted task {index} after a failure; hora.spark.run runs each rank once"
        )
    host = socket.gethostname()
    with RendezvousClient(*spec.rendezvous, spec.secret, _CONNECT_TIMEOUT) as client:
        client.put(started_key(index), host.encode("utf-8"))
        # Every task must run before any rank starts (the ranks wait for each other at
        # rendezvous anyway), and the host of each decides the numbering.
        gathered = sorted(tuple(json.loads(message)) for message in context.allGather(json.dumps([index, host])))
        slot = place([name for _, name in gathered])[index]
        outcome = _run_rank(spec, slot, index)
        client.put(exit_key(slot.rank), outcome.record.to_json())
    return outcome


def _run_rank(spec: TaskSpec, slot: SlotInfo, index: int) -> TaskOutcome:
    """Starts the rank as a child process, forwards its output and waits for it."""
    sweep_stale_directories()
    directory = tempfile.mkdtemp(prefix=DIRECTORY_PREFIX)
    output: OutputClient | None = None
    lifeline: Lifeline | None = None
    try:
        with open(os.path.join(directory, OWNER), "w", encoding="utf-8") as handle:
            handle.write(str(os.getpid()))
        with open(os.path.join(directory, rank_task.PAYLOAD), "wb") as handle:
            handle.write(spec.payload)
        with open(os.path.join(directory, rank_task.SYS_PATH), "w", encoding="utf-8") as handle:
            json.dump(list(spec.sys_path), handle)
        command = (spec.executable or sys.executable, "-m", "hora.runner.task", directory)
        env = rank_environment(spec, slot, os.environ, command)
        try:
            output = OutputClient(*spec.output, spec.secret, _CONNECT_TIMEOUT)
            stdout, stderr = Sink(output.stream(STDOUT)), Sink(output.stream(STDERR))
        except (OSError, ValueError) as exc:  # the driver's output server is out of reach: keep it here
            print(f"hora.spark: rank {slot.rank}: cannot forward output to the driver ({exc}); "
                  "it stays in this executor's log", file=sys.stderr)  # fmt: skip
            stdout, stderr = Sink(sys.stdout), Sink(sys.stderr)
        try:
            lifeline = Lifeline.start(GRACE)
        except OSError:
            lifeline = None  # the rank is then stopped only when this task ends normally
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        try:
            worker = Worker.start(slot, command, env, events, stdout, stderr, None, spec.prefix_timestamp)
        except OSError as exc:
            error = f"cannot start rank {slot.rank} ({' '.join(command)!r}): {exc.strerror or exc}"
            return TaskOutcome(ExitRecord(slot.rank, index, slot.hostname, 127, error, time.time()), None)
        if lifeline is not None:
            lifeline.watch(worker.local_pid)
        events.get()  # the waiter posts once, when the rank exited
        exit_time = time.time()
        worker.kill_leftovers()
        worker.join_output(_OUTPUT_JOIN)
        returncode = worker.returncode if worker.returncode is not None else 1
        result_path = rank_task.result_path(directory, slot.rank)
        if returncode == 0 and os.path.exists(result_path):
            with open(result_path, "rb") as handle:
                result = handle.read()
            return TaskOutcome(ExitRecord(slot.rank, index, slot.hostname, 0, None, exit_time), result)
        error = error_text(directory, slot.rank, returncode, worker)
        return TaskOutcome(ExitRecord(slot.rank, index, slot.hostname, returncode or 1, error, exit_time), None)
    finally:
        if lifeline is not None:
            lifeline.close()
        if output is not None:
            output.close()
        shutil.rmtree(directory, ignore_errors=True)


def sweep_stale_directories() -> None:
    """Removes the directories of tasks whose Python worker died before cleaning up.

    Spark kills the Python worker of a cancelled task, so its ``finally`` never runs;
    the next task on the executor removes what it left (its ``owner`` process is gone).
    """
    root = tempfile.gettempdir()
    try:
        names = [name for name in os.listdir(root) if name.startswith(DIRECTORY_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, OWNER), encoding="utf-8") as handle:
                owner = int(handle.read().strip())
        except (OSError, ValueError):
            continue  # not ours to judge (another user's, or still being written)
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # alive, as another user


def error_text(directory: str, rank: int, returncode: int, worker: Worker) -> str:
    """Says why a rank failed: its function's traceback, else the last it wrote to stderr.

    Args:
        directory: the rank's directory (where ``hora.runner.task`` writes its traceback).
        rank: the rank it was started as (names its files).
        returncode: its exit status.
        worker: the exited rank (the tail of its stderr).

    Returns:
        The text, at most ``MAX_ERROR`` characters (the middle left out).
    """
    path = rank_task.error_path(directory, rank)
    if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as handle:
            return _bounded(handle.read().rstrip("\n"))
    if returncode == 0:
        return (
            f"rank {rank} exited with code 0 but returned no result (did it call sys.exit() or os._exit()?)"
        )
    status = f"exited with code {returncode}" if returncode > 0 else f"was killed by signal {-returncode}"
    traceback = worker.stderr_traceback
    tail = [*traceback.lines, *traceback.after] if traceback is not None else worker.stderr_tail
    return _bounded("\n".join([f"rank {rank} {status}; the last it wrote to stderr:", *tail]))


def _bounded(text: str) -> str:
    if len(text) <= MAX_ERROR:
        return text
    half = MAX_ERROR // 2
    return f"{text[:half]}\n[... {len(text) - MAX_ERROR} characters left out ...]\n{text[-half:]}"


def task_main(spec: TaskSpec, iterator: Any) -> Any:
    """The barrier stage's partition function: one ``TaskOutcome`` per task."""
    yield run_task(spec)
