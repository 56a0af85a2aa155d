"""The TensorFlow examples, run for real through horarun at 2 ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_tensorflow_ops import TF_ENV

pytestmark = pytest.mark.framework

ROOT = Path(__file__).resolve().parents[1]


def horarun(*args: str, timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hora.runner", "-np", "2", sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src"), **TF_ENV, **(env or {})),
    )


def _final_accuracy(proc: subprocess.CompletedProcess[str]) -> float:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    final = re.search(r"\[0\]<stdout>:final test accuracy ([0-9.]+) on 2 ranks", proc.stdout)
    assert final, proc.stdout[-3000:]
    assert not any(line.startswith("[1]<stdout>") for line in proc.stdout.splitlines()), "rank 1 printed"
    return float(final.group(1))


@pytest.mark.timeout(300)
def test_keras_digits_reaches_95_percent() -> None:
    assert _final_accuracy(horarun("examples/tensorflow/keras_digits.py")) >= 0.95


@pytest.mark.timeout(300)
def test_gradient_tape_digits_trains() -> None:
    assert _final_accuracy(horarun("examples/tensorflow/gradient_tape_digits.py", "--epochs", "10")) >= 0.93


@pytest.mark.timeout(300)
def test_synthetic_benchmark_reports_throughput() -> None:
    proc = horarun(
        "examples/tensorflow/tensorflow2_synthetic_benchmark.py", "--model", "cnn", "--fp16-allreduce",
        "--batch-size", "8", "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"\[0\]<stdout>:Total img/sec on 2 CPU\(s\): [0-9.]+ \+-[0-9.]+", proc.stdout), proc.stdout
