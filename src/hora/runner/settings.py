"""What a launch needs to know, and the environment each rank is started with.

``LaunchSettings`` holds everything ``horarun`` (or ``hora.run``) was asked to do;
``rank_env`` turns it, one rank's ``SlotInfo`` and the job's rendezvous endpoint and
secret into that rank's environment:

* the parent's environment, then ``LaunchSettings.env`` on top;
* the topology: ``HORA_RANK``, ``HORA_SIZE``, ``HORA_LOCAL_RANK``, ``HORA_LOCAL_SIZE``,
  ``HORA_CROSS_RANK``, ``HORA_CROSS_SIZE``, ``HORA_HOSTNAME``, and the same under
  Horovod's ``HOROVOD_*`` names, for scripts that read them;
* ``HORA_RENDEZVOUS_ADDR``, ``HORA_RENDEZVOUS_PORT``, ``HORA_SECRET`` (hex) and
  ``HORA_START_TIMEOUT``;
* the tuning flags (``Tuning``) as the variables ``hora.config`` reads, and
  ``--network-interfaces`` as ``HORA_IFACE``;
* ``PYTHONUNBUFFERED=1`` unless already set, so ranks' output arrives line by line.

A rank on another host does not inherit ``horarun``'s whole environment (its host has
its own ``HOME``, ``TMPDIR``, ...). ``remote_env`` forwards what a rank needs: the
variables above, ``PATH``, ``PYTHONPATH``, ``PYTHON*``, the virtualenv or conda prefix,
``LD_LIBRARY_PATH``, the locale (``LANG``, ``LC_*``), ``OMP_NUM_THREADS``, every ``HORA_*``
and ``HOROVOD_*`` variable, and the names given with ``-x NAME``; ``-x NAME=VALUE`` and
``--env NAME=VALUE`` set a variable for every rank, here or remote.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

from hora import config
from hora.runner.hosts import SlotInfo

DEFAULT_START_TIMEOUT = 30.0
# What a remote rank gets from horarun's environment besides what horarun sets.
FORWARDED = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "LD_LIBRARY_PATH",
             "LANG", "LANGUAGE", "OMP_NUM_THREADS", "TZ")  # fmt: skip
FORWARDED_PREFIXES = ("HORA_", "HOROVOD_", "PYTHON", "LC_")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_assignment(text: str, flag: str) -> tuple[str, str | None]:
    """Parses ``NAME`` or ``NAME=VALUE`` (``-x``, ``--env``).

    Raises:
        ValueError: the name is not a valid variable name; names the flag.
    """
    name, equals, value = text.partition("=")
    if not _NAME.fullmatch(name):
        raise ValueError(f"{flag} {text!r} is not valid: expected NAME or NAME=VALUE with a variable name")
    return name, value if equals else None


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The runtime knobs ``horarun`` takes as flags; None leaves a knob at its default.

    Attributes:
        fusion_threshold_mb: ``--fusion-threshold-mb`` (MiB; 0 disables fusion).
        cycle_time_ms: ``--cycle-time-ms``.
        cache_capacity: ``--cache-capacity`` (entries).
        disable_cache: ``--disable-cache`` (capacity 0).
        no_stall_check: ``--no-stall-check``.
        stall_check_warning_time_seconds: ``--stall-check-warning-time-seconds``.
        stall_check_shutdown_time_seconds: ``--stall-check-shutdown-time-seconds``.
        log_level: ``--log-level`` (one of ``hora.config.LOG_LEVELS``).
        log_without_timestamp: ``--log-without-timestamp``.
        extra: further ``HORA_*`` variables set by flags that only pass a value on
            (timeline, autotune, hierarchical algorithms, ...).
    """

    fusion_threshold_mb: float | None = None
    cycle_time_ms: float | None = None
    cache_capacity: int | None = None
    disable_cache: bool = False
    no_stall_check: bool = False
    stall_check_warning_time_seconds: float | None = None
    stall_check_shutdown_time_seconds: float | None = None
    log_level: str | None = None
    log_without_timestamp: bool = False
    extra: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        """Checks every value against what the runtime accepts.

        Raises:
            ValueError: a value is out of range, naming the flag and the value.
        """
        for flag, value in (
            ("--fusion-threshold-mb", self.fusion_threshold_mb),
            ("--cycle-time-ms", self.cycle_time_ms),
            ("--cache-capacity", self.cache_capacity),
            ("--stall-check-shutdown-time-seconds", self.stall_check_shutdown_time_seconds),
        ):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{flag}={value} is not valid: expected a number >= 0")
        warning = self.stall_check_warning_time_seconds
        if warning is not None and not (math.isfinite(warning) and warning > 0):
            raise ValueError(f"--stall-check-warning-time-seconds={warning} is not valid: expected a number > 0")
        if self.log_level is not None and self.log_level.upper() not in config.LOG_LEVELS:
            raise ValueError(
                f"--log-level={self.log_level} is not valid: expected one of {', '.join(config.LOG_LEVELS)}"
            )

    def env(self) -> dict[str, str]:
        """Returns the ``HORA_*`` variables that carry the knobs that were set."""
        env: dict[str, str] = {}
        if self.fusion_threshold_mb is not None:
            env["HORA_FUSION_THRESHOLD"] = str(int(self.fusion_threshold_mb * 1024 * 1024))
        if self.cycle_time_ms is not None:
            env["HORA_CYCLE_TIME"] = repr(float(self.cycle_time_ms))
        if self.cache_capacity is not None:
            env["HORA_CACHE_CAPACITY"] = str(self.cache_capacity)
        if self.disable_cache:
            env["HORA_CACHE_CAPACITY"] = "0"
        if self.no_stall_check:
            env["HORA_STALL_CHECK_DISABLE"] = "1"
        if self.stall_check_warning_time_seconds is not None:
            env["HORA_STALL_CHECK_TIME_SECONDS"] = repr(float(self.stall_check_warning_time_seconds))
        if self.stall_check_shutdown_time_seconds is not None:
            env["HORA_STALL_SHUTDOWN_TIME_SECONDS"] = repr(float(self.stall_check_shutdown_time_seconds))
        if self.log_level is not None:
            env["HORA_LOG_LEVEL"] = self.log_level.upper()
        if self.log_without_timestamp:
            env["HORA_LOG_HIDE_TIME"] = "1"
        env.update(self.extra)
        return env


