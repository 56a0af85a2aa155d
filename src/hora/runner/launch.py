"""``launch``: run a command on every rank of a job and return the launcher's exit code.

This is ``horarun`` without the command line: ``cli.main`` parses flags into
``LaunchSettings`` and calls ``launch``; ``hora.run`` builds settings of its own and
runs a ``Job`` through ``prepare`` the same way.

Exit codes: 0 when every rank exited 0; the exit code of the rank that failed first
(128 + the signal number when a signal ended it); 128 + signum when ``horarun`` was
interrupted (130 for Ctrl-C, 143 for SIGTERM); 127 when a rank could not be started;
``HOSTS_FAILED`` (1) when a host cannot take part (nothing was started; one line per
host on stderr). Every failure prints a summary on stderr that names the root cause
first (``hora.runner.summary``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence

from hora.runner import cpu_binding, hosts
from hora.runner.hosts import SlotInfo
from hora.runner.elastic.settings import ElasticSettings
from hora.runner.job import Job
from hora.runner.mpi_launch import launch_mpi
from hora.runner.output import Sink
from hora.runner.placement import HostsError, Placement, plan_placement
from hora.runner.settings import LaunchSettings, forwarded_missing
from hora.runner.ssh import HostInfo, SshSettings, probe_hosts
from hora.runner.summary import failure_lines

HOSTS_FAILED = 1


def prepare(settings: LaunchSettings) -> list[SlotInfo]:
    """Validates the settings, places the ranks and creates the output directory.

    Args:
        settings: the launch settings.

    Returns:
        Where each rank runs, by rank.

    Raises:
        ValueError: a setting is invalid, the hosts are malformed or have too few
            slots, or the output directory cannot be created.
    """
    check(settings)
    return hosts.plan(settings.num_proc, settings.hosts, settings.hostfile)


def check(settings: LaunchSettings) -> None:
    """Checks what does not depend on the hosts and creates the output directory.

    Raises:
        ValueError: as ``prepare``.
    """
    settings.validate()
    cpu_binding.requested({**os.environ, **settings.tuning.env()})  # a bad HORA_BIND_TO fails here
    missing = forwarded_missing(os.environ, settings.forward_env)
    if missing:
        raise ValueError(
            f"-x {missing[0]}: {missing[0]} is not set in horarun's environment: set it, or give its value "
            f"as -x {missing[0]}=VALUE"
        )
    if settings.output_filename is not None:
        try:
            os.makedirs(settings.output_filename, exist_ok=True)
        except OSError as exc:
            raise ValueError(
                f"--output-filename: cannot create the directory {settings.output_filename!r}: {exc.strerror or exc}"
            ) from None


def _launch_elastic(settings: LaunchSettings, elastic: ElasticSettings, is_local: Callable[[str], bool]) -> int:
    """Runs an elastic job under ``hora.runner.elastic.driver``; returns its exit code.

    Raises:
        ValueError: the settings are invalid; nothing was started.
    """
    from hora.runner.elastic.driver import ElasticDriver

    check(settings)
    driver = ElasticDriver(settings, elastic, Sink(sys.stdout), Sink(sys.stderr), os.environ, is_local=is_local)
    return driver.run(handle_signals=True).exit_code


def place(
    settings: LaunchSettings,
    slots: Sequence[SlotInfo],
    is_local: Callable[[str], bool] = hosts.is_local_host,
    probe: Callable[[Sequence[str], SshSettings], Mapping[str, HostInfo | str]] = probe_hosts,
) -> Placement:
    """Works out how to reach every host (probing remote ones over ssh).

    Raises:
        ValueError: a bad ssh setting.
        HostsError: a host cannot take part (one line per host).
    """
    ssh = SshSettings.from_env(settings.ssh_port, settings.ssh_identity_file)
    return plan_placement(slots, ssh, is_local, probe)


def launch(settings: LaunchSettings, is_local: Callable[[str], bool] = hosts.is_local_host) -> int:
    """Runs ``settings.command`` on every rank and waits for the job to end.

    Output of every rank is forwarded to this process's stdout and stderr with
    ``[<rank>]<stdout>:`` / ``[<rank>]<stderr>:`` prefixes. When a rank fails, every
    other rank is stopped (SIGTERM, then SIGKILL after ``job.GRACE_PERIOD`` seconds)
    and a summary naming the failed rank first is printed on stderr. In the main
    thread, SIGINT, SIGTERM and SIGHUP stop every rank the same way.

    Args:
        settings: what to run, where and how.
        is_local: tells whether a host name names this machine.

    Returns:
        The exit code (see the module docstring).

    Raises:
        ValueError: the settings or the hosts are invalid; nothing was started.
    """
    if settings.elastic is not None:
        return _launch_elastic(settings, settings.elastic, is_local)
    slots = prepare(settings)
    if settings.mpi:
        return launch_mpi(settings, slots, settings.mpi_args)
    stderr = Sink(sys.stderr)
    try:
        placement = place(settings, slots, is_local)
    except HostsError as exc:
        for line in exc.lines:
            stderr.line(f"horarun: error: {line}")
        return HOSTS_FAILED
    here = [slot.local_size for slot in slots if is_local(slot.hostname)]
    if here and cpu_binding.requested({**os.environ, **settings.tuning.env()}):
        warning = cpu_binding.unbound_warning(here[0])
        if warning is not None:
            stderr.line(warning)
    job = Job(settings, slots, Sink(sys.stdout), stderr, os.environ, placement=placement)
    result = job.run(handle_signals=True)
    for line in failure_lines(result):
        stderr.line(line)
    return result.exit_code
