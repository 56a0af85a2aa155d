"""The tensor queue: entries submitted by user threads and waiting for the engine.

User threads add entries (``add_many``); the engine ``drain``s the new ones to announce them to
the coordinator, and ``pop``s each by name when its response arrives. Names are
unique per process set among entries in flight.

Invariant: an entry is in ``_entries`` from ``add`` until ``pop`` or ``close``, and
appears in ``_new`` at most once, before it is drained. Refusals (``add_refusals``) are
only ever in ``_new``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from hora.collectives.reduce import DataType
from hora.engine.handles import Handle
from hora.engine.messages import Request
from hora.errors import HoraInternalError


@dataclasses.dataclass
class Entry:
    """One submitted tensor.

    Attributes:
        request: what the coordinator is told.
        dtype: the element type.
        input: the data to send, a flat contiguous view (None for barrier and join).
        output: where a result of the input's shape goes (allreduce, broadcast), a
            flat view that may be ``input`` itself; None when the engine allocates it.
        handle: completed with the result.
    """

    request: Request
    dtype: DataType
    input: np.ndarray | None
    output: np.ndarray | None
    handle: Handle

    @property
    def key(self) -> tuple[int, str]:
        return self.request.process_set_id, self.request.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.request.shape


MAX_IN_FLIGHT = 1 << 16  # collectives one rank may have in flight (the coordinator's bound)

DUPLICATE_NAME = (
    "{label}: another tensor of that name is still in flight in process set {set_id}. Names must be "
    "unique among unfinished collectives: wait for the first (synchronize) or use a different name."
)


class TensorQueue:
    """Entries in flight, shared between user threads and the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, str], Entry] = {}
        self._new: list[Entry] = []
        self._closed: Callable[[Entry], BaseException] | None = None

    def add_many(self, entries: list[Entry]) -> None:
        """Queues entries, all or none (the engine learns of them from ``has_new``/``drain``).

        Raises:
            ValueError: an entry's name is in flight in its set already (or twice among
                ``entries``).
            HoraInternalError: the runtime has shut down or failed.
        """
        with self._lock:
            if self._closed is not None:
                raise self._closed(entries[0])
            if len(self._entries) + len(entries) > MAX_IN_FLIGHT:
                raise ValueError(
                    f"{entries[0].request.label}: more than {MAX_IN_FLIGHT} collectives would be in flight on this "
                    "rank; wait for some (synchronize) before submitting more"
                )
            added = {}
            for entry in entries:
                key = entry.key
                if key in self._entries or key in added:
                    raise ValueError(DUPLICATE_NAME.format(label=entry.request.label, set_id=key[0]))
                added[key] = entry
            self._entries.update(added)
            self._new.extend(entries)

    def add_refusals(self, entries: list[Entry]) -> None:
        """Queues requests to announce that are no tensors of this rank: refusals
        (``Request.error``). They never hold their names here, so the program may retry
        at once, and nothing waits for them.

        Raises:
            HoraInternalError: the runtime has shut down or failed.
        """
        with self._lock:
            if self._closed is not None:
                raise self._closed(entries[0])
            self._new.extend(entries)

    def seal(self, error_for: Callable[[Entry], BaseException]) -> None:
        """Refuses later ``add`` calls with ``error_for(entry)``; entries in flight stay."""
        with self._lock:
            if self._closed is None:
                self._closed = error_for

    def has_new(self) -> bool:
        """True when entries were added since the last drain (a racy read, fine for polling)."""
        return bool(self._new)

    def drain(self) -> list[Entry]:
        """Returns the entries added since the last drain, in submission order."""
        with self._lock:
            new, self._new = self._new, []
            return new

    def peek(self, set_id: int, name: str) -> Entry | None:
        """Returns the entry without removing it, or None if this rank never submitted it."""
        with self._lock:
            return self._entries.get((set_id, name))

    def pop(self, set_id: int, name: str) -> Entry | None:
        """Removes and returns the entry, or None if this rank never submitted it."""
        with self._lock:
            return self._entries.pop((set_id, name), None)

    def pop_many(self, set_id: int, names: list[str]) -> list[Entry | None]:
        """``pop`` for each of ``names``, in order, under one lock (a fused response's tensors)."""
        with self._lock:
            pop = self._entries.pop
            return [pop((set_id, name), None) for name in names]

    def close(self, error_for: Callable[[Entry], BaseException]) -> None:
        """Fails every entry in flight and every later ``add`` with ``error_for(entry)``.

        A reason given earlier (by ``seal`` or ``close``) stays the one later adds see.
        """
        with self._lock:
            if self._closed is None:
                self._closed = error_for
            entries = list(self._entries.values())
            self._entries.clear()
            self._new.clear()
        for entry in entries:
            entry.handle.fail(error_for(entry))

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


def internal_error(reason: str) -> Callable[[Entry], BaseException]:
    """Builds the error each entry fails with when the job fails or shuts down."""

    def error_for(entry: Entry) -> BaseException:
        return HoraInternalError(f"{entry.request.label} failed: {reason}")

    return error_for