@dataclasses.dataclass(frozen=True)
class LaunchSettings:
    """One launch: what to run, where, and how.

    Attributes:
        command: the program and its arguments, run once per rank.
        num_proc: the number of ranks.
        hosts: the ``-H/--hosts`` value, or None.
        hostfile: the ``--hostfile`` path, or None.
        start_timeout: seconds ranks wait for each other at rendezvous; None takes
            ``HORA_START_TIMEOUT`` (or its Horovod aliases) from the environment, else 30.
        verbose: print the slot assignment and the rendezvous port.
        output_filename: a directory to also write each rank's output into.
        prefix_timestamp: put a timestamp before each forwarded line's prefix.
        tuning: runtime knobs to pass on.
        env: variables added to every rank's environment (over the parent's).
        forward_env: names of variables of this environment to forward to remote
            ranks (``-x NAME``).
        ssh_port: ``-p/--ssh-port``.
        ssh_identity_file: ``-i/--ssh-identity-file``.
        network_interfaces: ``--network-interfaces`` (comma-separated names).
        mpi: ``--mpi``: start the ranks with ``mpirun``, MPI carrying the data.
        mpi_args: ``--mpi-args`` and ``--binding-args``: extra ``mpirun`` arguments.
    """

    command: tuple[str, ...]
    num_proc: int
    hosts: str | None = None
    hostfile: str | None = None
    start_timeout: float | None = None
    verbose: bool = False
    output_filename: str | None = None
    prefix_timestamp: bool = False
    tuning: Tuning = Tuning()
    env: Mapping[str, str] | None = None
    forward_env: tuple[str, ...] = ()
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    network_interfaces: str | None = None
    mpi: bool = False
    mpi_args: str | None = None

    def validate(self) -> None:
        """Checks the settings that do not need the hosts.

        Raises:
            ValueError: no command, ``num_proc`` below 1, a start timeout that is not
                a positive number, or a bad tuning value; the message names the flag.
        """
        if not self.command:
            raise ValueError("no command given: expected horarun -np N COMMAND [ARGS...]")
        if self.num_proc < 1:
            raise ValueError(f"-np/--num-proc={self.num_proc} is not valid: expected an integer >= 1")
        timeout = self.start_timeout
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"--start-timeout={timeout} is not valid: expected a number of seconds > 0")
        if self.ssh_port is not None and not 1 <= self.ssh_port <= 65535:
            raise ValueError(f"-p/--ssh-port={self.ssh_port} is not valid: expected a port in [1, 65535]")
        if self.network_interfaces is not None and not self.network_interfaces.replace(",", "").strip():
            raise ValueError("--network-interfaces names no interface: expected e.g. eth0 or eth0,eth1")
        self.tuning.validate()


