"""Where a rank sits in its job when a launcher other than ``horarun`` started it.

``hora.config`` calls ``detect`` with the environment; this module reads nothing else.
hora recognises, in this order (the first that matches wins):

``horarun`` / ``hora.run``
    ``HORA_RANK``/``HORA_SIZE`` (or Horovod's ``HOROVOD_RANK``/``HOROVOD_SIZE``); read by
    ``hora.config`` itself, not here.
Open MPI ``mpirun``
    ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``.
MPICH / Hydra ``mpiexec`` (also Intel MPI)
    ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``.
Slurm ``srun``
    ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (or ``SLURM_NTASKS``), ``SLURM_LOCALID``,
    ``SLURM_NODEID``, ``SLURM_STEP_TASKS_PER_NODE`` (``"2(x3),1"``) and
    ``SLURM_STEP_NODELIST`` (``"node[01-03]"``), ``SLURMD_NODENAME``.
torchrun-style (torchrun, Kubernetes PyTorchJob and similar operators)
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``.

Without ``horarun`` there is no launcher-run rendezvous server: rank 0 runs it, at

* ``HORA_RENDEZVOUS_ADDR``/``HORA_RENDEZVOUS_PORT`` when set, else
* ``MASTER_ADDR``/``MASTER_PORT`` when set (under torchrun itself, whose agent already
  serves its own store there, at a free port rank 0 picks and publishes in that store:
  ``AgentStore``), else
* under Slurm, the first node of the step (``127.0.0.1`` for a one-node step) and a port
  derived from the job and step ids (``slurm_port``), else
* under mpirun, an address and port rank 0 picks and shares through MPI (needs mpi4py;
  ``127.0.0.1`` when every rank runs on one host still needs a port from the above).

Local and cross ranks follow Horovod's definitions. Open MPI, MPICH and torchrun name the
local rank and size but not the host's index; hora then assumes ranks are placed in
blocks of ``local_size`` (the launchers' default) and ``hora.core.runtime`` warns when the
hosts the ranks report show otherwise. Slurm names the node and the tasks per node, so
its cross ranks are exact.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000


@dataclasses.dataclass(frozen=True)
class AgentStore:
    """torchrun's agent store, where rank 0 publishes the port of hora's rendezvous.

    torchrun's agent serves a key-value store at ``MASTER_ADDR:MASTER_PORT`` for its
    workers (``TORCHELASTIC_USE_AGENT_STORE=True``), so hora cannot listen there. Rank 0
    listens on a free port instead and writes it under ``key``; the key carries
    ``TORCHELASTIC_RESTART_COUNT`` so that a restarted attempt never reads the port of the
    attempt before it.

    Attributes:
        addr: the store's host (``MASTER_ADDR``).
        port: the store's port (``MASTER_PORT``).
        key: where rank 0 writes its rendezvous port.
    """

    addr: str
    port: int
    key: str


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """A rank's place in a job started by a launcher other than ``horarun``.

    Attributes:
        launcher: ``"openmpi"``, ``"mpich"``, ``"slurm"`` or ``"torchrun"``.
        rank, size, local_rank, local_size, cross_rank, cross_size: the topology.
        hostname: the node name the launcher gives, or None.
        rendezvous_addr: where rank 0 runs the rendezvous server, or None when rank 0
            picks it and shares it through MPI.
        rendezvous_port: its port, or None (likewise, or when rank 0 publishes it in
            ``agent_store``).
        exact_cross: the cross ranks come from the launcher, not from an assumption.
        agent_store: torchrun's agent store, when rank 0 publishes its port there.
    """

    launcher: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str | None
    rendezvous_addr: str | None
    rendezvous_port: int | None
    exact_cross: bool = False
    agent_store: AgentStore | None = None

    @property
    def is_mpi(self) -> bool:
        return self.launcher in ("openmpi", "mpich")


def _integer(env: Mapping[str, str], name: str, lo: int = 0, hi: int | None = None) -> int:
    text = env[name].strip()
    try:
        value = int(text)
    except ValueError:
        value = lo - 1
    if value < lo or (hi is not None and value > hi):
        accepted = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise ValueError(f"{name}={text!r} is not valid: expected {accepted} (set by the launcher)")
    return value


def _optional(env: Mapping[str, str], name: str, lo: int = 0, hi: int | None = None) -> int | None:
    return _integer(env, name, lo, hi) if env.get(name, "").strip() else None


def _first(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        if env.get(name, "").strip():
            return name
    return None


def block_cross(rank: int, size: int, local_rank: int, local_size: int) -> tuple[int, int]:
    """Cross rank and size when ranks fill hosts in blocks of ``local_size``.

    Example: 5 ranks, 2 per host: hosts hold ranks {0,1}, {2,3}, {4}; rank 3 (local
    rank 1) has cross rank 1 of 2 (only two hosts have a local rank 1), rank 4 has
    cross rank 2 of 3.
    """
    hosts = -(-size // local_size)
    last = size - (hosts - 1) * local_size  # ranks on the last host
    cross_size = hosts if local_rank < last else hosts - 1
    return rank // local_size, max(cross_size, 1)


def parse_tasks_per_node(text: str) -> list[int]:
    """Expands Slurm's ``SLURM_TASKS_PER_NODE`` form: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        ValueError: the text is not in that form.
    """
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"SLURM_TASKS_PER_NODE={text!r} is not valid: expected a form like 2(x3),1")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def expand_hostlist(text: str) -> list[str]:
    """Expands a Slurm host list: ``"node[01-03,7],login"`` -> ``node01 node02 node03 node7 login``.

    Raises:
        ValueError: unbalanced brackets or a malformed range.
    """
    names: list[str] = []
    for entry in _split_top_level(text):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", entry):
            choices = [literal]
            if ranges:
                choices = [literal + item for item in _expand_ranges(ranges, text)]
            expanded = [head + choice for head in expanded for choice in choices]
        names.extend(name for name in expanded if name)
    return names


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {text!r} is not valid: unbalanced brackets")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ValueError(f"host list {text!r} is not valid: unbalanced brackets")
    parts.append(current)
    return [part.strip() for part in parts if part.strip()]


def _expand_ranges(ranges: str, text: str) -> list[str]:
    items = []
    for item in ranges.split(","):
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"host list {text!r} is not valid: bad range {item!r}")
        if not dash:
            items.append(low)
            continue
        width = len(low)
        items.extend(f"{value:0{width}d}" for value in range(int(low), int(high) + 1))
    return items


def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port every rank of one Slurm job step derives alike."""
    return SLURM_PORT_BASE + (job_id * 9973 + step_id) % SLURM_PORT_SPAN


