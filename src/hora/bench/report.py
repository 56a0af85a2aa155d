"""Turning backends' results into the comparison tables and the JSON document.

Every backend's results (``worker.run``'s report) hold rows keyed by collective and
requested size. With ``--runs R`` each backend ran R times; ``merge_runs`` takes, per
size, the median of the R times (and recomputes the bandwidths from it).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hora.bench.plan import human_bytes
from hora.bench.worker import busbw_factor, format_row, summary_lines

SCHEMA = "hora-bench/1"
METHOD = (
    "each iteration is 'barrier; t0 = perf_counter(); collective; t1'; per iteration the slowest rank's time; "
    "a size's time is the median over iterations (over runs: the median of the runs' medians); "
    "algbw = bytes / time (10^9 B/s); busbw = algbw x nccl-tests' factor (allreduce 2(n-1)/n; allgather, "
    "alltoall, reducescatter (n-1)/n; broadcast 1); bytes: allreduce/broadcast buffer, allgather output, "
    "alltoall/reducescatter input"
)


def human_time(seconds: float) -> str:
    """``1.2 us``, ``371 us``, ``8.9 ms``, ``1.25 s``."""
    if seconds < 1e-5:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1e-2:
        return f"{seconds * 1e3:.2f} ms"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def _median_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def merge_runs(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merges one backend's runs: per size, the median of the runs' times."""
    first = dict(reports[0])
    first["runs"] = len(reports)
    if len(reports) == 1:
        return first
    size = first["world_size"]
    rows = []
    for row in first["results"]:
        key = (row["collective"], row["requested_bytes"])
        same = [r for rep in reports for r in rep["results"] if (r["collective"], r["requested_bytes"]) == key]
        merged = dict(row)
        merged["time_s"] = statistics.median(r["time_s"] for r in same)
        merged["time_runs_s"] = [r["time_s"] for r in same]
        merged["algbw_gbps"] = row["bytes"] / merged["time_s"] / 1e9
        merged["busbw_gbps"] = merged["algbw_gbps"] * busbw_factor(row["collective"], size)
        wrongs = [r["wrong"] for r in same if r["wrong"] is not None]
        merged["wrong"] = max(wrongs) if wrongs else None
        rows.append(merged)
    first["results"] = rows
    for part in ("latency", "wait"):
        runs = [rep[part] for rep in reports if rep.get(part)]
        if runs:
            first[part] = {
                key: runs[0][key] if key in ("bytes", "iters", "sleep_s") else _median_or_none([r[key] for r in runs])
                for key in runs[0]
            }
    return first


def backend_table(report: Mapping[str, Any]) -> list[str]:
    """A backend's own tables (the live format), for merged runs."""
    lines = []
    for collective in dict.fromkeys(r["collective"] for r in report["results"]):
        lines.append(
            f"# {collective} on {report['backend']} ({report['version']}), {report['world_size']} ranks, "
            f"median of {report.get('runs', 1)} runs"
        )
        lines.extend(format_row(r) for r in report["results"] if r["collective"] == collective)
    return lines + summary_lines(report)


def _ratio(mine: float | None, theirs: float | None) -> str:
    """hora's time over the peer's: ``0.40x``, ``12.5x``, ``834x``."""
    if mine is None or theirs is None or theirs <= 0:
        return "-"
    ratio = mine / theirs
    return f"{ratio:.0f}x" if ratio >= 100 else f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.2f}x"


