"""hora.torch error paths: local errors raise at once; cross-rank mismatches raise on every rank."""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks
from test_torch_support import setup_rank

pytestmark = pytest.mark.ranks


def local_errors_job() -> list[str]:
    import hora.torch as hvd

    setup_rank()
    hvd.init()
    messages = []
    # Rank 1 submits "dup" only after the barrier, so rank 0's first "dup" is surely in flight.
    if hvd.rank() == 0:
        handle = hvd.allreduce_async(torch.ones(3), name="dup")
        try:
            hvd.allreduce_async(torch.ones(3), name="dup")
        except ValueError as exc:
            messages.append(str(exc))
        hvd.barrier()
    else:
        hvd.barrier()
        handle = hvd.allreduce_async(torch.ones(3), name="dup")
        messages.append("allreduce 'dup': another tensor of that name is still in flight (checked on rank 0)")
    hvd.synchronize(handle)
    hvd.allreduce(torch.ones(3), name="dup")  # the name is free again
    calls = [
        lambda: hvd.allreduce_(torch.ones(4, 4)[:, 0], name="strided"),
        lambda: hvd.broadcast_(torch.ones(4, 4).t(), 0, name="strided b"),
        lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64), name="complex"),
        lambda: hvd.allgather(torch.ones(2, dtype=torch.uint32), name="uint32"),
        lambda: hvd.allreduce(torch.ones(2, 2).to_sparse(), name="sparse"),
        lambda: hvd.allreduce(torch.ones(2, device="meta"), name="meta"),
        lambda: hvd.alltoall(torch.ones(3), name="a"),  # 3 rows do not split evenly over 2 ranks
        lambda: hvd.alltoall(torch.ones(4), splits=[3, 2], name="b"),
        lambda: hvd.alltoall(torch.ones(4), splits=[1], name="c"),
        lambda: hvd.alltoall(torch.ones(4), splits=torch.tensor([2, 2]), name="int64 splits"),
        lambda: hvd.broadcast(torch.ones(2), root_rank=5, name="d"),
        lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool), name="f"),
        lambda: hvd.reducescatter(torch.ones(4), op=hvd.Max, name="h"),
        lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum),
        lambda: hvd.allgather(torch.tensor(1.0), name="scalar"),
        lambda: hvd.sparse_allreduce_async(torch.ones(2, 2).to_sparse(), name="s", op=hvd.Max),
        lambda: hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum),
    ]
    for call in calls:
        try:
            call()
            messages.append("no error")
        except (ValueError, RuntimeError) as exc:  # an unsupported op raises Horovod's RuntimeError class
            messages.append(str(exc))
    hvd.shutdown()
    return messages


@pytest.mark.timeout(90)
def test_local_errors_raise_at_once():
    for messages in run_ranks(2, local_errors_job):
        expected = [
            "allreduce 'dup': another tensor of that name is still in flight",
            "Tensor is required to be contiguous.",
            "Tensor is required to be contiguous.",
            "Tensor type torch.ComplexFloatTensor is not supported.",
            "Tensor type torch.UInt32Tensor is not supported.",
            "torch.sparse_coo tensors are not supported; pass a dense tensor (use sparse_allreduce_async",
            "a tensor on the meta device has no data to send",
            "must divide evenly",
            "splits sum to 5, more than the first dimension (4)",
            "splits has 1 entries; the process set has 2 ranks",
            "splits must be an int32 tensor or a list of ints; got a torch.int64 tensor",
            "root_rank 5 is not a rank of the process set",
            "Average is not defined for bool",
            "reduce op Max is not supported here",
            "Adasum needs floating-point tensors; got int32",
            "allgather needs a tensor with at least one dimension",
            "supports op=Average or op=Sum only",
            "The op parameter supersedes average. Please provide only one of them.",
        ]
        assert len(messages) == len(expected), messages
        for got, want in zip(messages, expected):
            assert want in got, f"{want!r} not in {got!r}"
        assert messages[1] == "Tensor is required to be contiguous."


