"""A process set's view of the machine's shared-memory domain (``collectives.shm_ops.SharedGroup``)."""

from __future__ import annotations

import numpy as np

from hora.transport.shm import Domain


class ShmGroup:
    """The members of one process set, all in this machine's domain.

    Args:
        domain: the machine's shared-memory domain.
        ranks: the set's global ranks, in set order (this rank among them).
    """

    def __init__(self, domain: Domain, ranks: tuple[int, ...]) -> None:
        self._domain = domain
        self._ranks = ranks
        self._rank = ranks.index(domain.me)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._ranks)

    @property
    def half_bytes(self) -> int:
        return self._domain.round_bytes  # what a round fills: autotune may change it

    def stage(self, member: int, half: int) -> np.ndarray:
        return self._domain.stage(self._ranks[member], half)

    def barrier(self) -> None:
        self._domain.barrier(self._ranks)
