"""hora's configuration, read from the environment in this one place.

Every variable is declared in ``hora.config.knobs`` (its name, Horovod's aliases, kind,
default, flag and meaning); ``Config.from_env`` reads the knobs that fill a field, and
the job's topology, which is checked as a whole. A bad value raises ``ValueError``
naming the variable, the value and what is accepted.

Only the launcher writes these variables, and only into its children's environment.

Without ``HORA_RANK``/``HORA_SIZE``, the topology comes from ``mpirun`` (Open MPI,
MPICH), Slurm ``srun`` or torchrun-style variables (``hora.config.launchers``), and rank 0
runs the rendezvous server. The secret then comes from ``HORA_SECRET`` (or
``HORA_SECRET_FILE``), or under ``mpirun`` with mpi4py installed, from rank 0 through MPI.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
import socket
from collections.abc import Mapping
from typing import Any

from hora.config import knobs, launchers
from hora.config.knobs import DEFAULT_FUSION_THRESHOLD

__all__ = ["DEFAULT_FUSION_THRESHOLD", "LAUNCHERS", "Config", "Extras", "Topology", "mpi4py_available",
           "ssh_options"]  # fmt: skip

# The knobs autotune tunes unless they are set (Config.autotune_fixed).
AUTOTUNED = ("HORA_FUSION_THRESHOLD", "HORA_CYCLE_TIME", "HORA_SHM_STAGING_MB")
# Where a job's topology came from (Config.launcher).
LAUNCHERS = ("none", "horarun", "openmpi", "mpich", "slurm", "torchrun")


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits in the job.

    Invariants: ``0 <= rank < size``, ``0 <= local_rank < local_size``,
    ``0 <= cross_rank < cross_size``.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    hostname: str = "localhost"


@dataclasses.dataclass(frozen=True)
class Extras:
    """Horovod knobs read and validated, for parts hora does not have (yet).

    ``unsupported()`` names the ones set to something other than their default, so
    ``init()`` can say that they have no effect instead of ignoring them silently.
    """

    torus_allreduce: bool = False
    num_nccl_streams: int = 1
    mpi_threads_disable: bool = False

    def unsupported(self) -> list[str]:
        """The ``HORA_*`` names of the knobs set away from their defaults."""
        return [
            knob.name
            for knob in knobs.KNOBS
            if knob.field is not None
            and knob.field.startswith("extras.")
            and getattr(self, knob.field.removeprefix("extras.")) != knob.default
        ]


@dataclasses.dataclass(frozen=True)
class Config:
    """Every setting hora reads from the environment, validated.

    ``launcher`` says where the topology came from (one of ``LAUNCHERS``). Under
    ``horarun`` the launcher runs the rendezvous server; under the others rank 0 runs
    it (``host_rendezvous``), and with ``mpi_bootstrap`` the server's address, port and
    the job secret that the environment did not give are created by rank 0 and
    broadcast through MPI (mpi4py) at ``init()``.
    """

    topology: Topology = Topology()
    launcher: str = "none"
    host_rendezvous: bool = False
    mpi_bootstrap: bool = False
    exact_cross: bool = True
    rendezvous_addr: str | None = None
    rendezvous_port: int | None = None
    agent_store: launchers.AgentStore | None = None  # torchrun: where rank 0 publishes rendezvous_port
    # init(comm=<an mpi4py sub-communicator>): the communicator the job runs over (its own
    # duplicate); None: MPI's world, where MPI started the job (hora.core.mpi_comm).
    mpi_comm: Any = dataclasses.field(default=None, repr=False, compare=False)
    secret: bytes | None = dataclasses.field(default=None, repr=False)
    iface: str | None = None
    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
    cycle_time_ms: float = 0.0
    cache_capacity: int = 1024
    ride_bytes: int = 4096
    socket_buffer_bytes: int = 0  # 0: the kernel's autotuning
    spin_us: int | None = None  # None: chosen by the machine's ranks and cores (engine.waiting)
    stall_check_disable: bool = False
    stall_check_time_seconds: float = 60.0
    stall_shutdown_time_seconds: float = 0.0
    log_level: str = "WARNING"
    log_hide_time: bool = False
    dynamic_process_sets: bool = False
    elastic: bool = False
    elastic_timeout: float = 600.0
    elastic_generation: int | None = None
    start_timeout: float = 30.0
    disable_group_fusion: bool = False
    gradient_overlap: bool | None = None  # None: chosen by the job's layout and the CPUs (core.api)
    extras: Extras = Extras()
    hierarchical_allreduce: bool | None = None
    hierarchical_allgather: bool | None = None
    thread_affinity: tuple[int, ...] = ()
    timeline: str | None = None
    timeline_mark_cycles: bool = False
    transport: str = "builtin"
    shared_memory: bool = True
    shm_staging_bytes: int | None = None  # None: chosen by the machine's ranks and cores
    autotune: bool = False
    autotune_log: str | None = None
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_bayes_opt_max_samples: int = 20
    autotune_gaussian_process_noise: float = 0.8
    # The knobs autotune may tune that the environment set: those stay as set.
    autotune_fixed: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """Reads and validates the configuration.

        Args:
            environ: the variables to read; ``os.environ`` when None.

        Returns:
            The configuration.

        Raises:
            ValueError: a variable has a value outside what it accepts, or the
                topology variables contradict each other, naming the variables.
        """
        variables = os.environ if environ is None else environ
        secret = _read_secret(variables)
        launch = None if _horarun_topology(variables) else launchers.detect(variables)
        if launch is None:
            topology = _read_topology(variables)
            rendezvous_addr = knobs.read("HORA_RENDEZVOUS_ADDR", variables)
            rendezvous_port = knobs.read("HORA_RENDEZVOUS_PORT", variables) or None
            launcher = "horarun" if topology.size > 1 or _horarun_topology(variables) else "none"
            host_rendezvous, exact_cross = False, True
            agent_store = None
        else:
            hostname = knobs.read("HORA_HOSTNAME", variables) or launch.hostname or socket.gethostname()
            topology = Topology(
                launch.rank,
                launch.size,
                launch.local_rank,
                launch.local_size,
                launch.cross_rank,
                launch.cross_size,
                hostname,
            )
            rendezvous_addr, rendezvous_port = launch.rendezvous_addr, launch.rendezvous_port
            agent_store = launch.agent_store
            launcher, host_rendezvous, exact_cross = launch.launcher, True, launch.exact_cross
        mpi_bootstrap = (
            launch is not None
            and launch.is_mpi
            and launch.size > 1
            and (secret is None or rendezvous_addr is None or rendezvous_port is None)
        )
        fields, extras = _read_fields(variables)
        config = cls(
            topology=topology,
            launcher=launcher,
            host_rendezvous=host_rendezvous,
            mpi_bootstrap=mpi_bootstrap,
            exact_cross=exact_cross,
            rendezvous_addr=rendezvous_addr,
            rendezvous_port=rendezvous_port,
            agent_store=agent_store,
            secret=secret,
            extras=Extras(**extras),
            autotune_fixed=tuple(
                name for name in AUTOTUNED if knobs.BY_NAME[name].lookup(variables) is not None
            ),
            **fields,
        )
        config.check_launch()
        return config

    def check_launch(self) -> None:
        """Checks that a multi-process job has what it needs to connect its ranks.

        Raises:
            ValueError: size > 1 without a rendezvous address or secret (for the
                launcher at hand: the message names the variables and the fix).
        """
        if self.topology.size == 1:
            return
        if self.launcher != "horarun":
            self._check_other_launcher()
            return
        missing = [
            name
            for name, value in (
                ("HORA_RENDEZVOUS_ADDR", self.rendezvous_addr),
                ("HORA_RENDEZVOUS_PORT", self.rendezvous_port),
                ("HORA_SECRET", self.secret),
            )
            if value is None
        ]
        if missing:
            raise ValueError(
                f"HORA_SIZE={self.topology.size} but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set: start multi-process jobs "
                "with horarun (or set the rendezvous address, port and job secret yourself)"
            )


    def _check_other_launcher(self) -> None:
        size = self.topology.size
        where = {
            "openmpi": "mpirun",
            "mpich": "mpiexec",
            "slurm": "srun",
            "torchrun": "a torchrun-style launcher",
        }[self.launcher]
        if self.mpi_bootstrap:
            if not mpi4py_available():
                missing = "HORA_SECRET" if self.secret is None else "HORA_RENDEZVOUS_PORT (or MASTER_PORT)"
                if self.secret is not None and self.topology.local_size != size:
                    missing = "HORA_RENDEZVOUS_ADDR and HORA_RENDEZVOUS_PORT (or MASTER_ADDR and MASTER_PORT)"
                verb = "are" if " and " in missing else "is"
                raise ValueError(
                    f"{size} ranks started by {where}, but {missing} {verb} not set and mpi4py is not installed: "
                    f"pip install mpi4py (rank 0 then shares what is missing through MPI), or set {missing} "
                    "for every rank (export it and pass it with -x NAME for Open MPI, -genvall for MPICH); "
                    "see docs/launching.md"
                )
            return
        if self.secret is None:
            raise ValueError(
                f"{size} ranks started by {where}, but HORA_SECRET is not set: every rank needs the same job "
                "secret; export HORA_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))') "
                "before starting the job (or HORA_SECRET_FILE=<file holding it>); see docs/launching.md"
            )
        unset = [
            name
            for name, value in (
                ("MASTER_ADDR", self.rendezvous_addr),
                ("MASTER_PORT", self.rendezvous_port if self.agent_store is None else self.agent_store.port),
            )
            if value is None
        ]
        if unset:
            raise ValueError(
                f"{size} ranks started by {where}, but {' and '.join(unset)} "
                f"{'is' if len(unset) == 1 else 'are'} not set: rank 0 hosts hora's rendezvous there; "
                "set MASTER_ADDR to rank 0's host and MASTER_PORT to a free port (or HORA_RENDEZVOUS_ADDR/_PORT)"
            )


def mpi4py_available() -> bool:
    """True when mpi4py can be imported (it is not imported here: that starts MPI)."""
    try:
        return importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):
        return False


def _horarun_topology(environ: Mapping[str, str]) -> bool:
    return any(knobs.BY_NAME[name].lookup(environ) is not None for name in ("HORA_RANK", "HORA_SIZE"))


def _read_fields(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reads every knob that fills a field: (``Config``'s fields, ``Extras``'s fields)."""
    fields: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for knob in knobs.KNOBS:
        if knob.field is None:
            continue
        value = knob.read(environ)
        if value is not None and knob.field_unit != 1:
            value *= knob.field_unit
        if knob.field.startswith("extras."):
            extras[knob.field.removeprefix("extras.")] = value
        else:
            fields[knob.field] = value
    return fields, extras


