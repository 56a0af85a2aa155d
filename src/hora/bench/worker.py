"""One rank of a ``hora-bench`` run: the measuring loop, the same for hora and every peer.

This file is also run as a script by path (``python .../worker.py --backend torch ...``)
in peers' processes, whose interpreter may not have hora installed (Horovod lives in its
own virtualenv): at module level it imports only the standard library, NumPy and
``backends.py`` (from the package, or else from the directory it lies in), and each
backend imports its framework when it is built.

Method, for every backend alike: for each collective and size, ``--check`` runs once with
rank-dependent input and compares the output with the known answer; then ``warmup``
untimed runs; then ``iters`` times ``barrier; t0 = perf_counter(); op; t1`` (fewer when
``max_time`` seconds have passed: a pathologically slow library still finishes). The per
iteration times are max-reduced over ranks (the slowest rank), and a size's time is the
median over iterations. The buffers are allocated once per size; allreduce and broadcast
run in place; allgather, alltoall and reducescatter return a new array in hora and
Horovod (their API) and write into a preallocated one in torch and MPI.

After the table: ``latency`` back-to-back allreduces of 4 bytes with no barrier between
them (median of the slowest rank, and the process CPU time per op); and a wait test, in
which the last rank sleeps ``wait`` seconds before joining one 4-byte allreduce while the
others block in it, measuring the CPU time each waiting rank's process burns (all its
threads) while it waits; the most of any waiting rank is reported.

Rank 0 writes the results as JSON to ``--out``; with ``--live`` it also prints each row
as it is measured.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

try:
    from hora.bench.backends import Backend, Case, Unsupported, make_backend
except ImportError:  # run by path by an interpreter without hora: backends.py lies next to this file
    from backends import Backend, Case, Unsupported, make_backend  # type: ignore[import-not-found,no-redef]

COLLECTIVES = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
OPS = ("sum", "avg", "min", "max", "prod")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8")
BACKENDS = ("hora", "torch", "mpi", "horovod")
LATENCY_BYTES = 4


def busbw_factor(collective: str, size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw x factor, comparable across world sizes."""
    if collective == "allreduce":
        return 2.0 * (size - 1) / size
    if collective == "broadcast":
        return 1.0
    return (size - 1) / size  # allgather, alltoall, reducescatter


