"""hora-bench: its plan arithmetic in-process, and smoke runs through the real launcher.

The smoke runs use tiny sizes and a few iterations; they check the shape of the output
and that every result verified, never a timing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hora.bench import plot, report
from hora.bench.load import ForeignLoad, busy_share
from hora.bench.peers import parse_peers
from hora.bench.plan import Plan, parse_collectives, parse_size, parse_sizes, size_range
from hora.bench.worker import COLLECTIVES, busbw_factor, counts, expected

QUICK = ["-n", "3", "-w", "1", "--latency", "5", "--wait-test", "0"]


def bench(*args: str, cwd: Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "hora.bench", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


# ----- in-process -----


def test_sizes_follow_nccl_tests_flags() -> None:
    assert parse_size("4") == 4
    assert parse_size("64K") == 64 << 10
    assert parse_size("256M") == parse_size("256MiB") == 256 << 20
    assert size_range(4, 256 << 20, 4)[:3] == [4, 16, 64]
    assert size_range(4, 256 << 20, 4)[-1] == 256 << 20
    assert len(size_range(4, 256 << 20, 2)) == 27
    assert size_range(8, 8, 2) == [8]
    assert parse_sizes("4,4K, 1M") == [4, 4096, 1 << 20]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: parse_size("4X"), "invalid size '4X'"),
        (lambda: size_range(8, 4, 2), "below -b"),
        (lambda: size_range(4, 8, 1), "-f/--stepfactor"),
        (lambda: parse_collectives("allreduce,gather"), "unknown collective 'gather'"),
        (lambda: parse_peers("nccl"), "unknown peer 'nccl'"),
        (lambda: Plan(root=2).validate(2), "-r/--root 2"),
        (lambda: Plan(dtype="complex64").validate(2), "-d/--dtype"),
    ],
)
def test_bad_settings_name_the_flag(call: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_plot_without_matplotlib_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(plot.PlotUnavailable, match=re.escape("pip install 'hora[plot]'")):
        plot.require()


def test_counts_and_bus_factors_match_nccl_tests() -> None:
    assert counts("allreduce", 1024, 4, 4) == (256, 256)
    assert counts("allgather", 1024, 4, 4) == (64, 256)  # per-rank input, whole output
    assert counts("reducescatter", 1024, 4, 4) == (256, 256)
    assert counts("alltoall", 4, 4, 2) == (2, 2)  # at least one element per rank
    assert busbw_factor("allreduce", 4) == 1.5
    assert busbw_factor("allgather", 4) == busbw_factor("reducescatter", 4) == 0.75
    assert busbw_factor("broadcast", 4) == 1.0
    assert list(expected("allgather", "sum", 3, 0, 6, 2)) == [1, 1, 2, 2, 3, 3]
    assert list(expected("reducescatter", "max", 2, 0, 4, 4)) == [2, 2]


def test_ratio_and_time_formatting() -> None:
    assert report.human_time(1.2e-6) == "1.2 us"
    assert report.human_time(0.0089) == "8.90 ms"
    assert report._ratio(0.4, 1.0) == "0.40x"
    assert report._ratio(834.0, 1.0) == "834x"


def test_load_shares_are_fractions() -> None:
    foreign = ForeignLoad()
    foreign.start()
    share = busy_share(0.05)
    during = foreign.stop()
    for value in (share, during):
        assert value is None or 0.0 <= value <= 1.0


def test_peers_list() -> None:
    assert parse_peers("all") == ["torch-gloo", "mpi4py", "horovod-gloo", "horovod-mpi"]
    assert parse_peers("horovod,torch-gloo") == ["horovod-gloo", "horovod-mpi", "torch-gloo"]


# ----- through the launcher -----


@pytest.mark.ranks
def test_two_ranks_every_collective_json(tmp_path: Path) -> None:
    out, image = tmp_path / "bench.json", tmp_path / "bench.png"
    drawing = ["--plot", str(image)]  # matplotlib is a test dependency
    done = bench("-np", "2", "--collective", "all", "--sizes", "4,4K", *QUICK, "--json", str(out), *drawing, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert image.stat().st_size > 0
    assert "[0]<stdout>:" not in done.stdout  # rank 0's table is shown without horarun's prefix
    assert "busbw(GB/s)" in done.stdout
    data = json.loads(out.read_text())
    assert data["schema"] == "hora-bench/1" and data["world_size"] == 2
    rows = data["backends"]["hora"]["results"]
    assert [(r["collective"], r["requested_bytes"]) for r in rows] == [(c, s) for c in COLLECTIVES for s in (4, 4096)]
    for row in rows:
        assert row["wrong"] == 0, row
        assert row["time_s"] > 0 and row["iters"] == 3
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * busbw_factor(row["collective"], 2))
    assert data["backends"]["hora"]["latency"]["iters"] == 5


@pytest.mark.ranks
def test_peers_torch_gloo_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = bench("-np", "2", "--sizes", "4K", *QUICK, "--peers", "torch-gloo", "--json", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "## torch-gloo, 2 ranks" in done.stdout
    assert "ratio" in done.stdout and "torch-gloo" in done.stdout.split("# allreduce, float32, sum")[-1]
    data = json.loads(out.read_text())
    assert set(data["backends"]) == {"hora", "torch-gloo"}
    assert data["backends"]["torch-gloo"]["results"][0]["wrong"] == 0


@pytest.mark.ranks
def test_under_horarun_rank0_reports(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "hora.runner", "-np", "2", sys.executable, "-m", "hora.bench", "--sizes", "4", *QUICK,
         "--json", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(out.read_text())["backends"]["hora"]["results"][0]["wrong"] == 0


@pytest.mark.ranks
def test_usage_errors_exit_2(tmp_path: Path) -> None:
    done = bench("-np", "2", "--sizes", "4Q", cwd=tmp_path)
    assert done.returncode == 2 and "invalid size '4Q'" in done.stderr