def topology_env(slot: SlotInfo) -> dict[str, str]:
    """Returns one rank's topology variables, under hora's and Horovod's names.

    Args:
        slot: the rank's place in the job.

    Returns:
        ``HORA_RANK`` ... ``HORA_HOSTNAME`` and ``HOROVOD_RANK`` ... ``HOROVOD_HOSTNAME``.
    """
    values = {
        "RANK": str(slot.rank),
        "SIZE": str(slot.size),
        "LOCAL_RANK": str(slot.local_rank),
        "LOCAL_SIZE": str(slot.local_size),
        "CROSS_RANK": str(slot.cross_rank),
        "CROSS_SIZE": str(slot.cross_size),
        "HOSTNAME": slot.hostname,
    }
    env = {f"HORA_{key}": value for key, value in values.items()}
    env.update({f"HOROVOD_{key}": value for key, value in values.items()})
    return env


def rank_env(
    base: Mapping[str, str],
    settings: LaunchSettings,
    slot: SlotInfo,
    rendezvous: tuple[str, int],
    secret: bytes,
) -> dict[str, str]:
    """Builds the environment one rank on this machine is started with.

    Args:
        base: the parent's environment.
        settings: the launch settings (their ``env`` goes over ``base``).
        slot: the rank's place in the job.
        rendezvous: the rendezvous server's address and port.
        secret: the job secret (passed as hex; never printed).

    Returns:
        The complete environment for the rank's process.
    """
    return _with_job(dict(base), settings, slot, rendezvous, secret)


def remote_env(
    base: Mapping[str, str],
    settings: LaunchSettings,
    slot: SlotInfo,
    rendezvous: tuple[str, int],
    secret: bytes,
) -> dict[str, str]:
    """Builds what a rank on another host gets over its login environment there.

    Args: as ``rank_env``.

    Returns:
        The forwarded variables (see the module docstring) and the job's.
    """
    names = set(settings.forward_env)
    env = {
        name: value
        for name, value in base.items()
        if name in FORWARDED or name in names or name.startswith(FORWARDED_PREFIXES)
    }
    env.pop("HORA_SSH_OPTIONS", None)
    return _with_job(env, settings, slot, rendezvous, secret)


def forwarded_missing(base: Mapping[str, str], names: Sequence[str]) -> list[str]:
    """The ``-x NAME`` names that ``base`` does not set."""
    return [name for name in names if name not in base]


def _with_job(
    env: dict[str, str],
    settings: LaunchSettings,
    slot: SlotInfo,
    rendezvous: tuple[str, int],
    secret: bytes,
) -> dict[str, str]:
    env.update(settings.env or {})
    env.update(topology_env(slot))
    env["HORA_RENDEZVOUS_ADDR"] = rendezvous[0]
    env["HORA_RENDEZVOUS_PORT"] = str(rendezvous[1])
    env["HORA_SECRET"] = secret.hex()
    inherited = any(name in env for name in ("HORA_START_TIMEOUT", *config.ALIASES["HORA_START_TIMEOUT"]))
    if settings.start_timeout is not None:
        env["HORA_START_TIMEOUT"] = repr(float(settings.start_timeout))
    elif not inherited:
        env["HORA_START_TIMEOUT"] = repr(DEFAULT_START_TIMEOUT)
    env.update(settings.tuning.env())
    if settings.network_interfaces is not None:
        interfaces = ",".join(name.strip() for name in settings.network_interfaces.split(",") if name.strip())
        env["HORA_IFACE"] = env["HOROVOD_GLOO_IFACE"] = interfaces
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
