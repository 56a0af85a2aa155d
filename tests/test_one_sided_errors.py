"""Errors only one rank can see, and mismatches no check can see, end on every rank.

A rank whose own checks refuse a collective (bad splits, a root out of range) raises at
once and tells the coordinator, so the others fail it too, naming that rank, instead of
waiting for ever. Collectives that do not match at all (a barrier against an allreduce,
one name used for two operations, groups of different sizes) are failed on every rank
once they can never run. Afterwards the job goes on: the next collective works.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import run_ranks

pytestmark = pytest.mark.ranks

CASES = ("splits", "fractional splits", "root", "group sizes", "barrier vs allreduce", "same name", "unpicklable")


def one_sided_job(case: str, culprit: int) -> dict[str, str]:
    import threading

    import hora.numpy as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    me = rank == culprit
    outcome = "no error"
    try:
        if case == "splits":
            hvd.alltoall(np.ones((size, 2)), splits=[1] if me else [1] * size, name="a")
        elif case == "fractional splits":
            hvd.alltoall(np.ones((size, 2)), splits=[1.7] * size if me else [1] * size, name="a")
        elif case == "root":
            hvd.broadcast(np.ones(3), root_rank=size + 3 if me else 0, name="b")
        elif case == "group sizes":
            hvd.grouped_allreduce([np.ones(2)] * (3 if me else 2), name="g")
        elif case == "barrier vs allreduce":
            if me:
                hvd.barrier()
            else:
                hvd.allreduce(np.ones(2), name="x")
        elif case == "same name":
            if me:
                hvd.allgather(np.ones(2), name="c")
            else:
                hvd.allreduce(np.ones(2), name="c")
        elif case == "unpicklable":
            hvd.broadcast_object(threading.Lock() if me else None, root_rank=culprit)
    except Exception as exc:  # noqa: BLE001 - the kind and the message are what the test checks
        outcome = f"{type(exc).__name__}: {exc}"
    # The job goes on.
    total = hvd.allreduce(np.full(2, rank, np.float64), op=hvd.Sum, name="after")
    assert total.tolist() == [sum(range(size))] * 2, total
    hvd.shutdown()
    return {"outcome": outcome}


EXPECTED = {
    # case: (the culprit's error, what every other rank's error contains)
    "splits": ("ValueError: alltoall 'a': splits has 1 entries", "alltoall 'a': refused by rank {c}: ValueError: splits has 1 entries"),
    "fractional splits": ("ValueError: alltoall 'a': splits must be integers", "refused by rank {c}: ValueError: splits must be integers"),
    "root": ("ValueError: broadcast 'b': root_rank", "broadcast 'b': refused by rank {c}: ValueError: root_rank"),
    "group sizes": (
        "CollectiveMismatchError: grouped_allreduce 'g': numbers of tensors in the grouped call differ across ranks",
        "grouped_allreduce 'g': numbers of tensors in the grouped call differ across ranks",
    ),
    "barrier vs allreduce": ("CollectiveMismatchError: collectives do not match across ranks", "rank {c} waits for barrier"),
    "same name": ("CollectiveMismatchError: collectives do not match across ranks", "'c' is used for allgather and allreduce"),
    "unpicklable": ("TypeError", "refused by rank {c}: TypeError"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("size, culprit", [(2, 1), (3, 0), (4, 2)], ids=["np2", "np3", "np4"])
@pytest.mark.timeout(90)
def test_an_error_one_rank_sees_ends_the_collective_on_every_rank(case, size, culprit):
    values = run_ranks(size, one_sided_job, case, culprit, timeout=60)
    mine, theirs = EXPECTED[case]
    assert values[culprit]["outcome"].startswith(mine), values[culprit]
    for rank, value in enumerate(values):
        if rank != culprit:
            assert value["outcome"].startswith("CollectiveMismatchError"), value
            assert theirs.format(c=culprit) in value["outcome"], value
