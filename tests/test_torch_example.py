"""The PyTorch examples, run for real through horarun."""

from __future__ import annotations

import re
import sys

import pytest

from harness import check_digits_example, horarun

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(240)
def test_torch_digits_example_reaches_95_percent_on_two_ranks():
    check_digits_example("examples/pytorch/train_digits.py")


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
