"""``hora.spark.run``: run a function on ``num_proc`` hora ranks inside Spark tasks.

Like ``horovod.spark.run``: the driver (this process, which holds the active
``SparkContext``) creates a job secret, starts hora's rendezvous server and an output
server (``hora.spark.output``), and runs one barrier-mode stage of ``num_proc`` tasks
in a thread of its own. Each task starts one rank as a child process
(``hora.spark.task``); the ranks find each other through the rendezvous server, as
under ``horarun``. The return values come back through ``collect()`` and are returned
in rank order.

The driver watches the job through the rendezvous store, where each task notes that
it started and, later, how its rank ended. Nothing waits for ever:

* every task must have started within ``start_timeout`` seconds (Spark schedules a
  barrier stage only when it has a slot for every task; an undersized cluster would
  otherwise wait), else the stage is cancelled and ``TimeoutError`` names the tasks
  that never started;
* after the first rank fails, the others get ``SETTLE_PERIOD`` seconds to end by
  themselves (a rank blocked in a collective fails within milliseconds of losing a
  peer, with an error that names it); then the stage is cancelled, which makes Spark
  kill the tasks' Python workers and the tasks' guardians stop their ranks;
* ``timeout`` (a hora extension) bounds the whole job.

A rank's failure raises ``RuntimeError`` naming the rank that failed first for its own
reason (passing over ranks whose error is hora's ``HoraInternalError``, raised because
another rank failed), with its traceback; the ``SparkContext`` stays usable.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TextIO

from hora.runner.output import Sink
from hora.runner.run_func import callable_name
from hora.spark.output import OutputServer
from hora.spark.stage import CANCEL_TIMEOUT, Stage, addresses, is_consequence, resolve_start_timeout, short
from hora.spark.task import ExitRecord, TaskOutcome, TaskSpec, exit_key, started_key, task_main
from hora.transport import auth
from hora.transport.rendezvous_server import RendezvousServer

log = logging.getLogger(__name__)

# After the first failure, seconds the other ranks get to end by themselves before the
# stage is cancelled: their own errors (naming the lost rank) then reach the user.
SETTLE_PERIOD = 10.0
_POLL = 0.1  # seconds between looks at the rendezvous store


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    extra_mpi_args: str | None = None,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    verbose: int = 1,
    nics: Iterable[str] | None = None,
    prefix_output_with_timestamp: bool = False,
    executable: str | None = None,
    *,
    timeout: float | None = None,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``num_proc`` hora ranks, one per Spark task.

    Each rank is a fresh Python process started by its Spark task, with the
    environment ``horarun`` gives a rank, so ``hvd.init()`` inside ``fn`` joins the job.
    Ranks on one host are numbered consecutively. Their output reaches ``stdout`` and
    ``stderr`` on the driver, prefixed ``[<rank>]<stdout>:`` / ``[<rank>]<stderr>:``.

    Args:
        fn: the function; anything cloudpickle can pickle.
        args: positional arguments for ``fn``.
        kwargs: keyword arguments for ``fn``.
        num_proc: the number of ranks (= Spark tasks); default ``spark.default.parallelism``
            (``SparkContext.defaultParallelism``). The cluster must have that many task
            slots free at once (barrier execution).
        start_timeout: seconds for Spark to start every task (and for the ranks to meet
            at rendezvous); default ``HORA_SPARK_START_TIMEOUT`` or
            ``HOROVOD_SPARK_START_TIMEOUT`` from the environment, else 600.
        use_mpi: accepted for Horovod's signature; True is refused (hora's ranks on Spark
            talk over TCP, the counterpart of Horovod's Gloo).
        use_gloo: accepted for Horovod's signature; hora always runs its TCP transport.
        extra_mpi_args: accepted for Horovod's signature; refused unless None (no mpirun).
        env: variables added to every rank's environment (over its task's).
        stdout: where ranks' stdout lines go; default ``sys.stdout``.
        stderr: where ranks' stderr lines go; default ``sys.stderr``.
        verbose: 0 is quiet; 1 logs the number of ranks; 2 also logs each rank's task and host.
        nics: network interfaces the ranks use for their links (``HORA_IFACE``): names,
            or one comma-separated string.
        prefix_output_with_timestamp: put the local time before each forwarded line.
        executable: the Python that runs each rank on the executors; default the
            Python of the Spark task (``PYSPARK_PYTHON``).
        timeout: seconds after which the job is stopped (a hora extension); None waits
            for as long as the ranks run.

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        RuntimeError: there is no active ``SparkContext``; or a rank failed (the message
            names the rank that failed first, its task and host, and its traceback, then
            how the other ranks ended); or the Spark job failed for a reason of its own.
        TimeoutError: the tasks did not all start within ``start_timeout`` (the message
            names those that never started), or ``timeout`` passed.
        ValueError: an argument is not valid (``num_proc`` below 1, ``use_mpi=True``, ...).
    """
    import cloudpickle
    from pyspark import SparkContext

    context = SparkContext._active_spark_context
    if context is None:
        raise RuntimeError(
            "hora.spark.run: no active SparkContext: start one first "
            "(e.g. SparkSession.builder.getOrCreate()) and call hora.spark.run from its driver"
        )
    if use_mpi:
        raise ValueError(
            "hora.spark.run: use_mpi=True is not supported: hora's ranks on Spark talk over TCP "
            "(the counterpart of Horovod's Gloo); leave use_mpi unset"
        )
    if extra_mpi_args:
        raise ValueError("hora.spark.run: extra_mpi_args is not supported: hora.spark starts no mpirun")
    del use_gloo  # hora's TCP transport is the only one, whatever was asked
    count = _num_proc(num_proc, context.defaultParallelism)
    wait = resolve_start_timeout(start_timeout, os.environ, "hora.spark.run")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"hora.spark.run: timeout={timeout!r} is not valid: expected a number of seconds > 0")
    interfaces = None if nics is None else nics if isinstance(nics, str) else ",".join(nics)
    name = callable_name(fn)
    if verbose >= 1:
        how = "" if num_proc is not None else " (spark.default.parallelism)"
        log.info("hora.spark.run: running %s on %d ranks%s", name, count, how)

    bind, advertise = addresses(context)
    secret = auth.new_secret()
    server = RendezvousServer(secret, host=bind).start()
    output: OutputServer | None = None
    try:
        output = OutputServer(secret, bind, Sink(stdout or sys.stdout), Sink(stderr or sys.stderr)).start()
        spec = TaskSpec(
            payload=cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}))),
            sys_path=tuple(entry for entry in sys.path if isinstance(entry, str)),
            rendezvous=(advertise, server.port),
            output=(advertise, output.port),
            secret=secret,
            num_proc=count,
            start_timeout=wait,
            env=dict(env or {}),
            executable=executable,
            prefix_timestamp=prefix_output_with_timestamp,
            network_interfaces=interfaces,
        )
        stage = Stage(context, "hora.spark.run", spec.num_proc, functools.partial(task_main, spec), barrier=True)
        stage.start()
        try:
            watch = _watch(stage, server, count, wait, timeout)
        except BaseException:  # KeyboardInterrupt: no rank may outlive run()
            stage.cancel()
            stage.join(CANCEL_TIMEOUT)
            raise
        records = _records(server, count)
    finally:
        server.stop()
        if output is not None:
            output.stop()
    if verbose >= 2:
        for record in sorted(records.values(), key=lambda record: record.rank):
            log.info("hora.spark.run: rank %d ran in Spark task %d on host %s", record.rank, record.index, record.host)
    return _finish(name, count, stage, watch, records, wait, timeout)


