"""hora.torch collectives at world sizes 1-4: every function, every dtype, in place, async, process sets.

Each test is one job per world size: every rank runs all cases and returns the list
of cases that disagree with a single-process computation (empty when all agree).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks
from test_torch_support import ALL, FLOATS, INTS, compare, make, setup_rank, wide

pytestmark = pytest.mark.ranks

SIZES = [1, 2, 3, 4]
SHAPES = [(), (0,), (5,), (17, 3), (2, 3, 4)]


def _reduce_expected(inputs: list[torch.Tensor], op_name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    stacked = torch.stack([wide(x) for x in inputs])
    if dtype == torch.bool:
        return {"Sum": stacked.any(0), "Max": stacked.any(0), "Min": stacked.all(0), "Product": stacked.all(0)}[op_name]
    if op_name == "Average":
        mean = stacked.sum(0) / n
        return torch.trunc(mean) if not dtype.is_floating_point else mean
    return {
        "Sum": lambda: stacked.sum(0),
        "Min": lambda: stacked.min(0).values,
        "Max": lambda: stacked.max(0).values,
        "Product": lambda: stacked.prod(0),
    }[op_name]()


def allreduce_job() -> list[str]:
    import hora.torch as hvd

    setup_rank()
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    ops = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}
    # Every case asynchronously first (one batch per dtype, so the suite stays fast) ...
    for dtype in ALL:
        pending = []
        for op_name, op in ops.items():
            if dtype == torch.bool and op_name == "Average":
                continue
            for salt, shape in enumerate(SHAPES):
                inputs = [make(dtype, r, shape, salt, near_one=op_name == "Product") for r in range(n)]
                want = _reduce_expected(inputs, op_name, n, dtype)
                case = f"allreduce {dtype} {op_name} {shape}"
                mine, inplace = inputs[me].clone(), inputs[me].clone()
                pending.append((case, hvd.allreduce_async(mine, op=op, name=case), want, mine, inputs[me], None))
                handle = hvd.allreduce_async_(inplace, op=op, name=case + " in place")
                pending.append((case + " in place", handle, want, inplace, None, inplace.data_ptr()))
        for case, handle, want, tensor, original, pointer in pending:
            got = hvd.synchronize(handle)
            compare(case, got, want, dtype, problems)
            if original is not None and not torch.equal(tensor, original):
                problems.append(f"{case}: the input was modified")
            if pointer is not None and (got is not tensor or tensor.data_ptr() != pointer):
                problems.append(f"{case}: allreduce_async_ did not reduce into its input's storage")
    # ... then the blocking functions, once per dtype and op.
    for dtype in ALL:
        for op_name, op in ops.items():
            if dtype == torch.bool and op_name == "Average":
                continue
            inputs = [make(dtype, r, (17, 3), 7, near_one=op_name == "Product") for r in range(n)]
            want = _reduce_expected(inputs, op_name, n, dtype)
            case = f"allreduce {dtype} {op_name}"
            compare(case, hvd.allreduce(inputs[me], op=op, name=case), want, dtype, problems)
            inplace = inputs[me].clone()
            pointer = inplace.data_ptr()
            if hvd.allreduce_(inplace, op=op, name=case + " in place") is not inplace or inplace.data_ptr() != pointer:
                problems.append(f"{case}: allreduce_ did not reduce into its input's storage")
            compare(case + " in place", inplace, want, dtype, problems)
    # Horovod's positional order: (tensor, average, name, op) and (tensor, average, name, compression, op).
    x = make(torch.float32, me, (4,))
    want = sum(make(torch.float32, r, (4,)) for r in range(n))
    compare("positional allreduce_", hvd.allreduce_(x.clone(), None, "pos_", hvd.Sum), want, torch.float32, problems)
    compare("positional allreduce", hvd.allreduce(x, None, "pos", hvd.Compression.none, hvd.Sum), want, torch.float32, problems)
    compare(
        "positional async", hvd.synchronize(hvd.allreduce_async(x, None, "pos_async", hvd.Sum)), want, torch.float32, problems
    )
    # Scale factors, the deprecated average=, and compression.
    x64 = make(torch.float64, me, (7,))
    got = hvd.allreduce(x64, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25, name="scaled")
    compare("scaled", got, sum(make(torch.float64, r, (7,)) for r in range(n)) * 0.5, torch.float64, problems)
    with pytest.warns(DeprecationWarning):
        got = hvd.allreduce(torch.ones(3) * me, average=False, name="dep")
    compare("average=False", got, torch.ones(3) * sum(range(n)), torch.float32, problems)
    try:
        hvd.allreduce(torch.ones(3), average=True, op=hvd.Sum)
        problems.append("op and average together did not raise")
    except ValueError as exc:
        if "supersedes" not in str(exc):
            problems.append(f"wrong message: {exc}")
    got = hvd.allreduce(x, name="fp16", compression=hvd.Compression.fp16, op=hvd.Sum)
    compare("fp16 compression", got.to(torch.float16), want.to(torch.float16), torch.float16, problems)
    if got.dtype != torch.float32:
        problems.append(f"fp16 compression returned {got.dtype}")
    # Non-contiguous input is fine out of place.
    wide_input = make(torch.float32, me, (4, 6))
    got = hvd.allreduce(wide_input[:, ::2], op=hvd.Sum, name="strided")
    compare("strided", got, sum(make(torch.float32, r, (4, 6)) for r in range(n))[:, ::2], torch.float32, problems)
    # Grouped allreduce, every variant.
    group = [make(torch.float32, me, (3,), 1), make(torch.float64, me, (2, 2), 2), make(torch.int32, me, (5,), 3)]
    wants = [sum(wide(make(t.dtype, r, tuple(t.shape), s)) for r in range(n)) for t, s in zip(group, (1, 2, 3))]
    for variant in ("grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_"):
        tensors = [t.clone() for t in group]
        fn = getattr(hvd, variant)
        result = fn(tensors, op=hvd.Sum, name=variant)
        if variant.startswith("grouped_allreduce_async"):
            result = hvd.synchronize(result)
        if not isinstance(result, list) or len(result) != 3:
            problems.append(f"{variant}: returned {type(result).__name__}")
            continue
        for i, (got_i, want_i, t) in enumerate(zip(result, wants, group)):
            compare(f"{variant} {i}", got_i, want_i, t.dtype, problems)
        if variant.endswith("_") and any(r is not t for r, t in zip(result, tensors)):
            problems.append(f"{variant}: results are not the input tensors")
    handle = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="poll")
    if not isinstance(hvd.poll(handle), bool):
        problems.append("poll did not return a bool")
    compare("poll", hvd.synchronize(handle), torch.full((2,), float(n)), torch.float32, problems)
    if hvd.synchronize(12345678) is not None:
        problems.append("synchronize of an unknown handle is not None")
    hvd.shutdown()
    return problems


def allgather_broadcast_job() -> list[str]:
    import hora.torch as hvd

    setup_rank()
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    for dtype in ALL:
        pending = []
        for salt, tail in enumerate([(), (3,), (2, 2)]):
            rows = [(r * 2 + salt) % 4 for r in range(n)]  # uneven, sometimes zero rows
            inputs = [make(dtype, r, (rows[r], *tail), salt) for r in range(n)]
            case = f"allgather {dtype} {tail}"
            pending.append((case, hvd.allgather_async(inputs[me], name=case), torch.cat(inputs), None))
            if salt == 1:
                compare(case + " sync", hvd.allgather(inputs[me], name=case + " sync"), torch.cat(inputs), dtype, problems)
        for root in range(n):
            for salt, shape in enumerate([(), (4,), (3, 5)]):
                want = make(dtype, root, shape, salt)
                mine, inplace = make(dtype, me, shape, salt), make(dtype, me, shape, salt)
                case = f"broadcast {dtype} root {root} {shape}"
                pending.append((case, hvd.broadcast_async(mine, root, case), want, None))
                pending.append((case + " async_", hvd.broadcast_async_(inplace, root, case + " async_"), want, inplace))
        for case, handle, want, inplace in pending:
            got = hvd.synchronize(handle)
            compare(case, got, want, dtype, problems)
            if inplace is not None and got is not inplace:
                problems.append(f"{case}: broadcast_async_ did not return its input")
        for root in range(n):
            want = make(dtype, root, (3, 5), 9)
            mine = make(dtype, me, (3, 5), 9)
            case = f"broadcast {dtype} root {root}"
            compare(case, hvd.broadcast(mine, root, name=case), want, dtype, problems)
            pointer = mine.data_ptr()
            if hvd.broadcast_(mine, root_rank=root, name=case + " in place") is not mine or mine.data_ptr() != pointer:
                problems.append(f"{case}: broadcast_ did not write into its input")
            compare(case + " in place", mine, want, dtype, problems)
    got = hvd.grouped_allgather([torch.full((me + 1,), me), torch.full((1, 2), float(me))], name="g")
    compare("grouped 0", got[0], torch.cat([torch.full((r + 1,), r) for r in range(n)]), torch.int64, problems)
    compare("grouped 1", got[1], torch.cat([torch.full((1, 2), float(r)) for r in range(n)]), torch.float32, problems)
    got = hvd.synchronize(hvd.grouped_allgather_async([torch.full((2,), me)], name="ga"))
    compare("grouped async", got[0], torch.cat([torch.full((2,), r) for r in range(n)]), torch.int64, problems)
    obj = hvd.broadcast_object({"from": me, "list": list(range(me + 2))}, root_rank=n - 1)
    if obj != {"from": n - 1, "list": list(range(n + 1))}:
        problems.append(f"broadcast_object got {obj}")
    if hvd.allgather_object(("rank", me)) != [("rank", r) for r in range(n)]:
        problems.append("allgather_object")
    hvd.shutdown()
    return problems


def alltoall_reducescatter_job() -> list[str]:
    import hora.torch as hvd

    setup_rank()
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    for dtype in ALL:
        pending = []
        inputs = [make(dtype, r, (2 * n, 3)) for r in range(n)]
        want = torch.cat([inputs[r][2 * me : 2 * me + 2] for r in range(n)])
        even_splits = torch.full((n,), 2, dtype=torch.int32)
        pending.append((f"alltoall even {dtype}", hvd.alltoall_async(inputs[me], name=f"even {dtype}"), want, even_splits))
        if dtype in (torch.float32, torch.bfloat16, torch.bool):
            compare(f"alltoall sync {dtype}", hvd.alltoall(inputs[me], name=f"sync {dtype}"), want, dtype, problems)
        # Uneven splits, as a list and as an int32 tensor; rank r sends (r + j) % 3 rows to j, plus an unsent row.
        splits = [[(r + j) % 3 for j in range(n)] for r in range(n)]
        inputs = [make(dtype, r, (sum(splits[r]) + 1, 2), 5) for r in range(n)]
        offsets = [[sum(s[:j]) for j in range(n + 1)] for s in splits]
        want = torch.cat([inputs[r][offsets[r][me] : offsets[r][me + 1]] for r in range(n)])
        received_want = torch.tensor([splits[r][me] for r in range(n)], dtype=torch.int32)
        for kind, my_splits in (("list", splits[me]), ("tensor", torch.tensor(splits[me], dtype=torch.int32))):
            handle = hvd.alltoall_async(inputs[me], splits=my_splits, name=f"uneven {kind} {dtype}")
            pending.append((f"alltoall uneven {kind} {dtype}", handle, want, received_want))
        got, received = hvd.alltoall(inputs[me], splits=splits[me], name=f"uneven sync {dtype}")
        compare(f"alltoall uneven sync {dtype}", got, want, dtype, problems)
        compare(f"alltoall uneven sync splits {dtype}", received, received_want, torch.int32, problems)
        for case, handle, want, received_want in pending:
            result = hvd.synchronize(handle)
            if not isinstance(result, tuple) or len(result) != 2:
                problems.append(f"{case}: synchronize(alltoall_async) did not return (output, received splits)")
                continue
            compare(case, result[0], want, dtype, problems)
            compare(case + " received splits", result[1], received_want, torch.int32, problems)
    for dtype in FLOATS + INTS:
        pending = []
        for op_name, op in (("Sum", hvd.Sum), ("Average", hvd.Average)):
            for rows in (n, 2 * n + 1, 1, 0):
                inputs = [make(dtype, r, (rows, 3), rows) for r in range(n)]
                total = _reduce_expected(inputs, op_name, n, dtype)
                q, m = divmod(rows, n)
                start = me * q + min(me, m)
                want = total[start : start + q + (1 if me < m else 0)]
                case = f"reducescatter {dtype} {op_name} rows={rows}"
                pending.append((case, hvd.reducescatter_async(inputs[me], name=case, op=op), want))
                if rows == 2 * n + 1:
                    compare(case + " sync", hvd.reducescatter(inputs[me], op=op, name=case + " sync"), want, dtype, problems)
        for case, handle, want in pending:
            compare(case, hvd.synchronize(handle), want, dtype, problems)
    got = hvd.grouped_reducescatter([torch.ones((n, 2)), torch.ones((2 * n,))], op=hvd.Sum, name="g")
    compare("grouped rs 0", got[0], torch.full((1, 2), float(n)), torch.float32, problems)
    compare("grouped rs 1", got[1], torch.full((2,), float(n)), torch.float32, problems)
    got = hvd.synchronize(hvd.grouped_reducescatter_async([torch.ones((n, 2))], op=hvd.Sum, name="ga"))
    compare("grouped rs async", got[0], torch.full((1, 2), float(n)), torch.float32, problems)
    got = hvd.reducescatter(torch.ones(n, 2), compression=hvd.Compression.fp16, op=hvd.Sum, name="rs fp16")
    compare("reducescatter fp16", got, torch.full((1, 2), float(n)), torch.float32, problems)
    got = hvd.reducescatter(torch.ones(n, 2), name="scaled rs", op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    compare("reducescatter scaled", got, torch.full((1, 2), float(n)), torch.float32, problems)
    # Sparse allreduce: allgather of indices and values; duplicates add up.
    dense = torch.zeros(6, 2)
    dense[me % 6] = float(me + 1)
    dense[(me + 1) % 6] = 1.0
    sparse = dense.to_sparse(1)
    for op_name, op in (("Sum", hvd.Sum), ("Average", hvd.Average)):
        total = sum(_sparse_input(r) for r in range(n))
        want = total / n if op_name == "Average" else total
        result = hvd.sparse_allreduce_async(sparse, name=f"sparse {op_name}", op=op)()
        if not result.is_sparse:
            problems.append("sparse_allreduce_async did not return a sparse tensor")
        compare(f"sparse {op_name}", result.to_dense(), want, torch.float32, problems)
    hvd.shutdown()
    return problems


def _sparse_input(rank: int) -> torch.Tensor:
    dense = torch.zeros(6, 2)
    dense[rank % 6] = float(rank + 1)
    dense[(rank + 1) % 6] = 1.0
    return dense


def process_set_job() -> dict:
    import hora.torch as hvd

    setup_rank()
    n = int(__import__("os").environ["HORA_SIZE"])
    evens = hvd.ProcessSet(range(0, n, 2))
    odds = hvd.ProcessSet(range(1, n, 2))
    hvd.init(process_sets=[evens, odds])
    me = hvd.rank()
    mine = evens if me % 2 == 0 else odds
    out: dict = {"included": (evens.included(), odds.included()), "set rank": mine.rank()}
    out["sum"] = hvd.allreduce(torch.tensor([float(me)]), op=hvd.Sum, process_set=mine).tolist()
    out["gather"] = hvd.allgather(torch.tensor([me]), process_set=mine).tolist()
    out["bcast"] = hvd.broadcast(torch.tensor([me]), root_rank=mine.ranks[-1], process_set=mine).tolist()
    t = torch.tensor([float(me)] * 2)
    hvd.allreduce_(t, op=hvd.Max, process_set=mine)
    out["inplace"] = t.tolist()
    out["rs"] = hvd.reducescatter(torch.ones(mine.size(), 1), op=hvd.Sum, process_set=mine).tolist()
    out["a2a"] = hvd.alltoall(torch.arange(mine.size()) + 10 * me, process_set=mine).tolist()
    out["object"] = hvd.broadcast_object(me, root_rank=mine.ranks[0], process_set=mine)  # global ranks
    hvd.barrier(process_set=mine)
    hvd.barrier()
    other = odds if mine is evens else evens
    try:
        hvd.allreduce(torch.ones(1), process_set=other)
        out["outsider"] = "no error"
    except ValueError as exc:
        out["outsider"] = str(exc)
    # join: the last rank joins at once; the others still reduce, the joined rank contributes zeros.
    if me == n - 1:
        out["last joined"] = hvd.join()
    else:
        out["joined sum"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after join").tolist()
        out["last joined"] = hvd.join()
    hvd.shutdown()
    return out


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("job", [allreduce_job, allgather_broadcast_job, alltoall_reducescatter_job], ids=lambda f: f.__name__)
@pytest.mark.timeout(240)
def test_torch_collective(job, size):
    for rank, problems in enumerate(run_ranks(size, job, timeout=200)):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:20])


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.timeout(120)
def test_torch_process_sets_and_join(size):
    results = run_ranks(size, process_set_job, timeout=100)
    for me, out in enumerate(results):
        members = [r for r in range(size) if r % 2 == me % 2]
        assert out["included"] == (me % 2 == 0, me % 2 == 1)
        assert out["set rank"] == members.index(me)
        assert out["sum"] == [float(sum(members))]
        assert out["gather"] == members
        assert out["bcast"] == [members[-1]]
        assert out["inplace"] == [float(max(members))] * 2
        assert out["rs"] == [[float(len(members))]]
        assert out["a2a"] == [m * 10 + members.index(me) for m in members]
        assert out["object"] == members[0]
        assert "is not a member of process set" in out["outsider"]
        # Rank size-1 joined first; the last to join is another one, the same answer on every rank.
        assert out["last joined"] == results[0]["last joined"] and out["last joined"] != size - 1
        if me != size - 1:
            assert out["joined sum"] == [float(size - 1)] * 2
