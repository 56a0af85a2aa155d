"""What ``hora.spark.run`` and ``run_elastic`` share on the driver: the Spark stage their
tasks run in (collected in a thread so the driver can watch and cancel it), where the
driver's servers listen, the start timeout, and how a rank's error is read.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from hora.config import knobs

# Declared in hora.config.knobs (default 600 s, Horovod's alias HOROVOD_SPARK_START_TIMEOUT).
START_TIMEOUT_VARIABLE = "HORA_SPARK_START_TIMEOUT"
CANCEL_TIMEOUT = 60.0  # seconds to wait for Spark to end a cancelled stage
# hora's errors for a failure elsewhere in the job: a rank that ends with one is not the cause.
CONSEQUENCES = ("HoraInternalError", "HorovodInternalError")


class Stage:
    """A Spark stage of ``count`` tasks, collected in a thread of its own so that the
    driver can watch and cancel it.

    Args:
        context: the active SparkContext.
        label: names the job group and the job (``hora.spark.run``, ...).
        count: the number of tasks (partitions ``0 .. count - 1``).
        task: what each task runs on its partition's iterator (picklable).
        barrier: run in barrier mode (every task at once, or none).
    """

    def __init__(
        self, context: Any, label: str, count: int, task: Callable[[Iterator[int]], Iterable[Any]], barrier: bool
    ) -> None:
        self._context = context
        self._label = label
        self._count = count
        self._task = task
        self._barrier = barrier
        self.group = f"{label}.{uuid.uuid4().hex}"
        self.outcomes: list[Any] | None = None  # what the tasks yielded, once the stage ended
        self.error: BaseException | None = None  # why the stage failed, if it did
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        from pyspark import InheritableThread

        # InheritableThread: the job inherits the caller's local properties (scheduler
        # pool, ...) and its JVM thread is cleaned up with it.
        self._thread = InheritableThread(target=self._collect, name=f"{self._label}-stage", daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        try:
            self._context.setJobGroup(self.group, f"{self._label}: {self._count} tasks", interruptOnCancel=True)
            rdd = self._context.parallelize(range(self._count), self._count)
            self.outcomes = (rdd.barrier() if self._barrier else rdd).mapPartitions(self._task).collect()
        except BaseException as exc:  # reported by the driver in the caller's thread
            self.error = exc

    def ended(self) -> bool:
        """Whether the stage ended (every task returned or Spark gave up on it)."""
        return self._thread is not None and not self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds; True when the stage ended."""
        assert self._thread is not None
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def cancel(self) -> None:
        """Cancels the stage: Spark kills its tasks' Python workers (and so their ranks)."""
        self._context.cancelJobGroup(self.group)


def resolve_start_timeout(value: float | None, environ: Mapping[str, str], what: str) -> float:
    """The start timeout: ``value``, else ``HORA_SPARK_START_TIMEOUT`` (or Horovod's
    ``HOROVOD_SPARK_START_TIMEOUT``) from the environment, else 600 s.

    Args:
        what: the caller, for messages (``hora.spark.run``).

    Raises:
        ValueError: the value is not a positive number (naming where it came from).
    """
    if value is not None:
        if isinstance(value, bool) or not (0 < value < float("inf")):
            raise ValueError(f"{what}: start_timeout={value!r} is not valid: expected a number of seconds > 0")
        return float(value)
    try:
        seconds = float(knobs.read(START_TIMEOUT_VARIABLE, environ))
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{what}: start timeout {seconds!r} is not valid: expected a number of seconds > 0")
    return seconds


def addresses(context: Any) -> tuple[str, str]:
    """Where the driver's servers listen, and the address tasks reach them at.

    In local modes (``local``, ``local[N]``, ``local-cluster[...]``) every executor runs
    on this machine: loopback only. Otherwise the servers listen on every interface
    (each connection must pass the job secret's HMAC challenge before anything it sends
    is read) and tasks reach them at ``spark.driver.host``, the address executors
    already use to reach the driver.
    """
    master = str(context.master or "")
    if master.startswith("local"):
        return "127.0.0.1", "127.0.0.1"
    host = context.getConf().get("spark.driver.host")
    return "0.0.0.0", str(host or "127.0.0.1")


def is_consequence(error: str | None) -> bool:
    """True when a rank's error (its traceback's text) is hora's error for a failure elsewhere."""
    last = [line for line in (error or "").splitlines() if line.strip()][-3:]
    return any(name in line for line in last for name in CONSEQUENCES)


def short(error: BaseException, lines: int = 40) -> str:
    """The first lines of an error: a Py4JJavaError carries the whole Java stack."""
    text = str(error).splitlines()
    kept = list(itertools.islice((line for line in text if not line.lstrip().startswith("at ")), lines))
    return "\n".join(kept) + ("\n..." if len(text) > len(kept) else "")