def _explicit_rendezvous(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    """``HORA_RENDEZVOUS_*`` (or Horovod's names), else ``MASTER_ADDR``/``MASTER_PORT``."""
    addr_name = _first(env, "HORA_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "MASTER_ADDR")
    port_name = _first(env, "HORA_RENDEZVOUS_PORT", "HOROVOD_GLOO_RENDEZVOUS_PORT", "MASTER_PORT")
    addr = env[addr_name].strip() if addr_name else None
    port = _integer(env, port_name, 1, 65535) if port_name else None
    return addr, port


def _truthy(text: str | None) -> bool:
    return (text or "").strip().lower() in ("1", "true", "yes", "on")


def _checked(launch: LaunchEnv, names: str) -> LaunchEnv:
    for label, value, bound in (
        ("rank", launch.rank, launch.size),
        ("local rank", launch.local_rank, launch.local_size),
        ("cross rank", launch.cross_rank, launch.cross_size),
    ):
        if not 0 <= value < bound:
            raise ValueError(
                f"{names}: the {label} {value} is not below its size {bound}: the launcher's variables disagree"
            )
    return launch


def _openmpi(env: Mapping[str, str]) -> LaunchEnv:
    return _mpi_launch(
        env, "openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_*",
    )  # fmt: skip


def _mpich(env: Mapping[str, str]) -> LaunchEnv:
    return _mpi_launch(
        env, "mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
        "PMI_RANK/PMI_SIZE/MPI_LOCALRANKID/MPI_LOCALNRANKS",
    )  # fmt: skip


def _mpi_launch(
    env: Mapping[str, str], kind: str, rank_name: str, size_name: str, local_rank_name: str, local_size_name: str,
    names: str,
) -> LaunchEnv:
    """The topology an MPI launcher gives through its variables (``names`` for errors).

    Without the local variables every rank counts as local; a job on one machine with a
    port but no address meets at loopback.
    """
    size = _integer(env, size_name, 1)
    rank = _integer(env, rank_name)
    local_rank = _optional(env, local_rank_name)
    local_size = _optional(env, local_size_name, 1)
    if local_rank is None or local_size is None:
        local_rank, local_size = rank, size
    cross_rank, cross_size = block_cross(rank, size, local_rank, local_size)
    addr, port = _explicit_rendezvous(env)
    if addr is None and local_size == size and port is not None:
        addr = "127.0.0.1"
    launch = LaunchEnv(kind, rank, size, local_rank, local_size, cross_rank, cross_size, None, addr, port)
    return _checked(launch, names)


def _slurm(env: Mapping[str, str]) -> LaunchEnv:
    size_name = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if size_name is None:
        raise ValueError("SLURM_PROCID is set but SLURM_NTASKS is not: start the ranks with srun -n N")
    size = _integer(env, size_name, 1)
    rank = _integer(env, "SLURM_PROCID")
    local_rank = _optional(env, "SLURM_LOCALID") or 0
    node = _optional(env, "SLURM_NODEID") or 0
    per_node_name = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    per_node = parse_tasks_per_node(env[per_node_name]) if per_node_name else [size]
    if node >= len(per_node):
        raise ValueError(f"SLURM_NODEID={node} is not valid: {per_node_name} names only {len(per_node)} node(s)")
    local_size = per_node[node]
    holders = [index for index, count in enumerate(per_node) if count > local_rank]
    cross_rank = holders.index(node) if node in holders else 0
    cross_size = max(len(holders), 1)
    addr, port = _explicit_rendezvous(env)
    if addr is None:
        nodelist_name = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        nodes = expand_hostlist(env[nodelist_name]) if nodelist_name else []
        addr = "127.0.0.1" if len(per_node) == 1 or not nodes else nodes[0]
    if port is None:
        job_name = _first(env, "SLURM_JOB_ID", "SLURM_JOBID")
        step_name = _first(env, "SLURM_STEP_ID", "SLURM_STEPID")
        job = _integer(env, job_name) if job_name else 0
        step = _integer(env, step_name) if step_name else 0
        port = slurm_port(job, step)
    hostname = env.get("SLURMD_NODENAME", "").strip() or None
    launch = LaunchEnv(
        "slurm", rank, size, local_rank, local_size, cross_rank, cross_size, hostname, addr, port, exact_cross=True
    )
    return _checked(launch, "SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NODEID")


def _torchrun(env: Mapping[str, str]) -> LaunchEnv:
    size = _integer(env, "WORLD_SIZE", 1)
    rank = _integer(env, "RANK")
    local_rank = _optional(env, "LOCAL_RANK")
    local_size = _optional(env, "LOCAL_WORLD_SIZE", 1)
    addr, port = _explicit_rendezvous(env)
    if local_size is None:
        if local_rank is None:
            local_rank, local_size = 0, 1  # one process per host (pod), as the operators start them
        elif size == 1 or (addr is not None and _is_loopback_name(addr)):
            local_size = size  # MASTER_ADDR on loopback: every rank runs on this host
        else:
            raise ValueError(
                "LOCAL_RANK is set but LOCAL_WORLD_SIZE is not, and MASTER_ADDR is not a loopback address: "
                "set LOCAL_WORLD_SIZE to the number of ranks per host (torchrun sets it)"
            )
    if local_rank is None:
        local_rank = 0
    group = _optional(env, "GROUP_RANK")
    cross_rank, cross_size = block_cross(rank, size, local_rank, local_size)
    if group is not None:
        cross_rank = group
    store = _agent_store(env)
    if store is not None and _first(env, "HORA_RENDEZVOUS_PORT", "HOROVOD_GLOO_RENDEZVOUS_PORT") is None:
        port = None  # the agent holds MASTER_PORT: rank 0 picks a port and publishes it in the agent's store
    else:
        store = None
    launch = LaunchEnv(
        "torchrun", rank, size, local_rank, local_size, cross_rank, cross_size, None, addr, port, agent_store=store
    )
    return _checked(launch, "RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE")


def _agent_store(env: Mapping[str, str]) -> AgentStore | None:
    """torchrun's agent store, when torchrun says its workers may use it."""
    if not _truthy(env.get("TORCHELASTIC_USE_AGENT_STORE")):
        return None
    if not env.get("MASTER_ADDR", "").strip() or not env.get("MASTER_PORT", "").strip():
        return None
    restart = _optional(env, "TORCHELASTIC_RESTART_COUNT") or 0
    return AgentStore(
        env["MASTER_ADDR"].strip(), _integer(env, "MASTER_PORT", 1, 65535), f"/hora/attempt_{restart}/rendezvous_port"
    )


def _is_loopback_name(host: str) -> bool:
    return host.lower() == "localhost" or host.startswith("127.") or host == "::1"


def detect(env: Mapping[str, str]) -> LaunchEnv | None:
    """Reads the topology a launcher other than ``horarun`` set, if any.

    Args:
        env: the process environment.

    Returns:
        The launch environment, or None when no known launcher's variables are set.

    Raises:
        ValueError: a launcher's variable is malformed or they contradict each other;
            the message names the variables.
    """
    if _first(env, "OMPI_COMM_WORLD_SIZE") and _first(env, "OMPI_COMM_WORLD_RANK"):
        return _openmpi(env)
    if _first(env, "PMI_SIZE") and _first(env, "PMI_RANK") and _first(env, "MPI_LOCALRANKID"):
        return _mpich(env)
    # srun sets SLURM_STEP_NUM_TASKS for its tasks; a batch script (one process) has no step.
    if _first(env, "SLURM_PROCID") and _first(env, "SLURM_STEP_NUM_TASKS"):
        return _slurm(env)
    if _first(env, "PMI_SIZE") and _first(env, "PMI_RANK"):
        return _mpich(env)
    if _first(env, "WORLD_SIZE") and _first(env, "RANK"):
        return _torchrun(env)
    return None
