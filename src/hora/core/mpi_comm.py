"""mpi4py communicators as Horovod takes them: ``init(comm=MPI.Comm)`` and ``ProcessSet(comm)``.

Horovod runs its job over the communicator ``init`` is given (``MPI.COMM_WORLD`` when none
is), and registers a process set for each distinct group of ranks that the ranks' own
communicators in ``process_sets`` describe. hora keeps its own transport; MPI only says
who belongs to the job:

* ``job_over`` makes the configuration of a job over a communicator: the whole MPI world
  changes nothing; a sub-communicator (``COMM_WORLD.Split``) makes its ranks a job of
  their own, numbered as the communicator numbers them, with its own rendezvous that
  rank 0 of the communicator runs and announces through it (``hora.core.bootstrap``),
  and a fresh job secret, so that two such jobs on one host never share a name;
* ``gather_sets`` collects, for each communicator-defined set, the global ranks of every
  rank's communicator, in Horovod's order (by the set's place in the list, then sorted),
  so that every rank registers the same sets in the same order.

mpi4py is never imported here: a communicator exists only where its program imported it.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

from hora.config import Config, Topology


def as_comm(value: object) -> Any | None:
    """``value`` if it is an mpi4py communicator, else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(value, mpi.Comm):
        return value
    return None


def _mpi() -> Any:
    return sys.modules["mpi4py.MPI"]


def world_matches(config: Config) -> bool:
    """Whether ``MPI.COMM_WORLD`` is this job's world (started by mpirun, rank for rank).

    False while MPI is not initialised (``mpi4py.rc.initialize = False``): a call on
    ``COMM_WORLD`` then would make Open MPI abort the process.
    """
    mpi = _mpi()
    if not mpi.Is_initialized() or mpi.Is_finalized():
        return False
    world = mpi.COMM_WORLD
    return (world.Get_rank(), world.Get_size()) == (config.topology.rank, config.topology.size)


def job_over(config: Config, comm: Any) -> Config:
    """The configuration of a job that runs over ``comm``.

    Args:
        config: the configuration the environment gave.
        comm: the communicator given to ``init``.

    Returns:
        ``config`` itself when ``comm`` holds the whole job in the launcher's order (or
        when MPI does not describe this job: under ``horarun`` mpi4py's world is this
        process alone, and, as Horovod's Gloo controller does, the job stays the
        launcher's); else the configuration of the communicator's own job.

    Raises:
        ValueError: an elastic job (its members change; a communicator's cannot), or
            a communicator this rank does not belong to.
    """
    mpi = _mpi()
    if comm == mpi.COMM_NULL:
        raise ValueError("hora.init(comm=MPI.COMM_NULL): this rank is not in the communicator")
    if not world_matches(config):
        return config
    whole = mpi.Group.Compare(comm.Get_group(), mpi.COMM_WORLD.Get_group()) == mpi.IDENT
    if whole:
        return config
    if config.elastic:
        raise ValueError("hora.init(comm=...): an elastic job cannot run over a sub-communicator")
    own = comm.Dup()  # hora's own messages never meet the program's on its communicator
    local = own.Split_type(mpi.COMM_TYPE_SHARED, key=own.Get_rank())
    cross = own.Split(local.Get_rank(), own.Get_rank())
    topology = Topology(
        own.Get_rank(),
        own.Get_size(),
        local.Get_rank(),
        local.Get_size(),
        cross.Get_rank(),
        cross.Get_size(),
        config.topology.hostname,
    )
    local.Free()
    cross.Free()
    return dataclasses.replace(
        config,
        topology=topology,
        exact_cross=True,
        host_rendezvous=True,
        mpi_bootstrap=True,
        mpi_comm=own,
        # Rank 0 of the communicator offers its own address, a free port and a new
        # secret: the launcher's would be the same for every sub-communicator's job.
        rendezvous_addr=None,
        rendezvous_port=None,
        agent_store=None,
        secret=None,
    )


def world_comm(config: Config) -> Any | None:
    """The communicator that numbers this job's ranks: the one the job runs over, else
    ``COMM_WORLD`` when it is the job's world; None when MPI does not describe the job."""
    if config.mpi_comm is not None:
        return config.mpi_comm
    if "mpi4py.MPI" in sys.modules and world_matches(config):
        return _mpi().COMM_WORLD
    return None


def ranks_of(comm: Any, world: Any) -> tuple[int, ...]:
    """The ranks in ``world`` of ``comm``'s members, sorted.

    Raises:
        ValueError: ``comm`` holds a process outside ``world``.
    """
    mpi = _mpi()
    ranks = mpi.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())), world.Get_group())
    if any(rank == mpi.UNDEFINED for rank in ranks):
        raise ValueError(f"ProcessSet({comm!r}): the communicator holds processes outside hora's job")
    return tuple(sorted(int(rank) for rank in ranks))


def gather_sets(comms: list[Any], world: Any) -> list[tuple[int, ...]]:
    """The sets the ranks' communicators describe, as Horovod registers them.

    For the ``i``-th communicator of every rank's list: the global ranks of each rank's
    ``i``-th communicator, gathered over ``world``, distinct ones sorted; then the next.

    Raises:
        ValueError: the ranks hold different numbers of communicator-defined sets
            (named by rank; checked before any gathering that would then mismatch).
    """
    counts = np.zeros(world.Get_size(), dtype=np.int64)
    world.Allgather(np.array([len(comms)], dtype=np.int64), counts)
    if len(set(counts.tolist())) > 1:
        listed = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts.tolist()))
        raise ValueError(f"hora.init: the ranks give different numbers of process sets from communicators ({listed})")
    found: list[tuple[int, ...]] = []
    for comm in comms:
        mine = np.array(ranks_of(comm, world), dtype=np.int64)
        sizes = np.zeros(world.Get_size(), dtype=np.int64)
        world.Allgather(np.array([mine.size], dtype=np.int64), sizes)
        everyone = np.zeros(int(sizes.sum()), dtype=np.int64)
        world.Allgatherv(mine, [everyone, sizes.tolist()])
        bounds = np.concatenate(([0], np.cumsum(sizes)))
        groups = {tuple(everyone[bounds[i] : bounds[i + 1]].tolist()) for i in range(len(sizes))}
        found.extend(sorted(groups))
    return found
