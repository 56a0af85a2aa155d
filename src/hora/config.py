"""hora's configuration, read from the environment in this one place.

Every knob is a ``HORA_*`` variable; where Horovod has the same knob, its
``HOROVOD_*`` name is accepted as an alias (``HORA_*`` wins when both are set), so a
job configured for Horovod keeps its settings. Values are validated here: a bad
value raises ``ValueError`` naming the variable, the value and what is accepted.

Only the launcher writes these variables, and only into its children's environment.

Runtime knobs
    ``HORA_FUSION_THRESHOLD`` (bytes, default 128 MiB; 0 disables fusion),
    ``HORA_CYCLE_TIME`` (ms to wait for more tensors before negotiating; default 0),
    ``HORA_CACHE_CAPACITY`` (default 1024), ``HORA_STALL_CHECK_DISABLE``,
    ``HORA_STALL_CHECK_TIME_SECONDS`` (60), ``HORA_STALL_SHUTDOWN_TIME_SECONDS`` (0 = never),
    ``HORA_LOG_LEVEL`` (WARNING), ``HORA_LOG_HIDE_TIME``, ``HORA_DYNAMIC_PROCESS_SETS``,
    ``HORA_ELASTIC``, ``HORA_START_TIMEOUT`` (30 s), ``HORA_DISABLE_GROUP_FUSION``,
    ``HORA_TRANSPORT`` (``builtin``: hora's shared memory and TCP; ``mpi``: collectives
    through mpi4py, for jobs started by mpirun),
    ``HORA_SHARED_MEMORY`` (1: ranks on one machine move data through shared memory),
    ``HORA_SHM_STAGING_MB`` (2, or 16 with more local ranks than cores: each rank's shared staging buffer),
    ``HORA_HIERARCHICAL_ALLREDUCE``, ``HORA_HIERARCHICAL_ALLGATHER`` (unset: chosen per
    process set; 1/0: force on/off),
    ``HORA_THREAD_AFFINITY`` (one CPU core per local rank for the engine thread),
    ``HORA_TIMELINE`` (a file rank 0 writes a Chrome trace to; ``DYNAMIC``: none until
    ``start_timeline``), ``HORA_TIMELINE_MARK_CYCLES``.

Read and validated, without effect (``init()`` warns when they are set)
    ``HORA_AUTOTUNE`` (and its
    ``_LOG``, ``_WARMUP_SAMPLES``, ``_STEPS_PER_SAMPLE``, ``_BAYES_OPT_MAX_SAMPLES``,
    ``_GAUSSIAN_PROCESS_NOISE``), ``HORA_TORUS_ALLREDUCE``, ``HORA_NUM_NCCL_STREAMS``, ``HORA_MPI_THREADS_DISABLE``.

Job topology (set by ``horarun``)
    ``HORA_RANK``, ``HORA_SIZE``, ``HORA_LOCAL_RANK``, ``HORA_LOCAL_SIZE``,
    ``HORA_CROSS_RANK``, ``HORA_CROSS_SIZE``, ``HORA_HOSTNAME``,
    ``HORA_RENDEZVOUS_ADDR``, ``HORA_RENDEZVOUS_PORT``, ``HORA_SECRET`` (hex; or
    ``HORA_SECRET_FILE``, a file that holds it), ``HORA_IFACE`` (comma-separated network
    interfaces: the first one this host has is the one the rank binds and advertises).

Other launchers
    Without ``HORA_RANK``/``HORA_SIZE``, the topology comes from ``mpirun`` (Open MPI,
    MPICH), Slurm ``srun`` or torchrun-style variables (``hora.launchers``), and rank 0
    runs the rendezvous server. The secret then comes from ``HORA_SECRET`` (or
    ``HORA_SECRET_FILE``), or under ``mpirun`` with mpi4py installed, from rank 0 through MPI.

Launcher side (read by ``horarun``, not by ranks)
    ``HORA_SSH_OPTIONS``: extra ``ssh`` options, e.g. ``-F ~/.ssh/cluster_config``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
import socket
from collections.abc import Callable, Mapping
from typing import TypeVar

from hora import launchers

T = TypeVar("T")

DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024

# HORA_* name -> Horovod's names for the same knob, in order of preference.
ALIASES: dict[str, tuple[str, ...]] = {
    "HORA_FUSION_THRESHOLD": ("HOROVOD_FUSION_THRESHOLD",),
    "HORA_CYCLE_TIME": ("HOROVOD_CYCLE_TIME",),
    "HORA_CACHE_CAPACITY": ("HOROVOD_CACHE_CAPACITY",),
    "HORA_STALL_CHECK_DISABLE": ("HOROVOD_STALL_CHECK_DISABLE",),
    "HORA_STALL_CHECK_TIME_SECONDS": ("HOROVOD_STALL_CHECK_TIME_SECONDS",),
    "HORA_STALL_SHUTDOWN_TIME_SECONDS": ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",),
    "HORA_LOG_LEVEL": ("HOROVOD_LOG_LEVEL",),
    "HORA_LOG_HIDE_TIME": ("HOROVOD_LOG_HIDE_TIME",),
    "HORA_DYNAMIC_PROCESS_SETS": ("HOROVOD_DYNAMIC_PROCESS_SETS",),
    "HORA_ELASTIC": ("HOROVOD_ELASTIC",),
    "HORA_START_TIMEOUT": ("HOROVOD_START_TIMEOUT", "HOROVOD_GLOO_TIMEOUT_SECONDS"),
    "HORA_DISABLE_GROUP_FUSION": ("HOROVOD_DISABLE_GROUP_FUSION",),
    "HORA_TRANSPORT": (),
    "HORA_SHARED_MEMORY": (),
    "HORA_SHM_STAGING_MB": (),
    "HORA_RANK": ("HOROVOD_RANK",),
    "HORA_SIZE": ("HOROVOD_SIZE",),
    "HORA_LOCAL_RANK": ("HOROVOD_LOCAL_RANK",),
    "HORA_LOCAL_SIZE": ("HOROVOD_LOCAL_SIZE",),
    "HORA_CROSS_RANK": ("HOROVOD_CROSS_RANK",),
    "HORA_CROSS_SIZE": ("HOROVOD_CROSS_SIZE",),
    "HORA_HOSTNAME": ("HOROVOD_HOSTNAME",),
    "HORA_RENDEZVOUS_ADDR": ("HOROVOD_GLOO_RENDEZVOUS_ADDR",),
    "HORA_RENDEZVOUS_PORT": ("HOROVOD_GLOO_RENDEZVOUS_PORT",),
    "HORA_IFACE": ("HOROVOD_GLOO_IFACE",),
    "HORA_TIMELINE": ("HOROVOD_TIMELINE",),
    "HORA_TIMELINE_MARK_CYCLES": ("HOROVOD_TIMELINE_MARK_CYCLES",),
    "HORA_AUTOTUNE": ("HOROVOD_AUTOTUNE",),
    "HORA_AUTOTUNE_LOG": ("HOROVOD_AUTOTUNE_LOG",),
    "HORA_AUTOTUNE_WARMUP_SAMPLES": ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES",),
    "HORA_AUTOTUNE_STEPS_PER_SAMPLE": ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",),
    "HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",),
    "HORA_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",),
    "HORA_HIERARCHICAL_ALLREDUCE": ("HOROVOD_HIERARCHICAL_ALLREDUCE",),
    "HORA_HIERARCHICAL_ALLGATHER": ("HOROVOD_HIERARCHICAL_ALLGATHER",),
    "HORA_TORUS_ALLREDUCE": ("HOROVOD_TORUS_ALLREDUCE",),
    "HORA_THREAD_AFFINITY": ("HOROVOD_THREAD_AFFINITY",),
    "HORA_NUM_NCCL_STREAMS": ("HOROVOD_NUM_NCCL_STREAMS",),
    "HORA_MPI_THREADS_DISABLE": ("HOROVOD_MPI_THREADS_DISABLE",),
}

# Where a job's topology came from (Config.launcher).
LAUNCHERS = ("none", "horarun", "openmpi", "mpich", "slurm", "torchrun")

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class _Reader:
    """Looks variables up by their hora name or a Horovod alias and parses them."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ

    def raw(self, name: str) -> tuple[str, str] | None:
        """Returns (the variable name found, its value), or None when unset."""
        for candidate in (name, *ALIASES.get(name, ())):
            value = self._environ.get(candidate)
            if value is not None:
                return candidate, value.strip()
        return None

    def _parse(self, name: str, default: T, parse: Callable[[str], T], accepted: str) -> T:
        found = self.raw(name)
        if found is None:
            return default
        var, text = found
        try:
            return parse(text)
        except ValueError:
            raise ValueError(f"{var}={text!r} is not valid: expected {accepted}") from None

    def integer(self, name: str, default: int, lo: int = 0, hi: int | None = None) -> int:
        def parse(text: str) -> int:
            value = int(text)
            if value < lo or (hi is not None and value > hi):
                raise ValueError
            return value

        accepted = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        return self._parse(name, default, parse, accepted)

    def number(self, name: str, default: float, lo: float = 0.0, strict: bool = False) -> float:
        def parse(text: str) -> float:
            value = float(text)
            if value != value or value < lo or (strict and value == lo):
                raise ValueError
            return value

        accepted = f"a number {'>' if strict else '>='} {lo:g}"
        return self._parse(name, default, parse, accepted)

    def flag(self, name: str, default: bool = False) -> bool:
        def parse(text: str) -> bool:
            lowered = text.lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError

        return self._parse(name, default, parse, "one of 1, 0, true, false, yes, no, on, off")

    def optional_flag(self, name: str) -> bool | None:
        """A flag that is None when unset, so the code can choose for itself."""
        return None if self.raw(name) is None else self.flag(name)

    def optional_integer(self, name: str, lo: int = 0, hi: int | None = None) -> int | None:
        """An integer that is None when unset, so the code can choose for itself."""
        return None if self.raw(name) is None else self.integer(name, lo, lo, hi)

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        def parse(text: str) -> str:
            upper = text.upper()
            if upper not in choices:
                raise ValueError
            return upper

        return self._parse(name, default, parse, "one of " + ", ".join(choices))

    def fraction(self, name: str, default: float) -> float:
        def parse(text: str) -> float:
            value = float(text)
            if not 0.0 <= value <= 1.0:
                raise ValueError
            return value

        return self._parse(name, default, parse, "a number in [0, 1]")

    def text(self, name: str, default: str | None = None) -> str | None:
        found = self.raw(name)
        return default if found is None or not found[1] else found[1]


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

    autotune: bool = False
    autotune_log: str | None = None
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_bayes_opt_max_samples: int = 20
    autotune_gaussian_process_noise: float = 0.8
    torus_allreduce: bool = False
    num_nccl_streams: int = 1
    mpi_threads_disable: bool = False

    def unsupported(self) -> list[str]:
        """The ``HORA_*`` names of the knobs set away from their defaults."""
        default = Extras()
        return [
            "HORA_" + field.name.upper()
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != getattr(default, field.name)
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
    secret: bytes | None = dataclasses.field(default=None, repr=False)
    iface: str | None = None
    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
    cycle_time_ms: float = 0.0
    cache_capacity: int = 1024
    stall_check_disable: bool = False
    stall_check_time_seconds: float = 60.0
    stall_shutdown_time_seconds: float = 0.0
    log_level: str = "WARNING"
    log_hide_time: bool = False
    dynamic_process_sets: bool = False
    elastic: bool = False
    start_timeout: float = 30.0
    disable_group_fusion: bool = False
    extras: Extras = Extras()
    hierarchical_allreduce: bool | None = None
    hierarchical_allgather: bool | None = None
    thread_affinity: tuple[int, ...] = ()
    timeline: str | None = None
    timeline_mark_cycles: bool = False
    transport: str = "builtin"
    shared_memory: bool = True
    shm_staging_bytes: int | None = None  # None: chosen by the machine's ranks and cores

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
        env = _Reader(variables)
        secret = _read_secret(env)
        launch = None if _horarun_topology(env) else launchers.detect(variables)
        if launch is None:
            topology = _read_topology(env)
            port = env.integer("HORA_RENDEZVOUS_PORT", -1, lo=-1, hi=65535)
            rendezvous_addr, rendezvous_port = env.text("HORA_RENDEZVOUS_ADDR"), None if port <= 0 else port
            launcher = "horarun" if topology.size > 1 or env.raw("HORA_RANK") is not None else "none"
            host_rendezvous, exact_cross = False, True
        else:
            hostname = env.text("HORA_HOSTNAME") or launch.hostname or socket.gethostname()
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
            launcher, host_rendezvous, exact_cross = launch.launcher, True, launch.exact_cross
        mpi_bootstrap = (
            launch is not None
            and launch.is_mpi
            and launch.size > 1
            and (secret is None or rendezvous_addr is None or rendezvous_port is None)
        )
        staging_mb = env.optional_integer("HORA_SHM_STAGING_MB", lo=1, hi=4096)  # None: chosen per machine
        config = cls(
            topology=topology,
            launcher=launcher,
            host_rendezvous=host_rendezvous,
            mpi_bootstrap=mpi_bootstrap,
            exact_cross=exact_cross,
            rendezvous_addr=rendezvous_addr,
            rendezvous_port=rendezvous_port,
            secret=secret,
            iface=env.text("HORA_IFACE"),
            fusion_threshold=env.integer("HORA_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD),
            cycle_time_ms=env.number("HORA_CYCLE_TIME", 0.0),
            cache_capacity=env.integer("HORA_CACHE_CAPACITY", 1024),
            stall_check_disable=env.flag("HORA_STALL_CHECK_DISABLE"),
            stall_check_time_seconds=env.number("HORA_STALL_CHECK_TIME_SECONDS", 60.0, strict=True),
            stall_shutdown_time_seconds=env.number("HORA_STALL_SHUTDOWN_TIME_SECONDS", 0.0),
            log_level=env.choice("HORA_LOG_LEVEL", "WARNING", LOG_LEVELS),
            log_hide_time=env.flag("HORA_LOG_HIDE_TIME"),
            dynamic_process_sets=env.flag("HORA_DYNAMIC_PROCESS_SETS"),
            elastic=env.flag("HORA_ELASTIC"),
            start_timeout=env.number("HORA_START_TIMEOUT", 30.0, strict=True),
            disable_group_fusion=env.flag("HORA_DISABLE_GROUP_FUSION"),
            extras=_read_extras(env),
            hierarchical_allreduce=env.optional_flag("HORA_HIERARCHICAL_ALLREDUCE"),
            hierarchical_allgather=env.optional_flag("HORA_HIERARCHICAL_ALLGATHER"),
            thread_affinity=_cores(env),
            timeline=env.text("HORA_TIMELINE"),
            timeline_mark_cycles=env.flag("HORA_TIMELINE_MARK_CYCLES"),
            transport=env.choice("HORA_TRANSPORT", "BUILTIN", ("BUILTIN", "MPI")).lower(),
            shared_memory=env.flag("HORA_SHARED_MEMORY", True),
            shm_staging_bytes=None if staging_mb is None else staging_mb * 1024 * 1024,
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
            for name, value in (("MASTER_ADDR", self.rendezvous_addr), ("MASTER_PORT", self.rendezvous_port))
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


def _horarun_topology(env: _Reader) -> bool:
    return env.raw("HORA_RANK") is not None or env.raw("HORA_SIZE") is not None


def _read_secret(env: _Reader) -> bytes | None:
    secret_hex = env.text("HORA_SECRET")
    source = "HORA_SECRET"
    if secret_hex is None:
        path = env.text("HORA_SECRET_FILE")
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


def _cores(env: _Reader) -> tuple[int, ...]:
    """``HORA_THREAD_AFFINITY``: one CPU core per local rank, comma-separated."""
    found = env.raw("HORA_THREAD_AFFINITY")
    if found is None or not found[1]:
        return ()
    var, text = found
    try:
        cores = tuple(int(part) for part in text.split(","))
    except ValueError:
        cores = (-1,)
    if any(core < 0 for core in cores):
        raise ValueError(f"{var}={text!r} is not valid: expected comma-separated core numbers, one per local rank")
    return cores


def _read_extras(env: _Reader) -> Extras:
    return Extras(
        autotune=env.flag("HORA_AUTOTUNE"),
        autotune_log=env.text("HORA_AUTOTUNE_LOG"),
        autotune_warmup_samples=env.integer("HORA_AUTOTUNE_WARMUP_SAMPLES", 3),
        autotune_steps_per_sample=env.integer("HORA_AUTOTUNE_STEPS_PER_SAMPLE", 10, lo=1),
        autotune_bayes_opt_max_samples=env.integer("HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", 20, lo=1),
        autotune_gaussian_process_noise=env.fraction("HORA_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", 0.8),
        torus_allreduce=env.flag("HORA_TORUS_ALLREDUCE"),
        num_nccl_streams=env.integer("HORA_NUM_NCCL_STREAMS", 1, lo=1),
        mpi_threads_disable=env.flag("HORA_MPI_THREADS_DISABLE"),
    )


def ssh_options(environ: Mapping[str, str] | None = None) -> list[str]:
    """Returns ``HORA_SSH_OPTIONS`` split as a shell would (the launcher's extra ssh options).

    Raises:
        ValueError: the value is not valid shell quoting.
    """
    text = (os.environ if environ is None else environ).get("HORA_SSH_OPTIONS", "")
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"HORA_SSH_OPTIONS={text!r} is not valid: {exc}") from None


def _read_topology(env: _Reader) -> Topology:
    size = env.integer("HORA_SIZE", 1, lo=1)
    rank = env.integer("HORA_RANK", 0)
    # Without local variables the job is taken to run on one host.
    local_size = env.integer("HORA_LOCAL_SIZE", size, lo=1)
    local_rank = env.integer("HORA_LOCAL_RANK", rank)
    cross_size = env.integer("HORA_CROSS_SIZE", 1, lo=1)
    cross_rank = env.integer("HORA_CROSS_RANK", 0)
    for name, value, bound, bound_name in (
        ("HORA_RANK", rank, size, "HORA_SIZE"),
        ("HORA_LOCAL_RANK", local_rank, local_size, "HORA_LOCAL_SIZE"),
        ("HORA_CROSS_RANK", cross_rank, cross_size, "HORA_CROSS_SIZE"),
    ):
        if value >= bound:
            raise ValueError(f"{name}={value} is not valid: expected an integer in [0, {bound_name}={bound})")
    hostname = env.text("HORA_HOSTNAME") or socket.gethostname()
    return Topology(rank, size, local_rank, local_size, cross_rank, cross_size, hostname)


def accepted_names() -> list[str]:
    """Returns every variable name this module reads, hora's and Horovod's."""
    names = list(ALIASES) + ["HORA_SECRET", "HORA_SECRET_FILE"]
    for aliases in ALIASES.values():
        names.extend(aliases)
    return names
