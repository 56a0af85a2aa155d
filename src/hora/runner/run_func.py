"""``hora.run``: call a Python function on every rank of a job and collect the results.

Like ``horovod.run``: the function, its arguments and keyword arguments are
cloudpickled into a temporary directory; each rank runs
``python -m hora.runner.task DIR`` (``hora.runner.task``) through the same ``Job``
``horarun`` uses, so ranks get the same environment, output forwarding and
stop-everything-on-failure behaviour. The return values come back in rank order.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.runner.job import Job, JobResult
from hora.runner.launch import prepare
from hora.runner.output import Sink
from hora.runner.settings import LaunchSettings
from hora.runner.summary import failure_lines


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    *,
    np: int | None = None,
    hosts: str | None = None,
    start_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    verbose: bool = False,
    timeout: float | None = None,
) -> list[Any]:
    """Runs ``func(*args, **kwargs)`` on ``num_proc`` ranks and returns their results.

    Each rank is a fresh Python process (``sys.executable``) with the job's
    environment, so ``hora.init()`` inside ``func`` joins the job. Ranks' output is
    forwarded to this process's stdout and stderr with ``[<rank>]<stdout>:`` prefixes.

    Args:
        func: the function; anything cloudpickle can pickle (lambdas and closures too).
        args: positional arguments for ``func``.
        kwargs: keyword arguments for ``func``.
        num_proc: the number of ranks.
        np: another name for ``num_proc``; give exactly one of them.
        hosts: ``"host:slots,..."`` as for ``horarun -H`` (default ``localhost:<np>``).
        start_timeout: seconds ranks wait for each other at start-up (default 30).
        env: variables added to every rank's environment.
        verbose: print the rank placement and the rendezvous port.
        timeout: seconds after which the job is stopped; None waits forever.

    Returns:
        The return values, indexed by rank.

    Raises:
        ValueError: ``num_proc`` and ``np`` are both or neither given, or a setting
            or the hosts are invalid.
        RuntimeError: a rank failed; the message names the rank that failed first
            and shows its traceback, then how the other ranks ended.
        TimeoutError: ``timeout`` passed; the message names the ranks still running.

    Example::

        >>> hora.run(lambda x: x * int(os.environ["HORA_RANK"]), args=(10,), np=3)
        [0, 10, 20]
    """
    import cloudpickle

    from hora.runner import task  # not at import time: ranks run it as __main__

    if (num_proc is None) == (np is None):
        raise ValueError("hora.run: give the number of ranks as num_proc or np (exactly one of them)")
    count = num_proc if num_proc is not None else np
    if isinstance(count, bool) or not isinstance(count, int):
        raise ValueError(f"hora.run: num_proc={count!r} is not valid: expected an integer >= 1")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"hora.run: timeout={timeout!r} is not valid: expected a number of seconds > 0")
    directory = tempfile.mkdtemp(prefix="hora-run-")
    try:
        with open(os.path.join(directory, task.PAYLOAD), "wb") as handle:
            cloudpickle.dump((func, tuple(args), dict(kwargs or {})), handle)
        with open(os.path.join(directory, task.SYS_PATH), "w", encoding="utf-8") as handle:
            json.dump([entry for entry in sys.path if isinstance(entry, str)], handle)
        settings = LaunchSettings(
            command=(sys.executable, "-m", "hora.runner.task", directory),
            num_proc=count,
            hosts=hosts,
            start_timeout=start_timeout,
            verbose=verbose,
            env=env,
        )
        slots = prepare(settings)
        job = Job(settings, slots, Sink(sys.stdout), Sink(sys.stderr), os.environ)
        result = job.run(timeout=timeout)
        return _collect(result, directory, callable_name(func), timeout)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def callable_name(func: Callable[..., Any]) -> str:
    """A function's name for messages: its qualified name, else its name, else its repr."""
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func))


def _collect(result: JobResult, directory: str, name: str, timeout: float | None) -> list[Any]:
    """Turns a finished job into results, or raises for the way it failed."""
    import cloudpickle

    from hora.runner import task

    size = len(result.ranks)
    if result.timed_out and result.first_failure is None:
        running = ", ".join(str(rank) for rank in result.running_at_stop)
        raise TimeoutError(
            f"hora.run: {name} did not finish within {timeout:g} s on {size} ranks; "
            f"ranks still running: {running} (every rank was stopped)"
        )
    if result.first_failure is not None or result.start_error is not None or result.interrupted_by is not None:
        detail: list[str] | None = None
        if result.first_failure is not None:
            path = task.error_path(directory, result.first_failure)
            if os.path.exists(path):
                with open(path, encoding="utf-8", errors="replace") as handle:
                    detail = handle.read().rstrip("\n").splitlines()
        title = None if result.first_failure is None else f"traceback of rank {result.first_failure}"
        report = "\n".join(line.removeprefix("horarun: ") for line in failure_lines(result, detail, title))
        raise RuntimeError(f"hora.run: {name} failed on {size} ranks:\n{report}")
    values = []
    for rank in range(size):
        path = task.result_path(directory, rank)
        if not os.path.exists(path):
            raise RuntimeError(
                f"hora.run: rank {rank} exited with code 0 but returned no result from {name} "
                "(did it call sys.exit() or os._exit()?)"
            )
        with open(path, "rb") as handle:
            values.append(cloudpickle.load(handle))
    return values
