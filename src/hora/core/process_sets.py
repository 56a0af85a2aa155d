"""Process sets: collectives among a subset of the ranks.

``global_process_set`` (id 0) holds every rank. Other sets are given to ``init`` or,
in dynamic mode, added and removed while the job runs; both are collective calls on
every rank. Every collective takes ``process_set=``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from hora.core import mpi_comm

if TYPE_CHECKING:
    from hora.core.runtime import Runtime


class ProcessSet:
    """A set of ranks that run collectives among themselves.

    Args:
        ranks_or_comm: the global ranks of the set (any order; kept sorted), or an
            mpi4py communicator: the set of its members, resolved when ``init`` (given
            the job's communicator) registers it.

    Attributes:
        process_set_id: assigned when the set is registered; None before.
        ranks: the sorted global ranks; None for a communicator's set before ``init``.
        mpi_comm: the communicator the set was made from, else None.
    """

    def __init__(self, ranks_or_comm: Iterable[int] | Any) -> None:
        self.process_set_id: int | None = None
        self._runtime: Runtime | None = None
        self.mpi_comm: Any = mpi_comm.as_comm(ranks_or_comm)
        self.ranks: list[int] | None = None
        if self.mpi_comm is not None:
            return
        if not isinstance(ranks_or_comm, Iterable) or isinstance(ranks_or_comm, (str, bytes)):
            raise ValueError(
                "ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object; "
                f"got {type(ranks_or_comm).__name__}"
            )
        ranks = [int(r) for r in ranks_or_comm]
        if len(set(ranks)) != len(ranks) or any(r < 0 for r in ranks):
            raise ValueError(f"ProcessSet ranks must be distinct non-negative integers; got {ranks}")
        self.ranks = sorted(ranks)

    def _bind(self, runtime: Runtime, set_id: int) -> None:
        self._runtime = runtime
        self.process_set_id = set_id

    def _unbind(self) -> None:
        self._runtime = None
        self.process_set_id = None

    def _members(self) -> tuple[int, ...] | None:
        if self._runtime is None or self.process_set_id is None:
            return None
        return self._runtime.engine.sets.get(self.process_set_id)

    def size(self) -> int | None:
        """The number of ranks in the set; None before the set is registered."""
        members = self._members()
        return None if members is None else len(members)

    def rank(self) -> int | None:
        """This process's rank within the set; None before registration or for a non-member."""
        members = self._members()
        runtime = self._runtime
        if members is None or runtime is None or runtime.rank not in members:
            return None
        return members.index(runtime.rank)

    def included(self) -> bool | None:
        """Whether this process belongs to the set; None before registration."""
        members = self._members()
        runtime = self._runtime
        if members is None or runtime is None:
            return None
        return runtime.rank in members

    def __str__(self) -> str:
        """Horovod's: ``ProcessSet(process_set_id=1, ranks=[0, 2], mpi_comm=None)``."""
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    def __repr__(self) -> str:
        ranks = "all" if self.process_set_id == 0 and not self.ranks else self.ranks
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks})"


class _GlobalProcessSet(ProcessSet):
    """The set of every rank; its ranks follow the running job."""

    def __init__(self) -> None:
        super().__init__([])
        self.process_set_id = 0

    def _bind(self, runtime: Runtime, set_id: int) -> None:
        super()._bind(runtime, set_id)
        self.ranks = list(range(runtime.size))

    def _unbind(self) -> None:
        super()._unbind()
        self.process_set_id = 0
        self.ranks = []
        self.mpi_comm = None


global_process_set: ProcessSet = _GlobalProcessSet()
