"""``hora.run``: call a Python function on every rank of a job and collect the results.

``horovod.run``'s signature and meaning: the function, its arguments and keyword
arguments are cloudpickled into a temporary directory; each rank runs
``python -m hora.runner.task DIR`` (``hora.runner.task``) through what ``horarun`` runs
for the same settings (its ``Job``; ``mpirun`` with ``use_mpi``; the elastic driver for an
elastic job), so ranks get the same environment, output forwarding and
stop-everything-on-failure behaviour. The return values come back in rank order.

Where Horovod hands the function to the ranks through an HTTP key-value store on the
launcher, hora uses that directory: ranks on other hosts need it on a shared file system.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.config import knobs
from hora.runner.elastic.settings import ElasticSettings
from hora.runner.job import Job, JobResult
from hora.runner.launch import check, prepare
from hora.runner.mpi_launch import launch_mpi
from hora.runner.output import Sink
from hora.runner.settings import LaunchSettings
from hora.runner.summary import failure_lines


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = 1,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[int, int] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    host_discovery_script: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | int | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    network_interfaces: Sequence[str] | str | None = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> list[Any]:
    """Runs ``func(*args, **kwargs)`` on every rank of a job and returns their results.

    ``horovod.run``'s signature, defaults and meaning, parameter for parameter, plus
    ``env`` and ``timeout``. Each rank is a fresh Python process with the job's
    environment, so ``hora.init()`` inside ``func`` joins the job. Ranks' output is
    forwarded to this process's stdout and stderr with ``[<rank>]<stdout>:`` prefixes.
    The job is elastic, as in Horovod, when ``host_discovery_script`` or
    ``min_num_proc`` is given; it then runs under ``horarun``'s elastic driver.

    Args:
        func: the function; anything cloudpickle can pickle (lambdas and closures too).
        args: positional arguments for ``func``.
        kwargs: keyword arguments for ``func``.
        num_proc: the number of ranks (Horovod's default: 1).
        min_num_proc: an elastic job's fewest ranks (makes the job elastic).
        max_num_proc: an elastic job's most ranks.
        slots: the slots of a discovered host whose line names none (elastic).
        reset_limit: the most resets of an elastic job.
        cooldown_range: ``(min, max)`` seconds a failed host stays blacklisted (elastic).
        hosts: ``"host:slots,..."`` as for ``horarun -H`` (default ``localhost:<num_proc>``).
        hostfile: a host file, as for ``horarun --hostfile``.
        host_discovery_script: the command that prints the available hosts (elastic).
        start_timeout: seconds ranks wait for each other at start-up (default 30).
        ssh_port: the ssh port of every remote host.
        ssh_identity_file: the ssh private key for remote hosts.
        disable_cache: accepted for Horovod's programs; hora keeps no cache of host
            checks, so there is nothing to disable.
        output_filename: a directory to also write each rank's output into.
        verbose: print the rank placement and the rendezvous port.
        use_gloo: run on hora's own transport (its default; Horovod's Gloo controller).
        use_mpi: start the ranks with ``mpirun`` and carry the data over MPI
            (``horarun --mpi``).
        mpi_args: extra ``mpirun`` arguments (with ``use_mpi`` only).
        network_interface: deprecated: ``network_interfaces`` as one comma-separated string.
        network_interfaces: the interfaces ranks talk over (a list, or comma-separated).
        executable: the Python ranks run (default ``sys.executable``).
        np: deprecated: ``num_proc``.
        min_np: deprecated: ``min_num_proc``.
        max_np: deprecated: ``max_num_proc``.
        env: variables added to every rank's environment (hora's own).
        timeout: seconds after which the job is stopped; None waits forever (hora's
            own; not for an elastic job).

    Returns:
        The return values indexed by rank; for an elastic job, those of the ranks
        ``0 .. min_num_proc - 1`` of the last world (Horovod's rule).

    Raises:
        ValueError: a setting or the hosts are invalid, or settings contradict each
            other (``hosts`` and ``hostfile``, ``use_gloo`` and ``use_mpi``); nothing
            was started.
        RuntimeError: a rank failed; the message names the rank that failed first
            and shows its traceback, then how the other ranks ended.
        TimeoutError: ``timeout`` passed; the message names the ranks still running.

    Example::

        >>> hora.run(lambda x: x * int(os.environ["HORA_RANK"]), args=(10,), num_proc=3)
        [0, 10, 20]
    """
    import cloudpickle

    from hora.runner import task  # not at import time: ranks run it as __main__

    if network_interface:
        network_interfaces = network_interface
        warnings.warn("network_interface is deprecated, use network_interfaces instead", DeprecationWarning, 2)
    deprecated = (("np", "num_proc", np), ("min_np", "min_num_proc", min_np), ("max_np", "max_num_proc", max_np))
    for old, new, value in deprecated:
        if value is not None:
            warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning, 2)
    num_proc = num_proc if np is None else np
    min_num_proc = min_num_proc if min_np is None else min_np
    max_num_proc = max_num_proc if max_np is None else max_np
    if hosts is not None and hostfile is not None:
        raise ValueError("hora.run: give hosts or hostfile, not both")
    if use_gloo and use_mpi:
        raise ValueError("hora.run: use_gloo and use_mpi cannot both be True")
    if mpi_args is not None and not use_mpi:
        raise ValueError("hora.run: mpi_args applies to use_mpi=True only")
    for name, value in (("num_proc", num_proc), ("min_num_proc", min_num_proc), ("max_num_proc", max_num_proc)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"hora.run: {name}={value!r} is not valid: expected an integer >= 1")
    if num_proc is None:
        raise ValueError("hora.run: num_proc=None is not valid: expected an integer >= 1")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"hora.run: timeout={timeout!r} is not valid: expected a number of seconds > 0")
    interfaces = network_interfaces if isinstance(network_interfaces, str) else ",".join(network_interfaces or ())
    elastic = ElasticSettings(
        num_proc=num_proc,
        min_num_proc=min_num_proc,
        max_num_proc=max_num_proc,
        slots_per_host=slots,
        elastic_timeout=int(knobs.read("HORA_ELASTIC_TIMEOUT", os.environ)),
        reset_limit=reset_limit,
        blacklist_cooldown_range=None if cooldown_range is None else (int(cooldown_range[0]), int(cooldown_range[1])),
        host_discovery_script=host_discovery_script,
        hosts=hosts,
        hostfile=hostfile,
    )
    elastic.validate()
    if elastic.elastic and use_mpi:
        raise ValueError("hora.run: use_mpi cannot run an elastic job: MPI's world is fixed")
    if elastic.elastic and timeout is not None:
        raise ValueError("hora.run: timeout applies to a job that is not elastic")
    directory = tempfile.mkdtemp(prefix="hora-run-")
    try:
        with open(os.path.join(directory, task.PAYLOAD), "wb") as handle:
            cloudpickle.dump((func, tuple(args), dict(kwargs or {})), handle)
        with open(os.path.join(directory, task.SYS_PATH), "w", encoding="utf-8") as handle:
            json.dump([entry for entry in sys.path if isinstance(entry, str)], handle)
        settings = LaunchSettings(
            command=(executable or sys.executable, "-m", "hora.runner.task", directory),
            num_proc=num_proc,
            hosts=hosts,
            hostfile=hostfile,
            start_timeout=start_timeout,
            verbose=bool(verbose),
            output_filename=output_filename,
            env=env,
            ssh_port=ssh_port,
            ssh_identity_file=ssh_identity_file,
            network_interfaces=interfaces or None,
            mpi=bool(use_mpi),
            mpi_args=mpi_args,
            elastic=elastic if elastic.elastic else None,
        )
        name = callable_name(func)
        if settings.elastic is not None:
            return _run_elastic(settings, settings.elastic, directory, name)
        placed = prepare(settings)
        if settings.mpi:
            code = launch_mpi(settings, placed, settings.mpi_args)
            return _collect_by_code(code, len(placed), directory, name, f"mpirun failed with exit code {code}")
        job = Job(settings, placed, Sink(sys.stdout), Sink(sys.stderr), os.environ)
        result = job.run(timeout=timeout)
        return _collect(result, directory, name, timeout)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _run_elastic(settings: LaunchSettings, elastic: ElasticSettings, directory: str, name: str) -> list[Any]:
    """Runs an elastic ``hora.run`` job under ``horarun``'s elastic driver; returns its results.

    Raises:
        ValueError: the settings are invalid; nothing was started.
        RuntimeError: the job failed.
    """
    from hora.runner.elastic.driver import ElasticDriver

    check(settings)
    driver = ElasticDriver(settings, elastic, Sink(sys.stdout), Sink(sys.stderr), os.environ)
    outcome = driver.run()
    assert elastic.min_np is not None  # validated
    return _collect_by_code(outcome.exit_code, elastic.min_np, directory, name, outcome.reason)


def callable_name(func: Callable[..., Any]) -> str:
    """A function's name for messages: its qualified name, else its name, else its repr."""
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func))


