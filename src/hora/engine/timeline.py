"""The timeline: a Chrome trace of every tensor's negotiation and execution, written by rank 0.

Open the file in ``chrome://tracing`` or Perfetto. The format is Horovod's: a JSON array
of trace events; each tensor is a "process" (``pid``, in order of first appearance,
named after the tensor); on it,

* ``NEGOTIATE_<OP>`` spans from the first rank's request to the moment every rank has
  submitted, with an instant tick named after each rank as its request arrives;
* ``<OP>`` spans the execution on rank 0, with the algorithm that ran nested inside
  (e.g. ``SHM_ALLREDUCE``, ``TCP_RING_ALLREDUCE``), and ends with the tensor's dtype
  and shape as arguments.

With ``mark_cycles``, each pass of the engine loop that did work is an instant
``CYCLE_START`` event. The file is valid JSON after every flush: the closing bracket is
written and then overwritten by the next events.

Only the engine thread calls the recording methods.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any, BinaryIO

_FLUSH_EVERY = 256  # events


class Timeline:
    """Records trace events into ``path``.

    Args:
        path: the file to write (created or truncated).
        mark_cycles: also record an instant event per busy engine loop pass.
        clock: returns nanoseconds; injectable for tests.

    Raises:
        OSError: the file cannot be created.
    """

    def __init__(self, path: str, mark_cycles: bool = False, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.path = path
        self.mark_cycles = mark_cycles
        self._clock = clock
        self._start = clock()
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 - owned until close()
        self._pids: dict[str, int] = {}
        self._pending: list[str] = []
        self._first = True
        header = {"start_time_since_epoch_in_micros": time.time_ns() // 1000}
        self._event({"name": "process_name", "ph": "M", "pid": 0, "args": header})
        self._event({"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}})
        self.flush()

    def _now(self) -> int:
        return (self._clock() - self._start) // 1000

    def _pid(self, tensor: str) -> int:
        pid = self._pids.get(tensor)
        if pid is None:
            pid = self._pids[tensor] = len(self._pids) + 1
            self._event({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": tensor}})
            self._event({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        return pid

    def _event(self, event: dict[str, Any]) -> None:
        self._pending.append(json.dumps(event, separators=(",", ":")))
        if len(self._pending) >= _FLUSH_EVERY:
            self.flush()

    def begin(self, tensor: str, name: str) -> None:
        """Opens a span named ``name`` on the tensor's row."""
        self._event({"ph": "B", "name": name, "ts": self._now(), "pid": self._pid(tensor)})

    def end(self, tensor: str, args: dict[str, str] | None = None) -> None:
        """Closes the innermost open span on the tensor's row."""
        event: dict[str, Any] = {"ph": "E", "ts": self._now(), "pid": self._pid(tensor)}
        if args:
            event["args"] = args
        self._event(event)

    def tick(self, tensor: str, name: str) -> None:
        """An instant mark on the tensor's row (a rank's request arriving)."""
        self._event({"ph": "X", "name": name, "ts": self._now(), "dur": 0, "pid": self._pid(tensor)})

    def cycle(self) -> None:
        """Marks one busy pass of the engine loop, when ``mark_cycles`` is on."""
        if self.mark_cycles:
            self._event({"ph": "i", "name": "CYCLE_START", "ts": self._now(), "s": "g"})

    def flush(self) -> None:
        """Writes pending events, leaving the file a complete JSON array."""
        if not self._pending:
            return
        body = ",\n".join(self._pending)
        self._pending.clear()
        prefix = "[\n" if self._first else ",\n"
        self._first = False
        self._file.write((prefix + body + "\n]").encode())
        self._file.flush()
        self._file.seek(-2, os.SEEK_CUR)  # the next write replaces the closing bracket

    def close(self) -> None:
        """Flushes and closes the file."""
        self.flush()
        self._file.close()
