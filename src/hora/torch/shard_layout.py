"""How sharding splits parameters over ranks, and how buckets lay them out (no communication).

- ``partition(n, N)``: rank ``r`` owns ``n // N + (1 if r < n % N else 0)`` consecutive
  elements of a flat parameter of ``n``, as hora's reducescatter splits dimension 0
  (elementwise optimizers).
- ``owners_by_size`` and ``whole``: each parameter whole on one rank, assigned greedily by
  size (optimizers whose update of an element needs others: Adafactor's factored moments).
- A ``Bucket`` is a run of parameters that travel in one collective; its buffer holds one
  segment per rank, each ``width`` elements: that rank's slices in slot order, then zeros.
  The layout depends only on the slots' order, sizes and dtype, so every rank computes
  the same one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hora.collectives.ring import even_bounds


def partition(n: int, parts: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` of each rank's slice of ``n`` elements, as hora's reducescatter splits them.

    Example: ``partition(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]``; ``partition(2, 3) ==
    [(0, 1), (1, 2), (2, 2)]``.
    """
    return [(offset, offset + length) for offset, length in even_bounds(n, parts)]


def owners_by_size(sizes: list[int], parts: int) -> list[int]:
    """The rank that owns each whole parameter: largest first, each to the rank holding the
    fewest elements so far (the lowest such rank on a tie), as ZeroRedundancyOptimizer
    assigns them. Every rank computes the same from the sizes alone.

    Example: ``owners_by_size([5, 1, 3, 3], 2) == [0, 0, 1, 1]``: 5 goes to rank 0, the
    two 3s to rank 1 (3 < 5, then 6), the 1 to rank 0 (5 < 6).
    """
    loads = [0] * parts
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(parts), key=lambda r: (loads[r], r))
        owners[i] = owner
        loads[owner] += sizes[i]
    return owners


def whole(n: int, owner: int, parts: int) -> list[tuple[int, int]]:
    """Bounds that give all ``n`` elements to ``owner`` (``[start, end)`` per rank, consecutive)."""
    return [(0, 0) if r < owner else (0, n) if r == owner else (n, n) for r in range(parts)]


@dataclasses.dataclass(eq=False)
class Slot:
    """One trainable parameter as the sharded optimizer sees it."""

    param: torch.Tensor
    name: str
    index: int  # the parameter's number in the user's optimizer's state_dict()
    bounds: list[tuple[int, int]]  # every rank's slice of the flat parameter
    piece: torch.Tensor | None  # this rank's slice (a view), None when empty


@dataclasses.dataclass(eq=False)
class Bucket:
    """Parameters that travel in one collective, in a buffer laid out rank by rank.

    Rank ``r``'s segment is ``[r * width, (r + 1) * width)``: its slice of each slot's
    parameter in slot order, then zeros up to ``width`` (the longest rank's total), so
    every segment has the same length and a reducescatter of the buffer hands rank
    ``r`` exactly its segment.
    """

    slots: list[Slot]
    width: int
    offsets: list[list[int]]  # offsets[r][k]: where slot k's slice of rank r starts in rank r's segment
    name: str

    def pack(self, r: int, flats: list[torch.Tensor | None], segment: torch.Tensor) -> None:
        """Writes rank ``r``'s slices of ``flats`` (flat tensors; None means zeros) into ``segment``."""
        end = 0
        for k, slot in enumerate(self.slots):
            a, b = slot.bounds[r]
            start, end = self.offsets[r][k], self.offsets[r][k] + b - a
            flat = flats[k]
            if flat is None:
                segment[start:end].zero_()
            else:
                segment[start:end].copy_(flat[a:b])
        segment[end:].zero_()

    def slices(self, r: int, segment: torch.Tensor) -> list[torch.Tensor]:
        """Views of rank ``r``'s slice of each slot in ``segment`` (a segment laid out as ``pack`` writes)."""
        views = []
        for k, slot in enumerate(self.slots):
            a, b = slot.bounds[r]
            views.append(segment[self.offsets[r][k] : self.offsets[r][k] + b - a])
        return views


def buckets(slots: list[Slot], parts: int, cap: int) -> list[Bucket]:
    """Consecutive slots (in the order given) of one dtype, up to ``cap`` bytes a bucket."""
    groups: list[list[Slot]] = []
    nbytes = 0
    for slot in slots:
        size_ = slot.param.numel() * slot.param.element_size()
        current = groups[-1] if groups else None
        if current is None or current[0].param.dtype != slot.param.dtype or nbytes + size_ > cap:
            groups.append([slot])
            nbytes = size_
        else:
            current.append(slot)
            nbytes += size_
    result = []
    for group in groups:
        offsets = []
        for r in range(parts):
            lengths = [slot.bounds[r][1] - slot.bounds[r][0] for slot in group]
            offsets.append([sum(lengths[:k]) for k in range(len(group))])
        width = max(sum(slot.bounds[r][1] - slot.bounds[r][0] for slot in group) for r in range(parts))
        result.append(Bucket(group, width, offsets, group[0].name))
    return result


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def sliced(key: str, value: Any, p: torch.Tensor) -> bool:
    """Whether state entry ``key`` of ``p`` (a parameter or a piece) holds one value per element
    (and is sharded), rather than a scalar such as ``step`` (kept whole on every rank)."""
    if key == "step" or not isinstance(value, torch.Tensor):
        return False
    return value.dim() > 0 or p.dim() == 0
