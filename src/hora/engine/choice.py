"""Choosing each process set's algorithms: shared memory, hierarchical, the TCP ring, or MPI.

Every member of a set decides from the same facts (host names and machine ids from the
rendezvous, and whether each host's shared memory came up), so all members choose alike
and run the same algorithm. Used only by the thread executing a collective (the drive
lock's holder).
"""

from __future__ import annotations

from hora.config import Config
from hora.engine.algorithms import Collectives, HierarchicalCollectives, SharedCollectives, TcpCollectives
from hora.engine.mesh_channel import MeshChannel
from hora.engine.mpi_collectives import MpiWorld
from hora.engine.shm_group import ShmGroup
from hora.transport.mesh import Mesh
from hora.transport.shm import Domain
from hora.transport.tcp import Watch


class AlgorithmChoice:
    """Builds, once per set, the ``Collectives`` a process set runs.

    Args:
        config: supplies the rank, the hierarchical switches and the transport.
        mesh: the connections to the other ranks (None: a job of one rank).
        domain: this machine's shared-memory domain, if any.
        sharing: by rank, whether that rank's host shares memory.
        watch: what data-plane waits keep an eye on.
        mpi: the MPI communicators (``HORA_TRANSPORT=mpi``), or None.
    """

    def __init__(
        self,
        config: Config,
        mesh: Mesh | None,
        domain: Domain | None,
        sharing: list[bool],
        watch: Watch,
        mpi: MpiWorld | None,
    ) -> None:
        self._rank = config.topology.rank
        self._mesh = mesh
        self._domain = domain
        self._sharing = sharing
        self._watch = watch
        self._mpi = mpi
        # Unset: hierarchical allreduce/allgather wherever the layout suits it; set: forced on or off.
        self._hierarchical_allreduce = config.hierarchical_allreduce is not False
        self._hierarchical_allgather = config.hierarchical_allgather is not False
        self._chosen: dict[tuple[int, ...], Collectives] = {}

    def __call__(self, ranks: tuple[int, ...]) -> Collectives:
        """The algorithms of the process set of global ``ranks``.

        All members on this machine: shared memory. Members on several hosts, the same
        number on each, more than one per host, and shared memory working on every one
        of them: hierarchical allreduce and allgather (each unless turned off). Otherwise
        the TCP ring.
        """
        chosen = self._chosen.get(ranks)
        if chosen is None:
            chosen = self._chosen[ranks] = self._choose(ranks)
        return chosen

    def _choose(self, ranks: tuple[int, ...]) -> Collectives:
        if self._mpi is not None:
            return self._mpi.collectives(ranks, self._watch)
        domain = self._domain
        hosts = self._hosts_of(ranks)
        if domain is not None and len(ranks) > 1 and len(hosts) == 1:
            return SharedCollectives(ShmGroup(domain, ranks), self._channel(ranks))
        if domain is not None and (self._hierarchical_allreduce or self._hierarchical_allgather) and self._layered(ranks, hosts):
            local = next(members for members in hosts if self._rank in members)
            index = local.index(self._rank)
            cross = tuple(members[index] for members in hosts)
            return HierarchicalCollectives(
                SharedCollectives(ShmGroup(domain, local), self._channel(local)),
                TcpCollectives(self._channel(cross)),
                self._channel(ranks),
                layout=[tuple(ranks.index(rank) for rank in members) for members in hosts],
                allreduce=self._hierarchical_allreduce,
                allgather=self._hierarchical_allgather,
            )
        return TcpCollectives(self._channel(ranks))

    def _channel(self, members: tuple[int, ...]) -> MeshChannel:
        data = self._mesh.data if self._mesh is not None else {}
        return MeshChannel(members, self._rank, data, self._watch)

    def _hosts_of(self, ranks: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The set's members grouped by machine, groups ordered by their first member."""
        if self._mesh is None:
            return [ranks]
        groups: dict[tuple[str, str], list[int]] = {}
        for rank in ranks:
            groups.setdefault((self._mesh.hosts[rank], self._mesh.machines[rank]), []).append(rank)
        return [tuple(members) for members in groups.values()]

    def _layered(self, ranks: tuple[int, ...], hosts: list[tuple[int, ...]]) -> bool:
        """True when the set suits hierarchical allreduce."""
        per_host = {len(members) for members in hosts}
        return len(hosts) > 1 and len(per_host) == 1 and per_host.pop() > 1 and all(self._sharing[r] for r in ranks)