def _collect(result: JobResult, directory: str, name: str, timeout: float | None) -> list[Any]:
    """Turns a finished job into results, or raises for the way it failed."""
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
            detail = _traceback(directory, result.first_failure)
        title = None if result.first_failure is None else f"traceback of rank {result.first_failure}"
        report = "\n".join(line.removeprefix("horarun: ") for line in failure_lines(result, detail, title))
        raise RuntimeError(f"hora.run: {name} failed on {size} ranks:\n{report}")
    return _results(directory, size, name)


def _collect_by_code(code: int, count: int, directory: str, name: str, how: str) -> list[Any]:
    """Results of a job known only by its exit code (under mpirun, or elastic), or the error.

    Args:
        code: the launcher's exit code.
        count: how many results to return (ranks ``0 .. count - 1``).
        directory: the job's directory.
        name: the function's name, for messages.
        how: how the job ended, for the message's first line.

    Raises:
        RuntimeError: ``code`` is not 0; the message shows the traceback of the
            lowest rank that wrote one.
    """
    if code == 0:
        return _results(directory, count, name)
    lines = [f"hora.run: {name} failed: {how}"]
    failed = sorted(
        int(entry.rpartition(".")[2])
        for entry in os.listdir(directory)
        if entry.startswith("error.") and entry.rpartition(".")[2].isdigit()
    )
    if failed:
        lines.append(f"traceback of rank {failed[0]}:")
        lines.extend("    " + line for line in _traceback(directory, failed[0]) or [])
    raise RuntimeError("\n".join(lines))


def _traceback(directory: str, rank: int) -> list[str] | None:
    """The traceback rank ``rank`` wrote, as lines, or None if it wrote none."""
    from hora.runner import task

    path = task.error_path(directory, rank)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read().rstrip("\n").splitlines()


def _results(directory: str, count: int, name: str) -> list[Any]:
    """The return values of ranks ``0 .. count - 1``.

    Raises:
        RuntimeError: a rank exited 0 without writing its result.
    """
    import cloudpickle

    from hora.runner import task

    values = []
    for rank in range(count):
        path = task.result_path(directory, rank)
        if not os.path.exists(path):
            raise RuntimeError(
                f"hora.run: rank {rank} exited with code 0 but returned no result from {name} "
                "(did it call sys.exit() or os._exit()?)"
            )
        with open(path, "rb") as handle:
            values.append(cloudpickle.load(handle))
    return values
