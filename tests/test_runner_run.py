"""hora.run: a Python function on N ranks, results by rank, remote tracebacks, timeouts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from test_runner import wait_gone

import hora


def rank_and_product(x: int, scale: int = 1) -> tuple[int, int, int]:
    rank = int(os.environ["HORA_RANK"])
    return rank, int(os.environ["HORA_SIZE"]), x * rank * scale


def fails_on_rank_one(message: str) -> int:
    if os.environ["HORA_RANK"] == "1":
        raise ValueError(message)
    time.sleep(30)
    return 0


def sleeps_on_rank_one() -> str:
    if os.environ["HORA_RANK"] == "1":
        time.sleep(30)
    return "done"


@pytest.mark.ranks
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_results_by_rank(size: int) -> None:
    results = hora.run(rank_and_product, args=(5,), kwargs={"scale": 2}, np=size)
    assert results == [(rank, size, 10 * rank) for rank in range(size)]


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_lambda_num_proc_and_env() -> None:
    results = hora.run(lambda: (os.environ["HORA_RANK"], os.environ["EXTRA"]), num_proc=2, env={"EXTRA": "x"})
    assert results == [("0", "x"), ("1", "x")]


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_failure_raises_with_the_remote_traceback() -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        hora.run(fails_on_rank_one, args=("boom from rank one",), np=3)
    assert time.monotonic() - started < 20
    message = str(info.value)
    lines = message.splitlines()
    assert lines[0] == "hora.run: fails_on_rank_one failed on 3 ranks:"
    assert lines[1].startswith("rank 1 failed first: exit code 1 (host localhost")
    assert lines[2] == "traceback of rank 1:"
    assert "Traceback (most recent call last):" in message
    assert "in fails_on_rank_one" in message
    assert "ValueError: boom from rank one" in message
    assert "rank 0 (host localhost" in message and "stopped by SIGTERM" in message


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_timeout_names_the_ranks_still_running() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        hora.run(sleeps_on_rank_one, np=3, timeout=2)
    assert time.monotonic() - started < 15
    assert "ranks still running: 1 " in str(info.value)
    assert "within 2 s" in str(info.value)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"num_proc": 2, "np": 2}, {"np": 0}, {"np": "2"}, {"np": 1, "timeout": 0}, {"np": 2, "hosts": "localhost:1"}],
)
def test_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        hora.run(rank_and_product, args=(1,), **kwargs)  # type: ignore[arg-type]


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_keyboard_interrupt_stops_the_ranks(tmp_path: Path) -> None:
    program = tmp_path / "interrupted.py"
    program.write_text(
        textwrap.dedent(
            """
            import os, sys, time
            import hora

            def wait():
                print("pid", os.getpid(), flush=True)
                time.sleep(60)

            try:
                hora.run(wait, np=2)
            except KeyboardInterrupt:
                print("interrupted", file=sys.stderr)
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(program)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not ignored, even from a background shell
    )
    assert proc.stdout is not None and proc.stderr is not None
    pids = [int(proc.stdout.readline().split()[1]) for _ in range(2)]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=15) == 0
    assert "interrupted" in proc.stderr.read()
    # Dead, or a zombie its new parent has not reaped yet: either way nothing runs.
    assert wait_gone(pids) == []
