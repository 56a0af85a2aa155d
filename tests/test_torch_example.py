"""The PyTorch examples, run for real through horarun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[1]


def horarun(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hora.runner", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1"),
    )


@pytest.mark.timeout(240)
def test_torch_digits_example_reaches_95_percent_on_two_ranks():
    proc = horarun("-np", "2", sys.executable, "examples/pytorch/train_digits.py", timeout=230)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    final = re.search(r"\[0\]<stdout>:final test accuracy ([0-9.]+) on (\d) ranks", proc.stdout)
    assert final, proc.stdout
    assert float(final.group(1)) >= 0.95 and int(final.group(2)) == 2
    epochs = re.findall(r"\[0\]<stdout>:epoch +(\d+) +loss", proc.stdout)
    assert epochs == [str(e) for e in range(1, 21)]  # progress every epoch, from rank 0 only
    assert not any(line.startswith("[1]<stdout>") for line in proc.stdout.splitlines())


@pytest.mark.timeout(120)
def test_torch_synthetic_benchmark_prints_horovods_lines():
    proc = horarun(
        "-np", "2", sys.executable, "examples/pytorch/synthetic_benchmark.py", "--model", "cnn", "--batch-size", "8",
        "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2", timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.split(":", 1)[1] for line in proc.stdout.splitlines() if line.startswith("[0]<stdout>:")]
    assert any(line.startswith("Model: cnn") for line in lines), lines
    assert any(line.startswith("Batch size: 8") for line in lines)
    assert any(line.startswith("Number of CPUs: 2") for line in lines)
    assert sum(bool(re.match(r"Iter #\d+: [0-9.]+ img/sec per CPU", line)) for line in lines) == 2
    assert any(re.match(r"Img/sec per CPU: [0-9.]+ \+-[0-9.]+", line) for line in lines)
    assert any(re.match(r"Total img/sec on 2 CPU\(s\): [0-9.]+ \+-[0-9.]+", line) for line in lines)
