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
    ``HORA_SHARED_MEMORY`` (1: ranks on one machine move data through shared memory),
    ``HORA_SHM_STAGING_MB`` (16: each rank's shared staging buffer).

Job topology (set by ``horarun``)
    ``HORA_RANK``, ``HORA_SIZE``, ``HORA_LOCAL_RANK``, ``HORA_LOCAL_SIZE``,
    ``HORA_CROSS_RANK``, ``HORA_CROSS_SIZE``, ``HORA_HOSTNAME``,
    ``HORA_RENDEZVOUS_ADDR``, ``HORA_RENDEZVOUS_PORT``, ``HORA_SECRET`` (hex),
    ``HORA_IFACE`` (network interface whose address the rank binds and advertises).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable, Mapping
from typing import TypeVar

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
}

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

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        def parse(text: str) -> str:
            upper = text.upper()
            if upper not in choices:
                raise ValueError
            return upper

        return self._parse(name, default, parse, "one of " + ", ".join(choices))

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
class Config:
    """Every setting hora reads from the environment, validated."""

    topology: Topology = Topology()
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
    shared_memory: bool = True
    shm_staging_bytes: int = 16 * 1024 * 1024

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
        env = _Reader(os.environ if environ is None else environ)
        topology = _read_topology(env)
        secret_hex = env.text("HORA_SECRET")
        secret = None
        if secret_hex is not None:
            try:
                secret = bytes.fromhex(secret_hex)
            except ValueError:
                raise ValueError("HORA_SECRET is not valid: expected a hex string (value not shown)") from None
            if len(secret) < 16:
                raise ValueError("HORA_SECRET is not valid: expected at least 16 bytes (32 hex digits)")
        port = env.integer("HORA_RENDEZVOUS_PORT", -1, lo=-1, hi=65535)
        config = cls(
            topology=topology,
            rendezvous_addr=env.text("HORA_RENDEZVOUS_ADDR"),
            rendezvous_port=None if port <= 0 else port,
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
            shared_memory=env.flag("HORA_SHARED_MEMORY", True),
            shm_staging_bytes=env.integer("HORA_SHM_STAGING_MB", 16, lo=1, hi=4096) * 1024 * 1024,
        )
        config.check_launch()
        return config

    def check_launch(self) -> None:
        """Checks that a multi-process job has what it needs to connect its ranks.

        Raises:
            ValueError: size > 1 without a rendezvous address or secret.
        """
        if self.topology.size == 1:
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
    names = list(ALIASES) + ["HORA_SECRET"]
    for aliases in ALIASES.values():
        names.extend(aliases)
    return names
