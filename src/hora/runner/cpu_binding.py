"""``horarun --bind-to core``: each local rank confined to its own block of the host's cores.

Open MPI's ``mpirun`` binds every rank to a core by default when it starts two ranks or
fewer per host; ``horarun`` (like ``horovodrun`` and ``torchrun``) leaves the kernel to
place the ranks. On a host where ranks and their threads outnumber nothing but the
cores, the kernel moves a rank between cores while it waits on its peers, and its
caches go cold each time: a JAX training step measured 5-10% slower unbound than bound
(docs/performance.md). ``--bind-to core`` (``HORA_BIND_TO=core``) splits the cores this
process may use into one contiguous block per local rank, whole cores first (hyperthreads
of one core stay together), and pins each rank, and every thread and process it starts,
to its block before the rank's program runs.

The block is chosen where the rank starts: by ``horarun`` for a rank on its own host and
by ``hora.runner.remote`` on another host, each from its own host's CPUs, the rank's
``HORA_LOCAL_RANK`` and ``HORA_LOCAL_SIZE``. A host with more local ranks than CPUs is
left unbound (``mpirun`` refuses such a binding without ``--bind-to none``); ``horarun``
says so for its own host. ``--mpi`` launches bind as ``mpirun`` does (``--binding-args``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from hora.config import knobs

_TOPOLOGY = "/sys/devices/system/cpu/cpu{}/topology/{}"


def _read_id(cpu: int, name: str) -> int:
    """A CPU's ``physical_package_id`` or ``core_id``; -1 where the kernel does not say."""
    try:
        with open(_TOPOLOGY.format(cpu, name), encoding="ascii") as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return -1


def cores(cpus: Sequence[int], core_of: Callable[[int], tuple[int, int]] | None = None) -> list[list[int]]:
    """Groups CPUs by the physical core they belong to.

    Args:
        cpus: the CPUs, in order.
        core_of: a CPU's (package, core) pair; the kernel's topology files when None.
            A CPU whose core is unknown is a core of its own.

    Returns:
        The cores in order of their first CPU, each the sorted CPUs it holds.
    """
    lookup = core_of or (lambda cpu: (_read_id(cpu, "physical_package_id"), _read_id(cpu, "core_id")))
    groups: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(cpus):
        package, core = lookup(cpu)
        key = (package, core) if core >= 0 else (-1, -1 - cpu)
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())


def block(local_rank: int, local_size: int, host_cores: Sequence[Sequence[int]]) -> set[int] | None:
    """The CPUs of local rank ``local_rank`` of ``local_size`` on a host with ``host_cores``.

    Whole cores are split into ``local_size`` contiguous blocks differing by at most one
    core; with fewer cores than ranks but enough CPUs (hyperthreads), the CPUs are split
    instead; with fewer CPUs than ranks, nothing is bound.

    Returns:
        The CPU numbers, or None when the rank should not be bound.

    Raises:
        ValueError: ``local_rank`` is not in ``[0, local_size)``.
    """
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {local_rank} is not in [0, {local_size})")
    units: Sequence[Sequence[int]] = host_cores
    if len(units) < local_size:
        units = [[cpu] for core in host_cores for cpu in core]
        if len(units) < local_size:
            return None
    base, extra = divmod(len(units), local_size)
    start = local_rank * base + min(local_rank, extra)
    length = base + (1 if local_rank < extra else 0)
    return {cpu for unit in units[start : start + length] for cpu in unit}


def requested(env: Mapping[str, str]) -> bool:
    """Whether ranks started with ``env`` bind to cores (``HORA_BIND_TO=core``).

    Raises:
        ValueError: ``HORA_BIND_TO`` is not ``none`` or ``core``; names the variable.
    """
    return bool(knobs.BY_NAME["HORA_BIND_TO"].read(env) == "core")


def rank_cpus(env: Mapping[str, str]) -> set[int] | None:
    """The CPUs a rank started with ``env`` is bound to on this host, or None (not bound).

    Raises:
        ValueError: ``HORA_BIND_TO`` or the topology variables are not valid.
    """
    if not requested(env):
        return None
    local_rank = knobs.BY_NAME["HORA_LOCAL_RANK"].read(env)
    local_size = knobs.BY_NAME["HORA_LOCAL_SIZE"].read(env)
    if local_rank is None or local_size is None:
        raise ValueError("HORA_BIND_TO=core needs HORA_LOCAL_RANK and HORA_LOCAL_SIZE (set by horarun)")
    return block(local_rank, local_size, cores(sorted(os.sched_getaffinity(0))))


def preexec(env: Mapping[str, str]) -> Callable[[], None] | None:
    """What the rank's child process runs between fork and exec to bind itself, or None.

    The CPUs are computed here, in the parent: the child only makes the one system call
    (threads of the parent may hold locks a forked child must not wait on).

    Raises:
        ValueError: as ``rank_cpus``.
    """
    cpus = rank_cpus(env)
    if cpus is None:
        return None
    chosen = frozenset(cpus)
    return lambda: os.sched_setaffinity(0, chosen)


def unbound_warning(local_size: int) -> str | None:
    """horarun's line when ``local_size`` ranks cannot each have a CPU of this host, else None."""
    available = len(os.sched_getaffinity(0))
    if local_size <= available:
        return None
    return (
        f"horarun: --bind-to core: {local_size} ranks on this host but {available} CPUs; "
        "its ranks are left unbound"
    )