class _Watch:
    """Why the driver stopped watching: nothing, or which bound it cancelled the stage for."""

    def __init__(self) -> None:
        self.start_timed_out = False
        self.not_started: list[int] = []
        self.timed_out = False
        self.settled_after_failure = False
        self.stuck = False  # the cancelled stage did not end within CANCEL_TIMEOUT


def _watch(stage: Stage, server: RendezvousServer, count: int, start_timeout: float, timeout: float | None) -> _Watch:
    """Waits for the stage to end, cancelling it when a bound passes (see the module docstring)."""
    watch = _Watch()
    begin = time.monotonic()
    all_started = False
    failed_at: float | None = None
    while not stage.join(_POLL):
        now = time.monotonic()
        if not all_started:
            missing = [index for index in range(count) if server.get(started_key(index)) is None]
            all_started = not missing
            if missing and now - begin > start_timeout:
                watch.start_timed_out, watch.not_started = True, missing
                break
        if failed_at is None and any(record.returncode != 0 for record in _records(server, count).values()):
            failed_at = now
        if failed_at is not None and now - failed_at > SETTLE_PERIOD:
            watch.settled_after_failure = True
            break
        if timeout is not None and now - begin > timeout:
            watch.timed_out = True
            break
    else:
        return watch
    stage.cancel()
    watch.stuck = not stage.join(CANCEL_TIMEOUT)
    return watch