def comparison(collective: str, reports: Mapping[str, Mapping[str, Any]], plan: Mapping[str, Any]) -> list[str]:
    """One collective's table: hora's time and busbw, then each peer's time and hora's ratio to it.

    The ratio is hora's time divided by the peer's: below 1.00x hora is faster.
    """
    peers = [name for name in reports if name != "hora"]
    rows: dict[str, dict[int, dict[str, Any]]] = {
        name: {r["requested_bytes"]: r for r in rep["results"] if r["collective"] == collective}
        for name, rep in reports.items()
    }
    hora = rows.get("hora", {})
    op = f", {plan['op']}" if collective in ("allreduce", "reducescatter") else ""
    size = next(iter(reports.values()))["world_size"]
    widths = [max(12, len(n) + 1) for n in peers]
    head = f"{'size':>9} | {'hora':>9} {'busbw':>6} |" + "".join(f" {n:>{w}} {'ratio':>7} |" for n, w in zip(peers, widths))
    lines = [
        f"# {collective}, {plan['dtype']}{op}, {size} ranks: time per op; busbw in GB/s; "
        "ratio = hora's time / that peer's (< 1: hora is faster)",
        head,
    ]
    for nbytes in plan["sizes"]:
        mine = hora.get(nbytes)
        mine_time: float | None = None
        cells = f"{human_bytes(nbytes):>9} | "
        if mine is None:
            cells += f"{'-':>9} {'-':>6} |"
        else:
            mine_time = mine["time_s"]
            cells += f"{human_time(mine['time_s']):>9} {mine['busbw_gbps']:>6.2f} |"
        for name, width in zip(peers, widths):
            theirs = rows[name].get(nbytes)
            if theirs is None:
                cells += f" {'n/a':>{width}} {'-':>7} |"
            else:
                cells += f" {human_time(theirs['time_s']):>{width}} {_ratio(mine_time, theirs['time_s']):>7} |"
        lines.append(cells)
    for name, rep in reports.items():
        if collective in rep.get("unsupported", {}):
            lines.append(f"# {name}: {rep['unsupported'][collective]}")
    return lines


def latency_table(reports: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The back-to-back latency and CPU-while-waiting of every backend, with hora's ratio."""
    hora_latency = (reports.get("hora") or {}).get("latency") or {}
    waits = [rep["wait"] for rep in reports.values() if rep.get("wait")]
    if not waits and not any(rep.get("latency") for rep in reports.values()):
        return []
    lines = [
        "# 4-byte float32 sum-allreduce, back to back (no barrier): median and mean time per op, process CPU "
        "time per op (all threads); ratio = hora's median / that backend's",
    ]
    if waits:
        lines.append(
            "# CPU while waiting: process CPU time (all threads) of a rank blocked in an allreduce while the last "
            f"rank sleeps {waits[0]['sleep_s']:g} s"
        )
    lines.append(
        f"{'backend':<14} {'median':>9} {'mean':>9} {'CPU/op':>9} {'ratio':>7}" + (" | CPU while waiting" if waits else "")
    )
    for name, rep in reports.items():
        lat, wait = rep.get("latency"), rep.get("wait")
        row = f"{name:<14} "
        if lat:
            row += f"{human_time(lat['median_s']):>9} {human_time(lat['mean_s']):>9} {human_time(lat['cpu_per_op_s']):>9} "
            row += f"{_ratio(hora_latency.get('median_s'), lat['median_s']):>7}"
        else:
            row += f"{'-':>9} {'-':>9} {'-':>9} {'-':>7}"
        if wait:
            share = 100 * wait["cpu_s"] / max(wait["wall_s"], 1e-9)
            row += f" | {wait['cpu_s'] * 1e3:.1f} ms in {wait['wall_s']:.2f} s ({share:.1f}% of a core)"
        elif waits:
            row += " | -"
        lines.append(row)
    return lines


def noise_lines(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """Per backend and run, the share of the CPUs other programs used just before and during it."""

    def share(value: float | None) -> str:
        return "?" if value is None else f"{100 * value:.0f}%"

    cells = [
        f"{name} " + ", ".join(f"{share(r.get('background_cpu_share'))}/{share(r.get('foreign_cpu_share'))}" for r in reps)
        for name, reps in runs.items()
        if reps
    ]
    if not any("background_cpu_share" in r for reps in runs.values() for r in reps):
        return []
    return ["# other programs' share of the CPUs just before / during each run: " + "; ".join(cells)]


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), None)
        info["cpu_model"] = model
        with open("/proc/meminfo", encoding="utf-8") as handle:
            total = next((line.split()[1] for line in handle if line.startswith("MemTotal")), None)
        info["memory_gib"] = None if total is None else round(int(total) / (1 << 20), 1)
    except OSError:
        pass
    return info


def document(
    argv: Sequence[str],
    plan: Mapping[str, Any],
    world_size: int,
    merged: Mapping[str, Mapping[str, Any]],
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    skipped: Mapping[str, str],
) -> dict[str, Any]:
    """The ``--json`` document (``schema`` ``hora-bench/1``)."""
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["hora-bench", *argv],
        "machine": machine(),
        "world_size": world_size,
        "method": METHOD,
        "plan": dict(plan),
        "backends": {
            name: {**rep, **({"all_runs": list(runs[name])} if len(runs.get(name, ())) > 1 else {})}
            for name, rep in merged.items()
        },
        "skipped": dict(skipped),
    }
