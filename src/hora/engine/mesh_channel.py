"""A ``Channel`` over the mesh's TCP data links, for one process set."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hora.transport import tcp


class MeshChannel:
    """Connects the members of one process set through their data links.

    Args:
        ranks: the set's global ranks, in set order.
        me: this process's global rank (a member).
        links: peer global rank -> data link.
        watch: control links to keep reading while transfers wait.
    """

    def __init__(self, ranks: tuple[int, ...], me: int, links: dict[int, tcp.Link], watch: tcp.Watch | None) -> None:
        self._ranks = ranks
        self._rank = ranks.index(me)
        self._links = links
        self._watch = watch

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._ranks)

    def _link(self, peer: int) -> tcp.Link:
        return self._links[self._ranks[peer]]

    def ring_stream(self) -> tcp.RingLinks:
        """This rank's links to its right and left neighbours in the set's ring."""
        n = len(self._ranks)
        return tcp.RingLinks(self._link((self._rank + 1) % n), self._link((self._rank - 1) % n), self._watch)

    def exchange(self, sends: Sequence[tuple[int, np.ndarray]], recvs: Sequence[tuple[int, np.ndarray]]) -> None:
        tcp.exchange(
            [(self._link(peer), buffer.data) for peer, buffer in sends if buffer.size],
            [(self._link(peer), buffer.data) for peer, buffer in recvs if buffer.size],
            self._watch,
        )
