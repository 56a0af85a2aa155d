"""The table of process sets a runtime knows: id -> sorted global ranks."""

from __future__ import annotations

import threading


class ProcessSetTable:
    """Process sets by id; id 0 is the global set.

    Thread-safe: the engine thread registers sets while user threads look them up.
    """

    def __init__(self, size: int) -> None:
        self._lock = threading.Lock()
        self._sets: dict[int, tuple[int, ...]] = {0: tuple(range(size))}

    def ranks(self, set_id: int) -> tuple[int, ...]:
        """Returns the set's global ranks in order.

        Raises:
            KeyError: no set has this id.
        """
        with self._lock:
            return self._sets[set_id]

    def get(self, set_id: int) -> tuple[int, ...] | None:
        with self._lock:
            return self._sets.get(set_id)

    def find(self, ranks: tuple[int, ...]) -> int | None:
        """Returns the id of the set with exactly these ranks, if any."""
        with self._lock:
            for set_id, members in self._sets.items():
                if members == ranks:
                    return set_id
        return None

    def add(self, set_id: int, ranks: tuple[int, ...]) -> None:
        with self._lock:
            self._sets[set_id] = ranks

    def remove(self, set_id: int) -> bool:
        with self._lock:
            return self._sets.pop(set_id, None) is not None

    def ids(self) -> list[int]:
        with self._lock:
            return sorted(self._sets)
