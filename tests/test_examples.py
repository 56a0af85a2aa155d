"""The commands the README and the issue show, run for real through horarun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[1]


def horarun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hora.runner", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
    )


@pytest.mark.timeout(120)
def test_three_ranks_sum_with_horarun():
    code = "import hora.numpy as hvd, numpy as np; hvd.init(); print(hvd.rank(), hvd.allreduce(np.ones(4) * hvd.rank(), op=hvd.Sum))"
    proc = horarun("-np", "3", sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    assert lines == [f"[{r}]<stdout>:{r} [3. 3. 3. 3.]" for r in range(3)]


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.timeout(180)
def test_numpy_digits_example_trains(size):
    proc = horarun("-np", str(size), sys.executable, "examples/numpy/train_digits.py", "--epochs", "15", timeout=170)
    assert proc.returncode == 0, proc.stderr
    final = re.search(r"\[0\]<stdout>:final test accuracy ([0-9.]+) on (\d) ranks", proc.stdout)
    assert final, proc.stdout
    assert float(final.group(1)) >= 0.93 and int(final.group(2)) == size
    assert not any(line.startswith(("[1]<stdout>", "[2]<stdout>")) for line in proc.stdout.splitlines())


@pytest.mark.timeout(60)
def test_missing_ranks_are_named_at_the_rendezvous():
    """Two ranks of a job of three start; the third never does."""
    from harness import rank_env

    from hora.runner.rendezvous import RendezvousServer
    from hora.transport import auth

    secret = auth.new_secret()
    server = RendezvousServer(secret).start()
    code = "import hora.numpy as hvd\ntry:\n    hvd.init()\nexcept Exception as e:\n    print(type(e).__name__, e)"
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=rank_env(rank, 3, server.port, secret, {"HORA_START_TIMEOUT": "2"}),
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]
        outputs = [p.communicate(timeout=40)[0] for p in procs]
    finally:
        server.stop()
    for output in outputs:
        assert "HoraInternalError" in output and "rank(s) 2 of 3 did not reach the rendezvous" in output, output