def _records(server: RendezvousServer, count: int) -> dict[int, ExitRecord]:
    """The exit records the tasks wrote so far, by rank."""
    records = {}
    for rank in range(count):
        data = server.get(exit_key(rank))
        if data is not None:
            records[rank] = ExitRecord.from_json(data)
    return records


def _finish(
    name: str,
    count: int,
    stage: Stage,
    watch: _Watch,
    records: Mapping[int, ExitRecord],
    start_timeout: float,
    timeout: float | None,
) -> list[Any]:
    """Turns the ended stage into the results, or raises for the way it failed."""
    import cloudpickle

    failures = [record for record in records.values() if record.returncode != 0]
    if failures:
        raise RuntimeError(_failure_report(name, count, failures, records, watch))
    if watch.start_timed_out:
        tasks = ", ".join(str(index) for index in watch.not_started)
        raise TimeoutError(
            f"hora.spark.run: only {count - len(watch.not_started)} of {count} Spark tasks started within "
            f"start_timeout={start_timeout:g} s (never started: {tasks}); the stage was cancelled. A barrier "
            "stage needs a free task slot for every rank at once: lower num_proc, give the cluster more "
            "executors or cores, or raise start_timeout (HORA_SPARK_START_TIMEOUT) if executors come on demand"
        )
    if watch.timed_out:
        running = ", ".join(str(rank) for rank in range(count) if rank not in records) or "none"
        raise TimeoutError(
            f"hora.spark.run: {name} did not finish within timeout={timeout:g} s on {count} ranks; "
            f"ranks still running: {running} (the Spark stage was cancelled)"
        )
    if stage.error is not None:
        raise RuntimeError(
            f"hora.spark.run: the Spark stage running {name} on {count} ranks failed before every rank "
            f"finished:\n{short(stage.error)}"
        ) from stage.error
    outcomes = sorted(stage.outcomes or [], key=lambda outcome: outcome.record.rank)
    if len(outcomes) != count:
        raise RuntimeError(f"hora.spark.run: the Spark stage returned {len(outcomes)} outcomes for {count} ranks")
    return [cloudpickle.loads(outcome.result) for outcome in outcomes]


def _failure_report(
    name: str, count: int, failures: list[ExitRecord], records: Mapping[int, ExitRecord], watch: _Watch
) -> str:
    """Names the root cause first, with its error, then how every other rank ended."""
    causes = [record for record in failures if not is_consequence(record.error)] or failures
    first = min(causes, key=lambda record: (record.exit_time, record.rank))
    lines = [
        f"hora.spark.run: {name} failed on {count} ranks: rank {first.rank} (Spark task {first.index} on host "
        f"{first.host}) failed first, {_status(first.returncode)}:",
        *(f"  {line}" for line in (first.error or "").splitlines()),
        "how the other ranks ended:",
    ]
    for rank in range(count):
        if rank == first.rank:
            continue
        record = records.get(rank)
        if record is None:
            ending = "still running when the stage was cancelled" if watch.settled_after_failure else "no report"
        elif record.returncode == 0:
            ending = "finished"
        else:
            last = [line for line in (record.error or "").splitlines() if line.strip()]
            ending = _status(record.returncode) + (f": {last[-1].strip()}" if last else "")
        lines.append(f"  rank {rank}: {ending}")
    return "\n".join(lines)


def _status(returncode: int) -> str:
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _num_proc(num_proc: int | None, default: int) -> int:
    count = default if num_proc is None else num_proc
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"hora.spark.run: num_proc={count!r} is not valid: expected an integer >= 1")
    return count
