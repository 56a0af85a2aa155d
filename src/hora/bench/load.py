"""How busy the machine is with other programs: before a backend runs, and while it runs.

On a shared machine other programs are the main source of noise, and they hit the
libraries unevenly (one that spins while it waits suffers most when its core is taken).
``hora-bench`` therefore notes, for every backend's run, the share of all CPUs' time that
other programs used just before it (``busy_share``, while hora-bench itself is idle) and
during it (``ForeignLoad``: the machine's busy time from /proc/stat minus the CPU time of
hora-bench and the processes it started and reaped), and can wait for a quiet moment
before each run (``wait_idle``). Where /proc is missing these return None.
"""

from __future__ import annotations

import os
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _sample() -> tuple[int, int] | None:
    """(all CPUs' jiffies, idle jiffies) since boot, or None."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            values = [int(v) for v in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(values) < 4:
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values), idle


def busy_share(seconds: float = 0.5) -> float | None:
    """The share of all CPUs' time that was busy over the next ``seconds``.

    Called while hora-bench itself is idle: anything well above 0 is another program.
    """
    first = _sample()
    time.sleep(seconds)
    second = _sample()
    if first is None or second is None or second[0] <= first[0]:
        return None
    return 1.0 - (second[1] - first[1]) / (second[0] - first[0])


def wait_idle(limit: float, threshold: float) -> float | None:
    """Waits up to ``limit`` seconds for a second in which others use < ``threshold`` of the CPUs.

    Returns:
        The busy share of the last second sampled (None without /proc).
    """
    deadline = time.monotonic() + limit
    while True:
        share = busy_share(1.0)
        if share is None or share < threshold or time.monotonic() >= deadline:
            return share


def _own_cpu() -> float:
    """CPU seconds of this process and of its children that were reaped (and theirs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class ForeignLoad:
    """Measures the share of all CPUs' time that other programs used between ``start`` and ``stop``.

    The processes of a run must have been reaped by ``stop`` (their CPU time then counts
    as ours); a process reaped by someone else (an orphan) would count as foreign.
    """

    def __init__(self) -> None:
        self._sample: tuple[int, int] | None = None
        self._own = 0.0

    def start(self) -> None:
        self._sample, self._own = _sample(), _own_cpu()

    def stop(self) -> float | None:
        """The share (0-1) of the machine other programs used since ``start``, or None."""
        now, own = _sample(), _own_cpu()
        if self._sample is None or now is None or now[0] <= self._sample[0]:
            return None
        total = (now[0] - self._sample[0]) / _TICK
        busy = total - (now[1] - self._sample[1]) / _TICK
        return min(1.0, max(0.0, (busy - (own - self._own)) / total))
