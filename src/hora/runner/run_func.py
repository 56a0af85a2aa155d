"""``hora.run``: call a Python function on every rank of a job and collect the results.

``horovod.run``'s signature and meaning: the function, its arguments and keyword
arguments are cloudpickled onto an authenticated key-value store that this process serves
for the job (as Horovod serves them from an HTTP store on the launcher), so ranks on any
host fetch them, and store their results, without a shared file system; each rank runs
``python -m hora.runner.task`` (``hora.runner.task``) through what ``horarun`` runs for
the same settings (its ``Job``; ``mpirun`` with ``use_mpi``; the elastic driver for an
elastic job), so ranks get the same environment, output forwarding and
stop-everything-on-failure behaviour. The return values come back in rank order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.config import knobs
from hora.runner.elastic.settings import ElasticSettings
from hora.runner.hosts import SlotInfo, is_local_host, parse_hostfile, parse_hosts
from hora.runner.job import Job, JobResult
from hora.runner.launch import check, prepare
from hora.runner.mpi_launch import launch_mpi
from hora.runner.output import Sink
from hora.runner.placement import ANY, LOOPBACK
from hora.runner.settings import LaunchSettings
from hora.runner.summary import failure_lines
from hora.transport import auth, netif
from hora.transport.rendezvous_server import RendezvousServer


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
    payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
    secret = auth.new_secret()
    store = RendezvousServer(secret, host=_store_bind(hosts, hostfile, elastic)).start()
    try:
        task.put_pieces(store.put, task.PAYLOAD, payload)
        task.put_pieces(store.put, task.SYS_PATH, json.dumps([e for e in sys.path if isinstance(e, str)]).encode())
        env = dict(env or {}, HORA_RUN_STORE_PORT=str(store.port), HORA_RUN_SECRET=secret.hex())
        settings = LaunchSettings(
            command=(executable or sys.executable, "-m", "hora.runner.task"),
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
            return _run_elastic(settings, settings.elastic, store, name)
        placed = prepare(settings)
        if settings.mpi:
            # mpirun's ranks get no launcher address from hora: name the store's.
            settings = dataclasses.replace(settings, env=dict(env, HORA_RUN_STORE_ADDR=_store_address(placed)))
            code = launch_mpi(settings, placed, settings.mpi_args)
            return _collect_by_code(code, len(placed), store, name, f"mpirun failed with exit code {code}")
        job = Job(settings, placed, Sink(sys.stdout), Sink(sys.stderr), os.environ)
        result = job.run(timeout=timeout)
        return _collect(result, store, name, timeout)
    finally:
        store.stop()


def _store_bind(hosts: str | None, hostfile: str | None, elastic: ElasticSettings) -> str:
    """Where the store listens: loopback when every rank runs here, as horarun's rendezvous.

    Raises:
        ValueError: the hosts are malformed (as ``horarun`` says it).
    """
    if elastic.host_discovery_script is not None:
        return ANY  # the script may name other hosts later
    listed = parse_hostfile(hostfile) if hostfile is not None else parse_hosts(hosts or "localhost")
    return LOOPBACK if all(is_local_host(host.name) for host in listed) else ANY


def _store_address(slots: Sequence[SlotInfo]) -> str:
    """The address ranks under mpirun reach the store at: loopback when every rank runs
    here, else this machine's address on the route to the first other host."""
    remote = [slot.hostname for slot in slots if not is_local_host(slot.hostname)]
    if not remote:
        return LOOPBACK
    source = netif.route_source(remote[0])
    if source is None:
        raise ValueError(f"hora.run: no address of this machine reaches host {remote[0]}: check the host's name")
    return source


def _run_elastic(settings: LaunchSettings, elastic: ElasticSettings, store: RendezvousServer, name: str) -> list[Any]:
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
    return _collect_by_code(outcome.exit_code, elastic.min_np, store, name, outcome.reason)


def callable_name(func: Callable[..., Any]) -> str:
    """A function's name for messages: its qualified name, else its name, else its repr."""
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func))


def _collect(result: JobResult, store: RendezvousServer, name: str, timeout: float | None) -> list[Any]:
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
            detail = _traceback(store, result.first_failure)
        title = None if result.first_failure is None else f"traceback of rank {result.first_failure}"
        report = "\n".join(line.removeprefix("horarun: ") for line in failure_lines(result, detail, title))
        raise RuntimeError(f"hora.run: {name} failed on {size} ranks:\n{report}")
    return _results(store, size, name)


def _collect_by_code(code: int, count: int, store: RendezvousServer, name: str, how: str) -> list[Any]:
    """Results of a job known only by its exit code (under mpirun, or elastic), or the error.

    Args:
        code: the launcher's exit code.
        count: how many results to return (ranks ``0 .. count - 1``).
        store: the job's store.
        name: the function's name, for messages.
        how: how the job ended, for the message's first line.

    Raises:
        RuntimeError: ``code`` is not 0; the message shows the traceback of the
            lowest rank that wrote one.
    """
    if code == 0:
        return _results(store, count, name)
    lines = [f"hora.run: {name} failed: {how}"]
    from hora.runner import task

    errors = [key.removesuffix("/count").removeprefix(task.store_key("error.")) for key in store.keys()]
    failed = sorted(int(rank) for rank in errors if rank.isdigit())
    if failed:
        lines.append(f"traceback of rank {failed[0]}:")
        lines.extend("    " + line for line in _traceback(store, failed[0]) or [])
    raise RuntimeError("\n".join(lines))


def _traceback(store: RendezvousServer, rank: int) -> list[str] | None:
    """The traceback rank ``rank`` stored, as lines, or None if it stored none."""
    from hora.runner import task

    text = task.get_pieces(store.get, task.error_name(rank))
    return None if text is None else text.decode("utf-8", errors="replace").rstrip("\n").splitlines()


def _results(store: RendezvousServer, count: int, name: str) -> list[Any]:
    """The return values of ranks ``0 .. count - 1``.

    Raises:
        RuntimeError: a rank exited 0 without storing its result.
    """
    import cloudpickle

    from hora.runner import task

    values = []
    for rank in range(count):
        data = task.get_pieces(store.get, task.result_name(rank))
        if data is None:
            raise RuntimeError(
                f"hora.run: rank {rank} exited with code 0 but returned no result from {name} "
                "(did it call sys.exit() or os._exit()?)"
            )
        values.append(cloudpickle.loads(data))
    return values
