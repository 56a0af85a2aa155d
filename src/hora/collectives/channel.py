"""The interface collective algorithms talk through.

A ``Channel`` connects the members of one process set. Peers are named by their
rank within the set (0 .. size-1). Buffers are contiguous 1-D NumPy arrays of any
dtype; a channel moves their bytes without copying them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Channel(Protocol):
    """Point-to-point transfers among the ranks of one process set."""

    @property
    def rank(self) -> int:
        """This process's rank within the set."""

    @property
    def size(self) -> int:
        """The number of ranks in the set."""

    def exchange(self, sends: Sequence[tuple[int, np.ndarray]], recvs: Sequence[tuple[int, np.ndarray]]) -> None:
        """Sends and receives the given buffers concurrently; returns when all are done.

        Args:
            sends: (peer, buffer) pairs; each buffer is sent whole.
            recvs: (peer, buffer) pairs; each buffer is filled whole.

        Raises:
            HoraInternalError: a peer was lost.
        """