def mismatch_job() -> list[tuple[str, str, str]]:
    import hora.torch as hvd

    setup_rank()
    hvd.init()
    r = hvd.rank()
    cases = {
        "shape": lambda: hvd.allreduce(torch.ones(2, 3 + r), name="shape"),
        "dtype": lambda: hvd.allreduce(torch.ones(3, dtype=torch.float32 if r == 0 else torch.int64), name="dtype"),
        "op": lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum if r == 0 else hvd.Max, name="op"),
        "in place shape": lambda: hvd.allreduce_(torch.ones(2 + r), name="ip"),
        "root": lambda: hvd.broadcast(torch.ones(3), root_rank=r % 2, name="root"),
        "gather dims": lambda: hvd.allgather(torch.ones(2, 1 + r), name="gdims"),
        "alltoall dims": lambda: hvd.alltoall(torch.ones(hvd.size(), 1 + r), name="adims"),
        "reducescatter shape": lambda: hvd.reducescatter(torch.ones(4 + r, 2), name="rs"),
        "grouped": lambda: hvd.grouped_allreduce([torch.ones(2), torch.ones(1 + r)], name="grp"),
    }
    seen = []
    for case, call in cases.items():
        try:
            call()
            seen.append((case, "no error", ""))
        except hvd.CollectiveMismatchError as exc:
            seen.append((case, type(exc).__name__, str(exc)))
        total = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"after {case}")  # the job goes on
        assert total.tolist() == [float(hvd.size())] * 2
    hvd.shutdown()
    return seen


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.timeout(120)
def test_mismatches_raise_on_every_rank_and_the_job_goes_on(size):
    expected = {
        "shape": "allreduce 'shape': shapes differ across ranks: rank 0: (2, 3), rank 1: (2, 4)",
        "dtype": "data types differ across ranks: rank 0: float32, rank 1: int64",
        "op": "reduce ops differ across ranks: rank 0: Sum, rank 1: Max",
        "in place shape": "shapes differ across ranks: rank 0: (2,), rank 1: (3,)",
        "root": "root ranks differ across ranks: rank 0: 0, rank 1: 1",
        "gather dims": "shapes beyond the first dimension differ across ranks",
        "alltoall dims": "shapes beyond the first dimension differ across ranks",
        "reducescatter shape": "shapes differ across ranks: rank 0: (4, 2), rank 1: (5, 2)",
        "grouped": "shapes differ across ranks",
    }
    for rank, seen in enumerate(run_ranks(size, mismatch_job, timeout=100)):
        assert [case for case, _, _ in seen] == list(expected)
        for case, kind, message in seen:
            assert kind == "CollectiveMismatchError", f"rank {rank} {case}: {kind}"
            if size == 2:
                assert expected[case] in message, f"rank {rank} {case}: {message}"
            else:  # ranks that agree are listed together ("ranks 1, 2: ..."); every rank is named
                what = expected[case].split(" differ across ranks")[0].split(": ")[-1]
                assert f"{what} differ" in message and "0" in message and "2" in message, message


def adasum_errors_job() -> list[str]:
    import hora.torch as hvd

    setup_rank()
    hvd.init(process_sets=[hvd.ProcessSet([0, 1])])
    messages = []
    for call in (
        lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum, name="adasum 3 ranks"),
        lambda: hvd.DistributedOptimizer(
            torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), op=hvd.Adasum,
            process_set=hvd.ProcessSet([0, 1]),
        ),
    ):
        try:
            call()
            messages.append("no error")
        except NotImplementedError as exc:
            messages.append(str(exc))
    hvd.shutdown()
    return messages


@pytest.mark.timeout(60)
def test_adasum_refuses_what_it_cannot_do():
    for messages in run_ranks(3, adasum_errors_job, timeout=50):
        assert "needs a power-of-two number of ranks; the job has 3" in messages[0]
        assert "Adasum does not support non-global process sets yet." in messages[1]
