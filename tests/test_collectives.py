"""Every collective x dtype x op at world sizes 1-4, against NumPy on the concatenated inputs.

Each test is one job: every rank runs all cases of one collective and returns the
list of cases that went wrong (empty when all agree with NumPy).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from data import ALL, BFLOAT16, FLOATS, INTS, make, tolerance
from harness import ROOT, run_ranks

pytestmark = pytest.mark.ranks

SIZES = [1, 2, 3, 4]
SHAPES = [(), (0,), (1,), (5,), (17, 3), (2, 3, 4)]


def _wide(array: np.ndarray) -> np.ndarray:
    """Computes expectations in float64 (or exactly, for ints and bools)."""
    if array.dtype == np.bool_ or array.dtype.kind in "iu":
        return array.astype(np.int64) if array.dtype != np.bool_ else array
    return array.astype(np.float64)


def _compare(case: str, got: np.ndarray, want: np.ndarray, dtype: np.dtype, problems: list[str]) -> None:
    if got.shape != want.shape:
        problems.append(f"{case}: shape {got.shape} != {want.shape}")
        return
    if got.dtype != dtype:
        problems.append(f"{case}: dtype {got.dtype} != {dtype}")
        return
    if dtype.kind in "fV" or dtype == BFLOAT16:
        ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tolerance(dtype), atol=tolerance(dtype))
    else:
        ok = np.array_equal(got, want.astype(dtype))
    if not ok:
        problems.append(f"{case}: got {got.reshape(-1)[:6]} want {want.reshape(-1)[:6]}")


def allreduce_job() -> list[str]:
    import hora.numpy as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    ops = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}
    for dtype in ALL:
        for op_name, op in ops.items():
            if dtype == np.bool_ and op_name == "Average":
                continue
            for salt, shape in enumerate(SHAPES):
                near_one = op_name == "Product"
                inputs = [make(dtype, r, shape, salt, near_one) for r in range(n)]
                wide = np.stack([_wide(x) for x in inputs]) if shape != () else np.array([_wide(x) for x in inputs])
                if dtype == np.bool_:
                    want = {"Sum": wide.any(0), "Max": wide.any(0), "Min": wide.all(0), "Product": wide.all(0)}[op_name]
                elif op_name == "Average":
                    want = wide.sum(0) / n
                    if dtype.kind in "iu":
                        want = np.trunc(want)
                else:
                    want = {"Sum": wide.sum(0), "Min": wide.min(0), "Max": wide.max(0), "Product": wide.prod(0)}[op_name]
                case = f"allreduce {dtype} {op_name} {shape}"
                mine = inputs[me].copy()
                got = hvd.allreduce(mine, op=op, name=case)
                _compare(case, np.asarray(got), np.asarray(want), dtype, problems)
                if not np.array_equal(mine, inputs[me]):
                    problems.append(f"{case}: the input was modified")
                inplace = inputs[me].copy()
                returned = hvd.allreduce_(inplace, op=op, name=case + " in place")
                if returned is not inplace:
                    problems.append(f"{case}: allreduce_ did not return its input")
                _compare(case + " in place", inplace, np.asarray(want), dtype, problems)
    # prescale / postscale
    x = make(np.dtype(np.float64), me, (7,))
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25, name="scaled")
    want = sum(make(np.dtype(np.float64), r, (7,)) for r in range(n)) * 2.0 * 0.25
    _compare("scaled", got, want, np.dtype(np.float64), problems)
    # deprecated average=
    with pytest.warns(DeprecationWarning):
        got = hvd.allreduce(np.ones(3) * me, average=False, name="dep")
    _compare("average=False", got, np.ones(3) * sum(range(n)), np.dtype(np.float64), problems)
    # One grouped call across the ride budget (HORA_RIDE_BYTES, 4 KiB): the first and third
    # tensors' data rides with the requests, the others' does not, and the results fuse apart.
    counts = (750, 750, 50, 5000)
    got = hvd.grouped_allreduce([np.full(c, me + 1.0, np.float32) for c in counts], op=hvd.Sum, name="straddle")
    for count, tensor in zip(counts, got):
        _compare(f"straddle {count}", tensor, np.full(count, n * (n + 1) / 2), np.dtype(np.float32), problems)
    try:
        hvd.allreduce(np.ones(3), average=True, op=hvd.Sum)
        problems.append("op and average together did not raise")
    except ValueError as exc:
        if "supersedes" not in str(exc):
            problems.append(f"wrong message: {exc}")
    hvd.shutdown()
    return problems


def allgather_job() -> list[str]:
    import hora.numpy as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    for dtype in ALL:
        for salt, tail in enumerate([(), (3,), (2, 2)]):
            rows = [(r * 2 + salt) % 4 for r in range(n)]  # uneven, sometimes zero rows
            inputs = [make(dtype, r, (rows[r], *tail), salt) for r in range(n)]
            want = np.concatenate(inputs)
            case = f"allgather {dtype} {tail}"
            _compare(case, hvd.allgather(inputs[me], name=case), want, dtype, problems)
    got = hvd.grouped_allgather([np.full((me + 1,), me), np.full((1, 2), float(me))], name="g")
    _compare("grouped 0", got[0], np.concatenate([np.full((r + 1,), r) for r in range(n)]), got[0].dtype, problems)
    _compare("grouped 1", got[1], np.concatenate([np.full((1, 2), float(r)) for r in range(n)]), got[1].dtype, problems)
    hvd.shutdown()
    return problems


def broadcast_job() -> list[str]:
    import hora.numpy as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    for dtype in ALL:
        for root in range(n):
            for salt, shape in enumerate([(), (4,), (3, 5)]):
                want = make(dtype, root, shape, salt)
                mine = make(dtype, me, shape, salt)
                case = f"broadcast {dtype} root {root} {shape}"
                _compare(case, hvd.broadcast(mine, root, name=case), want, dtype, problems)
                hvd.broadcast_(mine, root_rank=root, name=case + " in place")
                _compare(case + " in place", mine, want, dtype, problems)
    # Larger buffers take other algorithms over TCP at 3+ ranks: 64 KiB goes along a binomial
    # tree, 256 KiB at 4 ranks scatters and allgathers, the rest streams along the ring as a
    # chain (an odd size: a short last chunk).
    for count in (16 * 1024, 64 * 1024, 700_001):
        for root in range(n):
            case = f"broadcast of {count} float32 from root {root}"
            want = np.arange(count, dtype=np.float32) + root
            _compare(case, hvd.broadcast(np.arange(count, dtype=np.float32) + me, root, name=case), want,
                     np.dtype(np.float32), problems)  # fmt: skip
    obj = hvd.broadcast_object({"from": me, "list": list(range(me + 2))}, root_rank=n - 1)
    if obj != {"from": n - 1, "list": list(range(n + 1))}:
        problems.append(f"broadcast_object got {obj}")
    gathered = hvd.allgather_object(("rank", me))
    if gathered != [("rank", r) for r in range(n)]:
        problems.append(f"allgather_object got {gathered}")
    hvd.shutdown()
    return problems


def alltoall_job() -> list[str]:
    import hora.numpy as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    for dtype in ALL:
        # even split
        inputs = [make(dtype, r, (2 * n, 3)) for r in range(n)]
        want = np.concatenate([inputs[r][2 * me : 2 * me + 2] for r in range(n)])
        _compare(f"alltoall even {dtype}", hvd.alltoall(inputs[me], name=f"even {dtype}"), want, dtype, problems)
        # explicit uneven splits; rank r sends (r + j) % 3 rows to rank j, plus an unsent tail row
        splits = [[(r + j) % 3 for j in range(n)] for r in range(n)]
        inputs = [make(dtype, r, (sum(splits[r]) + 1, 2), 5) for r in range(n)]
        offsets = [np.concatenate(([0], np.cumsum(s))) for s in splits]
        want = np.concatenate([inputs[r][offsets[r][me] : offsets[r][me + 1]] for r in range(n)])
        got, received = hvd.alltoall(inputs[me], splits=splits[me], name=f"uneven {dtype}")
        _compare(f"alltoall uneven {dtype}", got, want, dtype, problems)
        if list(received) != [splits[r][me] for r in range(n)]:
            problems.append(f"received splits {list(received)}")
    hvd.shutdown()
    return problems


def reducescatter_job() -> list[str]:
    import hora.numpy as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    for dtype in FLOATS + INTS:
        for op_name, op in (("Sum", hvd.Sum), ("Average", hvd.Average)):
            for rows in (n, 2 * n + 1, 1, 0):
                inputs = [make(dtype, r, (rows, 3), rows) for r in range(n)]
                total = np.stack([_wide(x) for x in inputs]).sum(0)
                if op_name == "Average":
                    total = total / n
                    if dtype.kind in "iu":
                        total = np.trunc(total)
                q, m = divmod(rows, n)
                start = me * q + min(me, m)
                want = total[start : start + q + (1 if me < m else 0)]
                case = f"reducescatter {dtype} {op_name} rows={rows}"
                _compare(case, hvd.reducescatter(inputs[me], op=op, name=case), want, dtype, problems)
    got = hvd.grouped_reducescatter([np.ones((n, 2)), np.ones((2 * n,))], op=hvd.Sum, name="g")
    _compare("grouped rs 0", got[0], np.full((1, 2), float(n)), np.dtype(np.float64), problems)
    _compare("grouped rs 1", got[1], np.full((2,), float(n)), np.dtype(np.float64), problems)
    hvd.shutdown()
    return problems


# Ranks on one machine use shared memory by default; HORA_SHARED_MEMORY=0 forces the TCP ring.
TRANSPORTS = {"shm": {}, "tcp": {"HORA_SHARED_MEMORY": "0"}}
CASES = [(size, transport) for size in SIZES for transport in TRANSPORTS if size > 1 or transport == "shm"]


@pytest.mark.parametrize("size, transport", CASES, ids=[f"np{s}-{t}" for s, t in CASES])
@pytest.mark.parametrize(
    "job", [allreduce_job, allgather_job, broadcast_job, alltoall_job, reducescatter_job], ids=lambda f: f.__name__
)
@pytest.mark.timeout(240)
def test_collective(job, size, transport):
    results = run_ranks(size, job, timeout=200, env=TRANSPORTS[transport])
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:20])


# By default small allreduces and broadcasts ride the negotiation (hora.engine.riders) and
# no data phase runs; here the data plane moves the same small tensors itself.
NO_RIDE_CASES = [(size, transport) for size in SIZES[1:] for transport in TRANSPORTS]


@pytest.mark.parametrize("size, transport", NO_RIDE_CASES, ids=[f"np{s}-{t}" for s, t in NO_RIDE_CASES])
@pytest.mark.parametrize("job", [allreduce_job, broadcast_job], ids=lambda f: f.__name__)
@pytest.mark.timeout(240)
def test_small_collectives_without_riders(job, size, transport):
    results = run_ranks(size, job, timeout=200, env=TRANSPORTS[transport] | {"HORA_RIDE_BYTES": "0"})
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:20])


def adasum_job() -> list[str]:
    import hora.numpy as hvd
    from hora.collectives.adasum import combine

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    if n & (n - 1):
        try:
            hvd.allreduce(np.ones(3), op=hvd.Adasum)
            problems.append("no error at a size that is not a power of two")
        except NotImplementedError as exc:
            if "power-of-two" not in str(exc):
                problems.append(str(exc))
        hvd.shutdown()
        return problems
    for dtype in (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)):
        shapes = [(6,), (3, 4), (1,)]
        inputs = {r: [make(dtype, r, shape, salt) for salt, shape in enumerate(shapes)] for r in range(n)}
        # The reference: the same binary tree of pairwise combinations, per tensor.
        want = []
        for t in range(len(shapes)):
            level = [inputs[r][t].reshape(-1).astype(np.float64) for r in range(n)]
            while len(level) > 1:
                level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
            want.append(level[0].reshape(shapes[t]))
        got = hvd.grouped_allreduce(inputs[me], op=hvd.Adasum, name=f"adasum {dtype}")  # fused
        for t, (g, w) in enumerate(zip(got, want)):
            _compare(f"adasum {dtype} tensor {t}", g, w, dtype, problems)
    # Orthogonal vectors add; parallel ones average.
    e = np.zeros(n)
    e[me] = 1.0
    _compare("orthogonal", hvd.allreduce(e, op=hvd.Adasum, name="orth"), np.ones(n), np.dtype(np.float64), problems)
    same = np.full(4, 3.0)
    _compare("parallel", hvd.allreduce(same, op=hvd.Adasum, name="par"), same, np.dtype(np.float64), problems)
    hvd.shutdown()
    return problems


@pytest.mark.unit
def test_adasum_combines_tiny_gradients_as_horovod():
    from hora.collectives.adasum import combine

    # Horovod's test_stability: parallel vectors near float32's smallest normal number
    # average (their squared norms, ~1e-76 in float64, are far above sqrt(DBL_MIN)).
    a = np.random.default_rng(2).normal(0, np.finfo(np.float32).tiny, 1024)
    for scale_b in (1.0, 3.0):
        a32, b32 = a.astype(np.float32), (a * scale_b).astype(np.float32)  # subnormals: a few bits each
        want = (a32.astype(np.float64) + b32) / 2 if scale_b == 1.0 else 2 * a32.astype(np.float64)
        assert np.allclose(combine(a32, b32), want, rtol=1e-3, atol=0)
    # Orthogonal tiny vectors add; a vector of zeros leaves the other as it is.
    e1, e2 = np.array([1e-30, 0.0]), np.array([0.0, 1e-30])
    assert np.array_equal(combine(e1, e2), e1 + e2)
    assert np.array_equal(combine(np.zeros(2), e1), e1)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.timeout(120)
def test_adasum(size):
    results = run_ranks(size, adasum_job, timeout=100)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:20])


def large_job(staging_mb: int) -> list[str]:
    """Buffers many times the staging area, so the shared-memory path runs many rounds."""
    import hora.numpy as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    count = 3 * (staging_mb << 20) // 4 + 12345  # float32 elements: several rounds, ragged end
    mine = np.arange(count, dtype=np.float32) % 1000 + me
    want = np.arange(count, dtype=np.float32) % 1000 * n + sum(range(n))
    _compare("allreduce", hvd.allreduce(mine, op=hvd.Sum, name="big"), want, np.dtype(np.float32), problems)
    # Over TCP, more than one pipeline chunk (1 MiB) per rank takes the pipelined ring.
    longer = n * (3 << 18) + 11
    mine = np.arange(longer, dtype=np.float32) % 1000 + me
    want = np.arange(longer, dtype=np.float32) % 1000 * n + sum(range(n))
    _compare("pipelined", hvd.allreduce(mine, op=hvd.Sum, name="longer"), want, np.dtype(np.float32), problems)
    rows = count // 7
    block = np.arange(rows * 7, dtype=np.float64).reshape(rows, 7) + me
    q, m = divmod(rows, n)
    start = me * q + min(me, m)
    full = np.arange(rows * 7, dtype=np.float64).reshape(rows, 7) * n + sum(range(n))
    _compare("reducescatter", hvd.reducescatter(block, op=hvd.Sum, name="rs"), full[start : start + q + (me < m)], np.dtype(np.float64), problems)
    pieces = [np.full(((r + 1) * count // n, 1), r, dtype=np.int32) for r in range(n)]
    _compare("allgather", hvd.allgather(pieces[me], name="ag"), np.concatenate(pieces), np.dtype(np.int32), problems)
    root = np.arange(count, dtype=np.int16) if me == n - 1 else np.zeros(count, dtype=np.int16)
    _compare("broadcast", hvd.broadcast(root, root_rank=n - 1, name="bc"), np.arange(count, dtype=np.int16), np.dtype(np.int16), problems)
    send = np.repeat(np.arange(n, dtype=np.float32) + 10 * me, count // n)
    want_a2a = np.repeat(np.full(n, me, dtype=np.float32) + 10 * np.arange(n), count // n)
    _compare("alltoall", hvd.alltoall(send, name="a2a"), want_a2a, np.dtype(np.float32), problems)
    hvd.shutdown()
    return problems


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("size", [2, 3, 4, 8])  # 8: four ranks per core
@pytest.mark.timeout(240)
def test_large_buffers(size, transport):
    """Many staging rounds (shared memory) or many pipeline chunks (TCP), with ragged ends."""
    env = {"HORA_SHM_STAGING_MB": "1", **TRANSPORTS[transport]}
    results = run_ranks(size, large_job, 1, timeout=200, env=env)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems)


def hierarchical_job() -> dict:
    import hora.numpy as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    stats = __import__("hora.core.api", fromlist=["current"]).current().engine.stats()
    kind = stats.algorithm
    paths = [stats.hierarchical_allreduce, stats.hierarchical_allgather]
    problems: list[str] = []
    for count in (1, 7, 1000, 3 * (1 << 20) + 5):  # tiny, uneven, and many pipeline chunks
        mine = np.arange(count, dtype=np.float64) + me
        want = np.arange(count, dtype=np.float64) * n + sum(range(n))
        _compare(f"sum {count}", hvd.allreduce(mine, op=hvd.Sum, name=f"s{count}"), want, np.dtype(np.float64), problems)
        _compare(f"average {count}", hvd.allreduce(mine, name=f"a{count}"), want / n, np.dtype(np.float64), problems)
    x = make(np.dtype(np.float32), me, (33, 5))
    want = np.stack([make(np.dtype(np.float32), r, (33, 5)) for r in range(n)]).astype(np.float64).max(0)
    _compare("max", hvd.allreduce(x, op=hvd.Max, name="max"), want, np.dtype(np.float32), problems)
    gathered = hvd.allgather(np.array([me]), name="who")
    if gathered.tolist() != list(range(n)):
        problems.append(f"allgather {gathered}")
    # Ragged first dimensions (one rank empty), and rows enough for many staging rounds.
    for label, rows in (("ragged", lambda r: (r * 3) % 4), ("large", lambda r: 70_000 + 1_000 * r)):
        mine = make(np.dtype(np.float32), me, (rows(me), 5))
        want = np.concatenate([make(np.dtype(np.float32), r, (rows(r), 5)) for r in range(n)])
        got = hvd.allgather(mine, name=label)
        if got.shape != want.shape or not np.array_equal(got, want):
            problems.append(f"allgather {label}: shape {got.shape}, want {want.shape}")
    hvd.broadcast(np.zeros(3), root_rank=n - 1, name="other")  # other collectives: the flat ring
    for root in (0, n - 1):  # large: the chain along the flat ring, some of its hops within a host
        got = hvd.broadcast(np.arange(300_001, dtype=np.float64) + me, root_rank=root, name=f"chain{root}")
        _compare(f"chain from {root}", got, np.arange(300_001, dtype=np.float64) + root, np.dtype(np.float64), problems)
    hvd.shutdown()
    return {"kind": kind, "paths": paths, "problems": problems}


@pytest.mark.parametrize(
    "hosts, kind",
    [
        (["a", "a", "b", "b"], "HierarchicalCollectives"),
        (["a", "b", "a", "b"], "HierarchicalCollectives"),  # hosts interleaved in rank order
        (["a", "a", "a", "b", "b", "b"], "HierarchicalCollectives"),
        (["a", "a", "b"], "TcpCollectives"),  # uneven hosts: the flat ring
        (["a", "b", "c"], "TcpCollectives"),  # one rank per host: the flat ring
    ],
)
@pytest.mark.timeout(180)
def test_hierarchical_collectives_on_emulated_hosts(hosts, kind):
    # Small staging halves: the shared-memory steps take many rounds.
    results = run_ranks(len(hosts), hierarchical_job, hosts=hosts, timeout=150, env={"HORA_SHM_STAGING_MB": "1"})
    for rank, result in enumerate(results):
        assert result["kind"] == kind
        if kind == "HierarchicalCollectives":
            assert result["paths"] == [True, True]
        assert result["problems"] == [], f"rank {rank}: {result['problems']}"


@pytest.mark.parametrize("allreduce, allgather", [("0", "1"), ("1", "0")])
@pytest.mark.timeout(180)
def test_hierarchical_forced_off_per_collective(allreduce, allgather):
    env = {"HORA_HIERARCHICAL_ALLREDUCE": allreduce, "HORA_HIERARCHICAL_ALLGATHER": allgather}
    results = run_ranks(4, hierarchical_job, hosts=["a", "b", "a", "b"], timeout=150, env=env)
    for rank, result in enumerate(results):
        assert result["paths"] == [allreduce == "1", allgather == "1"]
        assert result["problems"] == [], f"rank {rank}: {result['problems']}"


def socket_buffer_job() -> dict:
    import socket

    import hora.numpy as hvd
    from hora.core.api import current

    hvd.init()
    mesh = current().engine._mesh
    sizes = {
        peer: (link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
               link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
        for peer, link in mesh.data.items()
    }  # fmt: skip
    total = hvd.allreduce(np.arange(1 << 20, dtype=np.float32), op=hvd.Sum, name="buffered")
    return {"sizes": sizes, "right": bool(np.array_equal(total, np.arange(1 << 20, dtype=np.float32) * hvd.size()))}


@pytest.mark.timeout(120)
def test_socket_buffer_bytes_sizes_every_data_link():
    env = {"HORA_SHARED_MEMORY": "0", "HORA_SOCKET_BUFFER_BYTES": str(256 << 10)}
    for rank, result in enumerate(run_ranks(3, socket_buffer_job, env=env, timeout=100)):
        assert result["right"], rank
        # Linux doubles the size it is given (its bookkeeping); autotuning would start elsewhere.
        assert result["sizes"] == {p: (512 << 10, 512 << 10) for p in range(3) if p != rank}, result


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="mounting a small /dev/shm needs root and unshare"
)
@pytest.mark.parametrize("room", ["3m", "1m"])  # room for some ranks' segments; for none
def test_a_dev_shm_too_small_falls_back_to_tcp_on_every_rank(room):
    """A container's /dev/shm is often 64 MB. Segments that do not fit fail at init, as an
    error every rank hears of (they all use TCP), not as a SIGBUS on a later write."""
    script = f"{sys.executable} -m hora.runner -np 2 {sys.executable} tests/scripts/small_dev_shm.py"
    shell = f"mount -t tmpfs -o size={room} tmpfs /dev/shm && {script}; echo left=$(ls /dev/shm | wc -l)"
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1"),
    )  # fmt: skip
    output = result.stdout + result.stderr
    for rank in range(2):  # each segment 2.6 MiB: 3 MiB has room for one
        assert f"rank {rank}: 3.0 3.0 TcpCollectives" in output, output
    assert "/dev/shm has no room for shared segment" in output and "using TCP" in output, output
    assert "SIGBUS" not in output and "left=0" in output, output
