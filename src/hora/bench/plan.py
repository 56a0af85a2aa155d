"""What ``hora-bench`` measures: the sizes, collectives, type and counts, as one JSON-able plan.

The plan is the contract between the launcher side (``hora.bench.cli``) and every rank of
every backend (``hora.bench.worker``), so hora and its peers run exactly the same sizes
with the same settings. Sizes follow nccl-tests: ``-b BEGIN -e END -f FACTOR`` (each size
is the previous one times FACTOR), or an explicit ``--sizes`` list; both take K, M and G
suffixes (powers of 1024).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from hora.bench.worker import COLLECTIVES, DTYPES, OPS

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
MAX_SIZES = 200


def parse_size(text: str) -> int:
    """Parses ``4``, ``4K``, ``256M``, ``1GiB``, ``64KB`` into bytes (K = 1024).

    Raises:
        ValueError: not a size of at least one byte.
    """
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"invalid size {text!r}: expected bytes with an optional K, M or G suffix, e.g. 4, 64K, 256M")
    value = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise ValueError(f"invalid size {text!r}: expected at least 1 byte")
    return value


def size_range(begin: int, end: int, factor: float) -> list[int]:
    """Returns ``begin, begin*factor, ...`` up to and including ``end`` (like nccl-tests' ``-b -e -f``).

    Raises:
        ValueError: ``end < begin``, ``factor <= 1`` with ``end > begin``, or more than
            ``MAX_SIZES`` sizes.
    """
    if end < begin:
        raise ValueError(f"-e/--maxbytes {end} is below -b/--minbytes {begin}")
    if end > begin and not factor > 1:
        raise ValueError(f"-f/--stepfactor {factor:g} is not valid: expected a number > 1")
    sizes = [begin]
    while sizes[-1] < end:
        following = max(sizes[-1] + 1, int(sizes[-1] * factor))
        if following > end:
            break
        sizes.append(following)
        if len(sizes) > MAX_SIZES:
            raise ValueError(f"-b {begin} -e {end} -f {factor:g} gives more than {MAX_SIZES} sizes: raise -f")
    return sizes


def parse_sizes(text: str) -> list[int]:
    """Parses a comma-separated ``--sizes`` list, e.g. ``4,4K,1M,256M``."""
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ValueError("--sizes is empty: expected a comma-separated list such as 4,4K,1M")
    return sizes


def parse_collectives(text: str) -> list[str]:
    """Parses ``--collective``: ``all`` or a comma-separated list of ``COLLECTIVES``."""
    if text.strip().lower() == "all":
        return list(COLLECTIVES)
    chosen = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        if part not in COLLECTIVES:
            raise ValueError(f"unknown collective {part!r}: expected 'all' or some of {', '.join(COLLECTIVES)}")
        if part not in chosen:
            chosen.append(part)
    if not chosen:
        raise ValueError(f"--collective is empty: expected 'all' or some of {', '.join(COLLECTIVES)}")
    return chosen


def human_bytes(nbytes: int) -> str:
    """``4 B``, ``64 KiB``, ``256 MiB``; sizes that are not a whole unit stay in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


@dataclasses.dataclass(frozen=True)
class Plan:
    """One benchmark's settings; ``to_json`` is what every rank of every backend reads.

    Attributes:
        collectives: the collectives to time, in order.
        sizes: the requested sizes in bytes (see ``worker.counts`` for the counts used).
        dtype: the element type, one of ``worker.DTYPES``.
        op: the reduction of allreduce and reducescatter, one of ``worker.OPS``.
        root: broadcast's root rank.
        iters: timed iterations per size; 0 picks ``worker.auto_iters``.
        warmup: untimed iterations per size.
        check: verify each size's result once before timing it.
        latency: back-to-back 4-byte allreduces after the tables (0: none).
        wait: seconds the last rank sleeps in the CPU-while-waiting test (0: none).
        max_time: seconds of timed iterations per size after which a size stops early
            (checked every 10 iterations; 0: never).
    """

    collectives: tuple[str, ...] = ("allreduce",)
    sizes: tuple[int, ...] = tuple(size_range(4, 256 << 20, 4))
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    iters: int = 0
    warmup: int = 5
    check: bool = True
    latency: int = 1000
    wait: float = 5.0
    max_time: float = 20.0

    def validate(self, world_size: int) -> None:
        """Raises ValueError, naming the flag, when a setting cannot run on ``world_size`` ranks."""
        if self.dtype not in DTYPES:
            raise ValueError(f"-d/--dtype {self.dtype!r} is not valid: expected one of {', '.join(DTYPES)}")
        if self.op not in OPS:
            raise ValueError(f"-o/--op {self.op!r} is not valid: expected one of {', '.join(OPS)}")
        if not 0 <= self.root < world_size:
            raise ValueError(f"-r/--root {self.root} is not valid on {world_size} ranks: expected 0 to {world_size - 1}")
        for flag, value in (("-n/--iters", self.iters), ("-w/--warmup", self.warmup), ("--latency", self.latency)):
            if value < 0:
                raise ValueError(f"{flag} {value} is not valid: expected an integer >= 0")
        if not self.wait >= 0:
            raise ValueError(f"--wait-test {self.wait} is not valid: expected seconds >= 0")
        if not self.max_time >= 0:
            raise ValueError(f"--max-time {self.max_time} is not valid: expected seconds >= 0")

    def to_json(self) -> dict[str, Any]:
        """The plan as ``worker.run`` reads it."""
        data = dataclasses.asdict(self)
        data["collectives"], data["sizes"] = list(self.collectives), list(self.sizes)
        return data
