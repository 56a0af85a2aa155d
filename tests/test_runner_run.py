"""hora.run: a Python function on N ranks, results by rank, remote tracebacks, timeouts.

Also Horovod's ``horovod.run`` signature: its defaults and deprecated names, ``use_mpi``
(ranks under mpirun) and an elastic job (``min_num_proc``), whose results are those of
the last world's ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
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
    results = hora.run(rank_and_product, args=(5,), kwargs={"scale": 2}, num_proc=size)
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
        hora.run(fails_on_rank_one, args=("boom from rank one",), num_proc=3)
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
        hora.run(sleeps_on_rank_one, num_proc=3, timeout=2)
    assert time.monotonic() - started < 15
    assert "ranks still running: 1 " in str(info.value)
    assert "within 2 s" in str(info.value)


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_horovods_defaults_and_deprecated_names() -> None:
    assert hora.run(rank_and_product, args=(3,)) == [(0, 1, 0)]  # num_proc defaults to 1
    with pytest.warns(DeprecationWarning, match="np is deprecated, use num_proc instead"):
        assert hora.run(rank_and_product, args=(3,), num_proc=5, np=2) == [(0, 2, 0), (1, 2, 3)]  # np wins
    with pytest.warns(DeprecationWarning, match="network_interface is deprecated"):
        results = hora.run(lambda: os.environ["HORA_IFACE"], network_interface="lo", use_gloo=True, disable_cache=True)
    assert results == ["lo"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hora.run(lambda: os.environ["HORA_IFACE"], num_proc=1, network_interfaces=["lo"]) == ["lo"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_proc": None},
        {"num_proc": 0},
        {"num_proc": "2"},
        {"num_proc": 1, "timeout": 0},
        {"num_proc": 2, "hosts": "localhost:1"},
        {"hosts": "localhost:1", "hostfile": "hosts.txt"},
        {"use_gloo": True, "use_mpi": True},
        {"mpi_args": "--bind-to none"},
        {"num_proc": 2, "min_num_proc": 1, "hosts": "localhost:1,127.0.0.1:1", "timeout": 10},
        {"num_proc": 2, "min_num_proc": 1, "hosts": "localhost:1,127.0.0.1:1", "use_mpi": True},
        {"num_proc": 2, "min_num_proc": 1},  # elastic on one host: Horovod refuses it too
        {"slots": 2},  # elastic only
    ],
)
def test_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        hora.run(rank_and_product, args=(1,), **kwargs)  # type: ignore[arg-type]


def mpi_rank_and_sum() -> tuple[int, float]:
    import numpy as np

    import hora.numpy as hvd

    hvd.init()
    total = float(hvd.allreduce(np.ones(2) * (hvd.rank() + 1), op=hvd.Sum)[0])
    return hvd.rank(), total


@pytest.mark.ranks
@pytest.mark.timeout(90)
def test_use_mpi_runs_the_ranks_under_mpirun() -> None:
    assert hora.run(mpi_rank_and_sum, num_proc=3, use_mpi=True) == [(0, 6.0), (1, 6.0), (2, 6.0)]
    assert "OMPI_COMM_WORLD_RANK" in hora.run(lambda: sorted(os.environ), num_proc=1, use_mpi=True)[0]


def fails_on_mpi_rank_one(message: str) -> int:
    if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
        raise ValueError(message)
    return 0


@pytest.mark.ranks
@pytest.mark.timeout(90)
def test_use_mpi_failure_shows_the_traceback() -> None:
    with pytest.raises(RuntimeError) as info:
        hora.run(fails_on_mpi_rank_one, args=("boom under mpirun",), num_proc=2, use_mpi=True)
    message = str(info.value)
    assert message.startswith("hora.run: fails_on_mpi_rank_one failed: mpirun failed with exit code ")
    assert "traceback of rank 1:" in message and "ValueError: boom under mpirun" in message


def elastic_counter(marker: str) -> tuple[int, int, int]:
    """Counts committed steps; the worker on host 127.0.0.1 dies once, at its third step."""
    import numpy as np

    import hora.numpy as hvd
    from hora.numpy import elastic

    hvd.init()
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state: elastic.ObjectState) -> None:
        while state.step < 30:
            hvd.allreduce(np.ones(1), op=hvd.Sum)
            state.step += 1
            if state.step == 3 and os.environ["HORA_HOSTNAME"] == "127.0.0.1" and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(3)
            state.commit()
            time.sleep(0.02)

    train(state)
    return hvd.rank(), hvd.size(), state.step


@pytest.mark.ranks
@pytest.mark.timeout(180)
def test_an_elastic_job_returns_the_last_worlds_results(tmp_path: Path) -> None:
    results = hora.run(
        elastic_counter,
        args=(str(tmp_path / "died"),),
        num_proc=3,
        min_num_proc=2,
        hosts="localhost:1,127.0.0.1:1,127.0.0.2:1",
    )
    # The worker on 127.0.0.1 died: the last world has 2 ranks, and their results come back
    # under their ranks in it (a survivor started as rank 2 returns as rank 1).
    assert results == [(0, 2, 30), (1, 2, 30)]


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
                hora.run(wait, num_proc=2)
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