def _read_secret(environ: Mapping[str, str]) -> bytes | None:
    secret_hex = knobs.read("HORA_SECRET", environ)
    source = "HORA_SECRET"
    if secret_hex is None:
        path = knobs.read("HORA_SECRET_FILE", environ)
        if path is None:
            return None
        source = f"HORA_SECRET_FILE={path}"
        try:
            with open(path, encoding="ascii") as handle:
                secret_hex = handle.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{source}: cannot read the job secret: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        raise ValueError(f"{source} is not valid: expected a hex string (value not shown)") from None
    if len(secret) < 16:
        raise ValueError(f"{source} is not valid: expected at least 16 bytes (32 hex digits)")
    return secret


def ssh_options(environ: Mapping[str, str] | None = None) -> list[str]:
    """Returns ``HORA_SSH_OPTIONS`` split as a shell would (the launcher's extra ssh options).

    Raises:
        ValueError: the value is not valid shell quoting.
    """
    text = knobs.read("HORA_SSH_OPTIONS", os.environ if environ is None else environ) or ""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"HORA_SSH_OPTIONS={text!r} is not valid: {exc}") from None


def _read_topology(environ: Mapping[str, str]) -> Topology:
    def read(name: str, default: int) -> int:
        return int(knobs.read(name, environ, default))

    size = read("HORA_SIZE", 1)
    rank = read("HORA_RANK", 0)
    # Without local variables the job is taken to run on one host.
    local_size = read("HORA_LOCAL_SIZE", size)
    local_rank = read("HORA_LOCAL_RANK", rank)
    cross_size = read("HORA_CROSS_SIZE", 1)
    cross_rank = read("HORA_CROSS_RANK", 0)
    for name, value, bound, bound_name in (
        ("HORA_RANK", rank, size, "HORA_SIZE"),
        ("HORA_LOCAL_RANK", local_rank, local_size, "HORA_LOCAL_SIZE"),
        ("HORA_CROSS_RANK", cross_rank, cross_size, "HORA_CROSS_SIZE"),
    ):
        if value >= bound:
            raise ValueError(f"{name}={value} is not valid: expected an integer in [0, {bound_name}={bound})")
    hostname = knobs.read("HORA_HOSTNAME", environ) or socket.gethostname()
    return Topology(rank, size, local_rank, local_size, cross_rank, cross_size, hostname)
