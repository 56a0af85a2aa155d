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
from typing import TYPE_CHECKING, Any

from hora.config import knobs
from hora.runner.hosts import SlotInfo

if TYPE_CHECKING:  # the elastic driver imports this module
    from hora.runner.elastic.settings import ElasticSettings

DEFAULT_START_TIMEOUT: float = knobs.BY_NAME["HORA_START_TIMEOUT"].default
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
    """Knobs ``horarun``'s flags (or its config file) set, passed on to the ranks.

    Attributes:
        values: variable name (a knob of ``hora.config.knobs``) -> value, in the
            variable's units (bytes for ``HORA_FUSION_THRESHOLD``); a knob not named
            stays at what the ranks' environment says, else its default.
    """

    values: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        """Checks every value against what its knob accepts.

        Raises:
            ValueError: an unknown knob, or a value it does not accept, naming both.
        """
        for name, value in self.values.items():
            knob = knobs.BY_NAME.get(name)
            if knob is None:
                raise ValueError(f"{name} is not a knob: expected one of {', '.join(knobs.names())}")
            try:
                knob.kind.check(value)
            except (TypeError, ValueError):
                raise ValueError(f"{name}={value!r} is not valid: expected {knob.kind.accepted}") from None

    def env(self) -> dict[str, str]:
        """Returns the variables that carry the knobs that were set."""
        return {name: knobs.BY_NAME[name].kind.write(value) for name, value in self.values.items()}


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
        elastic: the elastic flags of an elastic job, else None.
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
    elastic: ElasticSettings | None = None

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
    # As horovodrun's Gloo launcher: these ranks move data with hora's own transport,
    # whatever Horovod variables the launching shell had (HORA_TRANSPORT still wins).
    env["HOROVOD_CONTROLLER"] = env["HOROVOD_CPU_OPERATIONS"] = "gloo"
    env["HORA_RENDEZVOUS_ADDR"] = rendezvous[0]
    env["HORA_RENDEZVOUS_PORT"] = str(rendezvous[1])
    env["HORA_SECRET"] = secret.hex()
    inherited = knobs.BY_NAME["HORA_START_TIMEOUT"].lookup(env) is not None
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
