"""The elastic examples, run for real under horarun's elastic driver on this machine.

Three local host names of one slot each (``localhost``, ``127.0.0.1``, ``127.0.0.2``)
come from a discovery script; each example runs once as is and once with the worker of
``127.0.0.2`` killed (SIGKILL) in the middle of training: the job goes on at two ranks,
exits 0 and reaches the accuracy of the run without the failure.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from test_tensorflow_ops import TF_ENV

pytestmark = pytest.mark.framework

ROOT = Path(__file__).resolve().parents[1]
HOSTS = ("localhost", "127.0.0.1", "127.0.0.2")
VICTIM = "127.0.0.2"  # the host whose worker is killed: rank 2 of world 0
MARKER = "ELASTIC_EXAMPLE_TEST_MARKER"
TORCH = "examples/pytorch/elastic_digits.py"
KERAS = "examples/tensorflow/keras_elastic_digits.py"


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    killed: int | None  # the pid killed, if any

    def rank0(self) -> list[str]:
        return [line.split(":", 1)[1] for line in self.stdout.splitlines() if line.startswith("[0]<stdout>:")]

    def final(self) -> tuple[float, int]:
        """(accuracy, ranks) of rank 0's last line."""
        match = re.fullmatch(r"final test accuracy ([0-9.]+) on (\d) ranks", self.rank0()[-1] if self.rank0() else "")
        assert match, self.tail()
        return float(match.group(1)), int(match.group(2))

    def tail(self) -> str:
        return f"exit code {self.returncode}\n--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}"


def _workers(marker: str, host: str) -> list[int]:
    """This machine's processes started with ``MARKER=marker`` and ``HORA_HOSTNAME=host``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:  # gone, or not ours
            continue
        if f"{MARKER}={marker}".encode() in environ and f"HORA_HOSTNAME={host}".encode() in environ:
            found.append(int(entry.name))
    return found


def _collect(stream: IO[str], lines: list[str]) -> None:
    """Appends the stream's lines to ``lines`` as they come (extend adds them one by one)."""
    lines.extend(iter(stream.readline, ""))


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stops horarun if it still runs: SIGTERM (it stops its workers), then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_elastic(tmp_path: Path, example: str, *args: str, kill_at: str | None = None, timeout: float = 270) -> Job:
    """Runs ``example`` under ``horarun -np 3 --min-np 2`` with a discovery script over
    ``HOSTS``; with ``kill_at``, SIGKILLs the worker of ``VICTIM`` once rank 0 printed a
    line that matches it. Never hangs: past ``timeout`` the job is killed and the test fails."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("".join(f"{host}:1\n" for host in HOSTS))
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    marker = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **TF_ENV, **{MARKER: marker})
    command = [sys.executable, "-m", "hora.runner", "-np", "3", "--min-np", "2", "--host-discovery-script", str(script)]
    command += ["--elastic-timeout", "60", sys.executable, example, *args]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    out: list[str] = []
    err: list[str] = []
    streams = ((proc.stdout, out), (proc.stderr, err))
    readers = [threading.Thread(target=_collect, args=pair, daemon=True) for pair in streams]
    for reader in readers:
        reader.start()
    killed = None
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                _stop(proc)
                for reader in readers:
                    reader.join(5)
                output = "".join(out)[-4000:] + "".join(err)[-4000:]
                pytest.fail(f"the elastic job did not end within {timeout} s\n{output}")
            if kill_at is not None and killed is None:
                seen = [line.split(":", 1)[1] for line in list(out) if line.startswith("[0]<stdout>:")]
                if any(re.search(kill_at, line) for line in seen):
                    victims = _workers(marker, VICTIM)
                    assert len(victims) == 1, f"expected one worker on {VICTIM}, found {victims}"
                    os.kill(victims[0], signal.SIGKILL)
                    killed = victims[0]
            time.sleep(0.05)
    finally:
        _stop(proc)
    for reader in readers:
        reader.join(10)
    return Job(proc.returncode, "".join(out), "".join(err), killed)


def _check_failure_run(job: Job) -> float:
    assert job.killed is not None, "the worker was never killed: " + job.tail()
    assert job.returncode == 0, job.tail()
    accuracy, ranks = job.final()
    assert ranks == 2, job.tail()  # finished at the smaller size
    assert re.search(rf"\b{re.escape(VICTIM)}\b.*blacklist|blacklist.*\b{re.escape(VICTIM)}\b", job.stderr), job.tail()
    assert "elastic world 1: 2 ranks" in job.stderr, job.tail()
    return accuracy


# --- PyTorch ----------------------------------------------------------------------------

TORCH_ARGS = ("--epochs", "15", "--batches-per-commit", "3")


@pytest.mark.timeout(300)
def test_torch_elastic_digits_without_failure(tmp_path: Path) -> None:
    job = run_elastic(tmp_path, TORCH, *TORCH_ARGS)
    assert job.returncode == 0, job.tail()
    accuracy, ranks = job.final()
    assert ranks == 3 and accuracy >= 0.95, job.tail()
    assert "elastic world 1" not in job.stderr, job.tail()
    epochs = [int(m.group(1)) for line in job.rank0() if (m := re.match(r"epoch +(\d+) +loss .* \(3 ranks\)$", line))]
    assert epochs == list(range(1, 16)), job.tail()
    assert not any(line.startswith(("[1]<stdout>", "[2]<stdout>")) for line in job.stdout.splitlines())


@pytest.mark.timeout(300)
def test_torch_elastic_digits_survives_a_killed_worker(tmp_path: Path) -> None:
    job = run_elastic(tmp_path, TORCH, *TORCH_ARGS, kill_at=r"^epoch +3 ")
    accuracy = _check_failure_run(job)
    assert accuracy >= 0.95, job.tail()
    epochs = [re.match(r"epoch +(\d+) +loss .* \((\d) ranks\)$", line) for line in job.rank0()]
    numbers = [int(m.group(1)) for m in epochs if m]
    # Every epoch once (one may print twice if the failure hit between its line and its commit).
    assert sorted(set(numbers)) == list(range(1, 16)) and len(numbers) <= 16, job.tail()
    assert [m.group(2) for m in epochs if m][-1] == "2", job.tail()


# --- Keras ------------------------------------------------------------------------------

KERAS_ARGS = ("--epochs", "10", "--batches-per-commit", "3")


@pytest.mark.timeout(300)
def test_keras_elastic_digits_without_failure(tmp_path: Path) -> None:
    job = run_elastic(tmp_path, KERAS, *KERAS_ARGS)
    assert job.returncode == 0, job.tail()
    accuracy, ranks = job.final()
    assert ranks == 3 and accuracy >= 0.95, job.tail()
    assert "elastic world 1" not in job.stderr, job.tail()
    assert job.rank0().count("training from epoch 1 on 3 ranks") == 1, job.tail()
    assert not any(line.startswith(("[1]<stdout>", "[2]<stdout>")) for line in job.stdout.splitlines())


@pytest.mark.timeout(300)
def test_keras_elastic_digits_survives_a_killed_worker(tmp_path: Path) -> None:
    job = run_elastic(tmp_path, KERAS, *KERAS_ARGS, kill_at=r"^Epoch 3/")
    accuracy = _check_failure_run(job)
    assert accuracy >= 0.95, job.tail()
    restarts = [line for line in job.rank0() if line.startswith("training from epoch")]
    assert restarts[0] == "training from epoch 1 on 3 ranks" and len(restarts) == 2, job.tail()
    assert re.fullmatch(r"training from epoch [2-9] on 2 ranks", restarts[1]), job.tail()