def counts(collective: str, nbytes: int, itemsize: int, size: int) -> tuple[int, int]:
    """Returns (elements per rank in the input, elements in the reported buffer) for ``nbytes``.

    The reported buffer is the larger one, as in nccl-tests: allgather's output, and the
    input of alltoall and reducescatter; these are rounded down to a multiple of ``size``
    elements (at least one element per rank).
    """
    if collective in ("allreduce", "broadcast"):
        count = max(1, nbytes // itemsize)
        return count, count
    per_rank = max(1, nbytes // (itemsize * size))
    if collective == "allgather":
        return per_rank, per_rank * size
    return per_rank * size, per_rank * size  # alltoall, reducescatter: input holds one slice per rank


def auto_iters(nbytes: int) -> int:
    """Iterations for a size when none were given: 1000 for small messages, down to 5."""
    return max(5, min(1000, (64 << 20) // max(nbytes, 1)))


def expected(collective: str, op: str, size: int, root: int, count: int, per_rank: int) -> np.ndarray:
    """Every rank's output when rank r's input is filled with r + 1 (float64, for comparison).

    Args:
        collective: one of ``COLLECTIVES``.
        op: the reduction, one of ``OPS``.
        size: the number of ranks.
        root: broadcast's root.
        count, per_rank: as ``counts`` returns them.
    """
    values = np.arange(1, size + 1, dtype=np.float64)
    reduced = {"sum": values.sum(), "avg": values.mean(), "min": 1.0, "max": float(size), "prod": values.prod()}[op]
    if collective == "allreduce":
        return np.full(count, reduced)
    if collective == "reducescatter":
        return np.full(per_rank // size, reduced)
    if collective == "broadcast":
        return np.full(count, root + 1.0)
    chunk = per_rank if collective == "allgather" else per_rank // size
    return np.repeat(values, chunk)


# ----- the loop -----


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (one of ``DTYPES``)."""
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def _check(backend: Backend, case: Case, collective: str, plan: dict[str, Any], count: int, per_rank: int) -> int:
    """Runs ``case`` once on rank-dependent input; returns the most wrong elements on any rank."""
    case.fill(backend.rank + 1.0)
    case.run()
    want = expected(collective, plan["op"], backend.size, plan["root"], count, per_rank)
    got = case.output()
    if got.shape != want.shape:
        wrong = want.size
    else:
        atol = 0.5 if plan["op"] == "avg" and plan["dtype"].startswith(("int", "uint")) else 0.0
        wrong = int(np.count_nonzero(~np.isclose(got, want, rtol=1e-2, atol=atol)))
    case.fill(0.0)  # zeros: repeated in-place sums and products stay finite
    return int(backend.max_over_ranks(np.array([float(wrong)]))[0])


_BUDGET_EVERY = 10  # iterations between the ranks' joint look at the time budget


def _time(backend: Backend, case: Case, iters: int, budget: float) -> np.ndarray:
    """Up to ``iters`` times ``barrier; t0; op; t1``; returns the slowest rank's time per iteration.

    When ``budget`` > 0 seconds have passed, the loop ends early (after at least
    ``_BUDGET_EVERY`` iterations): every ``_BUDGET_EVERY`` iterations the ranks take the
    max of their elapsed times, outside the timed window, so they all stop together.
    """
    times = np.empty(iters)
    began = time.perf_counter()
    done = iters
    for i in range(iters):
        backend.barrier()
        start = time.perf_counter()
        case.run()
        times[i] = time.perf_counter() - start
        if budget > 0 and (i + 1) % _BUDGET_EVERY == 0 and i + 1 < iters:
            if backend.max_over_ranks(np.array([time.perf_counter() - began]))[0] > budget:
                done = i + 1
                break
    return backend.max_over_ranks(times[:done])


def measure_size(backend: Backend, collective: str, nbytes: int, plan: dict[str, Any]) -> dict[str, Any]:
    """Measures one collective at one size; returns its row (see the module docstring).

    Raises:
        Unsupported: the backend cannot run it (the same on every rank), known ahead or
            because its first call raised (a library's own check of a type or op, which
            every rank makes alike; an error on one rank only would leave the others
            waiting until ``--timeout``).
    """
    dtype, n = plan["dtype"], backend.size
    per_rank, count = counts(collective, nbytes, itemsize(dtype), n)
    case = backend.case(collective, per_rank, dtype, plan["op"], plan["root"])
    try:  # the first call: a library that rejects this type or op does so here, on every rank
        wrong = _check(backend, case, collective, plan, count, per_rank) if plan["check"] else None
        if not plan["check"]:
            case.run()
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        raise Unsupported(f"{backend.name} rejected it: {type(exc).__name__}: {message}") from exc
    for _ in range(plan["warmup"]):
        case.run()
    iters = plan["iters"] or auto_iters(nbytes)
    slowest = _time(backend, case, iters, plan.get("max_time", 0.0))
    iters = len(slowest)
    median = float(np.median(slowest))
    size_bytes = count * itemsize(dtype)
    algbw = size_bytes / median / 1e9 if median > 0 else math.inf
    return {
        "collective": collective,
        "requested_bytes": nbytes,
        "bytes": size_bytes,
        "count": count,
        "dtype": dtype,
        "op": plan["op"] if collective in ("allreduce", "reducescatter") else None,
        "root": plan["root"] if collective == "broadcast" else None,
        "iters": iters,
        "time_s": median,
        "time_min_s": float(slowest.min()),
        "time_mean_s": float(slowest.mean()),
        "time_p90_s": float(np.percentile(slowest, 90)),
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * busbw_factor(collective, n),
        "wrong": wrong,
    }


def measure_latency(backend: Backend, iters: int, warmup: int) -> dict[str, Any]:
    """``iters`` back-to-back 4-byte float32 sum-allreduces, no barrier between them."""
    case = backend.case("allreduce", LATENCY_BYTES // 4, "float32", "sum", 0)
    for _ in range(warmup):
        case.run()
    times = np.empty(iters)
    backend.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(iters):
        start = time.perf_counter()
        case.run()
        times[i] = time.perf_counter() - start
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    slowest = backend.max_over_ranks(times)
    worst = backend.max_over_ranks(np.array([wall / iters, cpu / iters]))
    return {
        "bytes": LATENCY_BYTES,
        "iters": iters,
        "median_s": float(np.median(slowest)),
        "mean_s": float(worst[0]),
        "cpu_per_op_s": float(worst[1]),
    }


def measure_wait(backend: Backend, seconds: float) -> dict[str, Any]:
    """The CPU time the waiting ranks burn while the last rank sleeps ``seconds`` before joining."""
    case = backend.case("allreduce", LATENCY_BYTES // 4, "float32", "sum", 0)
    case.run()
    backend.barrier()
    late = backend.rank == backend.size - 1
    if late:
        time.sleep(seconds)
    cpu, wall = time.process_time(), time.perf_counter()
    case.run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    worst = backend.max_over_ranks(np.array([0.0, 0.0]) if late else np.array([cpu, wall]))
    return {"sleep_s": seconds, "cpu_s": float(worst[0]), "wall_s": float(worst[1])}


def run(kind: str, plan: dict[str, Any], live: bool = False) -> tuple[int, dict[str, Any]]:
    """Runs the whole plan on backend ``kind``; returns this rank and the results (the same on every rank).

    Args:
        kind: one of ``BACKENDS``.
        plan: ``collectives``, ``sizes`` (requested bytes), ``dtype``, ``op``, ``root``,
            ``iters`` (0: automatic), ``warmup``, ``check``, ``latency`` (0: skip), ``wait``
            (seconds; 0: skip).
        live: rank 0 prints each row as it is measured.
    """
    backend = make_backend(kind)
    try:
        show = live and backend.rank == 0

        def say(text: str) -> None:  # one write per line: mpirun's --tag-output tags each write
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

        results: list[dict[str, Any]] = []
        unsupported: dict[str, str] = {}
        for collective in plan["collectives"]:
            if show:
                say(header(collective, backend.name, backend.version, backend.size, plan))
            for nbytes in plan["sizes"]:
                try:
                    row = measure_size(backend, collective, nbytes, plan)
                except Unsupported as exc:
                    unsupported[collective] = str(exc)
                    if show:
                        say(f"# {collective} skipped: {exc}")
                    break
                results.append(row)
                if show:
                    say(format_row(row))
        report: dict[str, Any] = {
            "backend": backend.name,
            "version": backend.version,
            "world_size": backend.size,
            "results": results,
            "unsupported": unsupported,
            "latency": None,
            "wait": None,
        }
        if plan["latency"]:
            report["latency"] = measure_latency(backend, plan["latency"], max(plan["warmup"], 10))
        if plan["wait"] and backend.size > 1:
            report["wait"] = measure_wait(backend, plan["wait"])
        if show:
            for line in summary_lines(report):
                say(line)
        backend.barrier()
        return backend.rank, report
    finally:
        backend.shutdown()


# ----- rows as text -----

COLUMNS = (
    f"#{'size(B)':>12} {'count':>11} {'type':>9} {'redop':>6} {'root':>5} {'iters':>6} "
    f"{'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}"
)


def header(collective: str, name: str, version: str, size: int, plan: dict[str, Any]) -> str:
    """The lines above a backend's table for one collective."""
    return (
        f"# {collective} on {name} ({version}), {size} ranks; time: median over iterations of the slowest rank, "
        f"each 'barrier; t0; {collective}; t1'\n{COLUMNS}"
    )


def format_row(row: dict[str, Any]) -> str:
    """One row, in nccl-tests' units: time in microseconds, bandwidths in GB/s (10^9 bytes)."""
    wrong = "-" if row["wrong"] is None else str(row["wrong"])
    root = "-" if row["root"] is None else str(row["root"])
    return (
        f" {row['bytes']:>12} {row['count']:>11} {row['dtype']:>9} {row['op'] or '-':>6} {root:>5} {row['iters']:>6} "
        f"{row['time_s'] * 1e6:>12.1f} {row['algbw_gbps']:>12.3f} {row['busbw_gbps']:>12.3f} {wrong:>7}"
    )


def summary_lines(report: Mapping[str, Any]) -> list[str]:
    """The latency and wait lines under a backend's tables."""
    lines = []
    latency, wait = report.get("latency"), report.get("wait")
    if latency:
        lines.append(
            f"# latency, {latency['iters']} back-to-back 4-byte allreduces: median {latency['median_s'] * 1e6:.1f} us, "
            f"mean {latency['mean_s'] * 1e6:.1f} us, CPU {latency['cpu_per_op_s'] * 1e6:.1f} us per op"
        )
    if wait:
        lines.append(
            f"# CPU burned while blocked {wait['wall_s']:.2f} s waiting for a late rank: "
            f"{wait['cpu_s'] * 1e3:.1f} ms ({100 * wait['cpu_s'] / max(wait['wall_s'], 1e-9):.2f}% of a core)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python worker.py --backend KIND --plan PLAN.json --out RESULT.json [--live]``."""
    parser = argparse.ArgumentParser(prog="hora-bench worker", description="One rank of a hora-bench run.")
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--plan", required=True, help="the plan, as a JSON file")
    parser.add_argument("--out", help="rank 0 writes the results here (JSON)")
    parser.add_argument("--live", action="store_true", help="rank 0 prints each row as it is measured")
    args = parser.parse_args(argv)
    with open(args.plan, encoding="utf-8") as handle:
        plan = json.load(handle)
    rank, report = run(args.backend, plan, live=args.live)
    if args.out and rank == 0:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(report, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
