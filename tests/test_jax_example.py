"""The JAX example, run for real through horarun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_flax_digits_example_reaches_95_percent_on_two_ranks() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hora.runner", "-np", "2", sys.executable, "examples/jax/flax_digits.py"],
        capture_output=True,
        text=True,
        timeout=230,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    final = re.search(r"\[0\]<stdout>:final test accuracy ([0-9.]+) on (\d) ranks", proc.stdout)
    assert final, proc.stdout
    assert float(final.group(1)) >= 0.95 and int(final.group(2)) == 2
    epochs = re.findall(r"\[0\]<stdout>:epoch +(\d+) +loss", proc.stdout)
    assert epochs == [str(e) for e in range(1, 21)]  # progress every epoch, from rank 0 only
    assert not any(line.startswith("[1]<stdout>") for line in proc.stdout.splitlines())
