"""Errors across ranks: every mismatch kind raises on every rank, the job goes on;
a killed rank makes every other rank raise; duplicate names; stalls."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from harness import TESTS, run_ranks

pytestmark = pytest.mark.ranks


def mismatch_job() -> list[tuple[str, str, str]]:
    import hora.numpy as hvd
    from hora.errors import CollectiveMismatchError

    hvd.init()
    r = hvd.rank()
    cases = {
        "shape": lambda: hvd.allreduce(np.ones((2, 3 + r)), name="shape"),
        "dtype": lambda: hvd.allreduce(np.ones(3, dtype=np.float32 if r == 0 else np.int64), name="dtype"),
        "op": lambda: hvd.allreduce(np.ones(3), op=hvd.Sum if r == 0 else hvd.Max, name="op"),
        "prescale": lambda: hvd.allreduce(np.ones(3), prescale_factor=1.0 + r, name="prescale"),
        "postscale": lambda: hvd.allreduce(np.ones(3), postscale_factor=1.0 + r, name="postscale"),
        "root": lambda: hvd.broadcast(np.ones(3), root_rank=r % 2, name="root"),
        "bcast shape": lambda: hvd.broadcast(np.ones(2 + r), root_rank=0, name="bshape"),
        "gather dims": lambda: hvd.allgather(np.ones((2, 1 + r)), name="gdims"),
        "gather rank": lambda: hvd.allgather(np.ones((2,) * (1 + r)), name="grank"),
        "alltoall dims": lambda: hvd.alltoall(np.ones((hvd.size(), 1 + r)), name="adims"),
        "reducescatter shape": lambda: hvd.reducescatter(np.ones((4 + r, 2)), name="rs"),
    }
    seen = []
    for case, call in cases.items():
        try:
            call()
            seen.append((case, "no error", ""))
        except CollectiveMismatchError as exc:
            seen.append((case, type(exc).__name__, str(exc)))
        # The runtime stays usable after each error.
        total = hvd.allreduce(np.ones(2), op=hvd.Sum, name=f"after {case}")
        assert total.tolist() == [hvd.size()] * 2
    hvd.shutdown()
    return seen


EXPECTED = {
    "shape": "allreduce 'shape': shapes differ across ranks: rank 0: (2, 3), rank 1: (2, 4)",
    "dtype": "allreduce 'dtype': data types differ across ranks: rank 0: float32, rank 1: int64",
    "op": "allreduce 'op': reduce ops differ across ranks: rank 0: Sum, rank 1: Max",
    "prescale": "prescale factors differ across ranks: rank 0: 1.0, rank 1: 2.0",
    "postscale": "allreduce 'postscale': postscale factors differ across ranks: rank 0: 0.5, rank 1: 1.0",
    "root": "broadcast 'root': root ranks differ across ranks: rank 0: 0, rank 1: 1",
    "bcast shape": "broadcast 'bshape': shapes differ across ranks: rank 0: (2,), rank 1: (3,)",
    "gather dims": "allgather 'gdims': shapes beyond the first dimension differ across ranks: rank 0: (2, 1), rank 1: (2, 2)",
    "gather rank": "allgather 'grank': numbers of dimensions differ across ranks: rank 0: 1, rank 1: 2",
    "alltoall dims": "alltoall 'adims': shapes beyond the first dimension differ",
    "reducescatter shape": "reducescatter 'rs': shapes differ across ranks: rank 0: (4, 2), rank 1: (5, 2)",
}


@pytest.mark.timeout(120)
def test_every_mismatch_raises_on_every_rank_and_the_job_goes_on():
    results = run_ranks(2, mismatch_job)
    for rank, seen in enumerate(results):
        for case, kind, message in seen:
            assert kind == "CollectiveMismatchError", f"rank {rank} {case}: {kind}"
            assert EXPECTED[case] in message, f"rank {rank} {case}: {message}"


def duplicate_and_local_errors_job() -> list[str]:
    import hora.numpy as hvd

    hvd.init()
    messages = []
    for checker in range(hvd.size()):
        # The checker's first "dup" cannot finish before the others submit theirs, which
        # they do only after the barrier: its second submission meets it in flight.
        if hvd.rank() == checker:
            handle = hvd.allreduce_async(np.ones(3), name="dup")
            try:
                hvd.allreduce_async(np.ones(3), name="dup")
            except ValueError as exc:
                messages.append(str(exc))
            hvd.barrier()
        else:
            hvd.barrier()
            handle = hvd.allreduce_async(np.ones(3), name="dup")
        hvd.synchronize(handle)
    hvd.allreduce(np.ones(3), name="dup")  # the name is free again
    for call in (
        lambda: hvd.alltoall(np.ones(3), name="a"),  # 3 rows do not split evenly over 2 ranks
        lambda: hvd.alltoall(np.ones(4), splits=[3, 2], name="b"),
        lambda: hvd.alltoall(np.ones(4), splits=[1], name="c"),
        lambda: hvd.broadcast(np.ones(2), root_rank=5, name="d"),
        lambda: hvd.allreduce(np.ones(2, dtype=np.uint32), name="e"),
        lambda: hvd.allreduce(np.ones(2, dtype=bool), name="f"),
        lambda: hvd.allreduce_(np.ones((4, 4))[:, 0], name="g"),
        lambda: hvd.reducescatter(np.ones(4), op=hvd.Max, name="h"),
    ):
        try:
            call()
            messages.append("no error")
        except (ValueError, RuntimeError) as exc:  # an unsupported op raises Horovod's RuntimeError class
            messages.append(f"{type(exc).__name__}: {exc}")
    try:
        hvd.allreduce(np.ones(2, dtype=np.int32), op=hvd.Adasum)
    except ValueError as exc:
        messages.append(str(exc))
    hvd.shutdown()
    return messages


@pytest.mark.timeout(60)
def test_local_errors_raise_at_once():
    for messages in run_ranks(2, duplicate_and_local_errors_job):
        assert "allreduce 'dup': another tensor of that name is still in flight" in messages[0]
        assert "must divide evenly" in messages[1]
        assert "splits sum to 5, more than the first dimension (4)" in messages[2]
        assert "splits has 1 entries; the process set has 2 ranks" in messages[3]
        assert "root_rank 5 is not a rank of the process set" in messages[4]
        assert "Tensor type uint32 is not supported" in messages[5]
        assert "Average is not defined for bool" in messages[6]
        assert messages[7] == "ValueError: Tensor is required to be contiguous."
        assert messages[8].startswith("UnsupportedOperationError") and "reduce op Max is not supported here" in messages[8]
        assert "Adasum needs floating-point tensors; got int32" in messages[9]


def killed_rank_job(victim: int) -> str:
    import os
    import signal
    import time

    import hora.numpy as hvd

    hvd.init()
    x = np.ones(1 << 16, dtype=np.float32)
    hvd.allreduce(x, name="warm-up")
    if hvd.rank() == victim:
        # Shapes the scenario only: the others are most likely waiting in 'step 0' (which
        # needs the victim) by then. The test holds whenever the kill lands: the victim's
        # warm-up returned only once every rank had done its part of it, and the others
        # fail the same way waiting in 'step 0' or submitting it.
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    errors = []
    try:
        for i in range(100000):
            hvd.allreduce(x, name=f"step {i}")
    except hvd.HoraInternalError as exc:
        errors.append(str(exc))
    try:  # later operations fail at once, with the same cause
        hvd.allreduce(x, name="later")
    except hvd.HoraInternalError as exc:
        errors.append(str(exc))
    return "\n".join(errors)


@pytest.mark.parametrize("size, victim", [(2, 1), (3, 0), (4, 2)])
@pytest.mark.timeout(90)
def test_killed_rank_makes_every_other_rank_raise(size, victim):
    from hora.transport import auth, shm

    secret = auth.new_secret()
    results = run_ranks(size, killed_rank_job, victim, timeout=60, check=False, secret=secret)
    # Shared segments were unlinked once mapped: the SIGKILLed rank left nothing in /dev/shm.
    assert shm.stale_segments(shm.job_key(secret)) == []
    for result in results:
        if result.rank == victim:
            assert result.returncode == -9
            continue
        assert result.returncode == 0, result.output + (result.error or "")
        first, later = result.value.split("\n")
        assert f"rank {victim}" in first and "was lost" in first, first
        assert "allreduce 'later' failed" in later and f"rank {victim}" in later


def horarun(script: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Runs ``tests/scripts/<script>`` on 3 ranks under horarun; returns it and its summary lines."""
    proc = subprocess.run(
        [sys.executable, "-m", "hora.runner", "-np", "3", sys.executable, str(TESTS / "scripts" / script)],
        capture_output=True,
        text=True,
        timeout=80,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    return proc, [line for line in proc.stderr.splitlines() if line.startswith("horarun:")]


@pytest.mark.timeout(90)
def test_horarun_names_the_killed_rank_first():
    proc, summary = horarun("kill_rank.py")
    assert proc.returncode != 0
    assert summary and "rank 1 failed first" in summary[0] and "SIGKILL" in summary[0], proc.stderr
    # Every surviving rank printed the hora error naming rank 1.
    for rank in (0, 2):
        assert any(
            line.startswith(f"[{rank}]<stdout>:HoraInternalError") and "rank 1" in line for line in proc.stdout.splitlines()
        ), proc.stdout


@pytest.mark.timeout(90)
def test_horarun_names_the_rank_that_sent_a_malformed_frame_first():
    proc, summary = horarun("malformed_frame.py")
    assert summary and "rank 1 failed first" in summary[0], proc.stderr


def stall_job(cached: bool, flags: str) -> str:
    import pathlib
    import time

    import hora.numpy as hvd
    from hora.core.api import current

    hvd.init()
    idle = pathlib.Path(flags) / "rank1-idle"
    if cached:  # 'lonely' is cached and small: rank 0's wait below is on the fast lane
        for _ in range(3):
            hvd.allreduce(np.ones(2), name="lonely")
    if hvd.rank() == 0:
        # Rank 1 is idle first: not busy on the fast lane, which would refuse the proposal.
        deadline = time.monotonic() + 30
        while not idle.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            hvd.allreduce(np.ones(2), name="lonely")
            return "no error"
        except hvd.HoraInternalError as exc:
            return str(exc)
    engine = current().engine
    deadline = time.monotonic() + 30
    while not engine.stats().idle and time.monotonic() < deadline:
        time.sleep(0.01)
    idle.touch()
    # Never submits 'lonely': waits until the stall shutdown has ended the job here too.
    deadline = time.monotonic() + 20
    while engine.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        hvd.allreduce(np.ones(2), name="late")
        return "no error"
    except hvd.HoraInternalError as exc:
        return str(exc)


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.timeout(60)
def test_stall_inspector_warns_then_shuts_down(cached, tmp_path):
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    results = run_ranks(2, stall_job, cached, str(tmp_path), env=env, check=False)
    assert "Missing ranks:\n1: [allreduce.lonely]" in results[0].output
    for result in results:
        assert "stalled for longer than 3 s" in result.value, result.value


def crashing_rank_job(tmp: str) -> None:
    """Rank 1 dies of an uncaught exception (its program crashes); rank 0 waits for it."""
    import subprocess
    import sys

    code = (
        "import numpy as np, hora.numpy as hvd\n"
        "hvd.init()\n"
        "hvd.allreduce(np.ones(2), name='warm-up')\n"
        "if hvd.rank() == 1:\n"
        "    raise ValueError('boom')\n"
        "try:\n"
        "    hvd.allreduce(np.ones(2), name='needs-1')\n"
        "except hvd.HoraInternalError as exc:\n"
        f"    open({tmp!r} + '/rank0.txt', 'w').write(str(exc))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=False, timeout=60)


@pytest.mark.timeout(90)
def test_a_rank_that_crashes_is_reported_lost_not_shut_down(tmp_path):
    run_ranks(2, crashing_rank_job, str(tmp_path), timeout=80)
    message = (tmp_path / "rank0.txt").read_text()
    assert "rank 1 on host" in message and "was lost: it exited after an uncaught ValueError: boom" in message, message
    assert "shut down" not in message


def crashing_rank_0_job(tmp: str) -> str:
    """Rank 0 dies of an uncaught exception while rank 1 waits, outside hora, for rank 0's
    process to end (as a rank waits in an MPI call of its own program under mpirun)."""
    import subprocess
    import sys

    code = (
        "import os, time, numpy as np, hora.numpy as hvd\n"
        "hvd.init()\n"
        "pids = hvd.allgather_object(os.getpid())\n"
        f"ready = {tmp!r} + '/ready'\n"
        "if hvd.rank() == 0:\n"
        "    while not os.path.exists(ready):  # rank 1 is past the allgather: nothing of hora's in flight\n"
        "        time.sleep(0.01)\n"
        "    raise ValueError('boom')\n"
        "open(ready, 'w').close()\n"
        "def alive(pid):\n"
        "    try:\n"
        "        return open(f'/proc/{pid}/stat').read().split()[2] != 'Z'\n"
        "    except OSError:\n"
        "        return False\n"
        "while alive(pids[0]):\n"
        "    time.sleep(0.05)\n"
        "try:\n"
        "    hvd.allreduce(np.ones(2), name='needs-0')\n"
        "except hvd.HoraInternalError as exc:\n"
        f"    open({tmp!r} + '/rank1.txt', 'w').write(str(exc))\n"
    )
    return subprocess.run([sys.executable, "-c", code], check=False, timeout=60, capture_output=True, text=True).stderr


@pytest.mark.timeout(90)
def test_rank_0_that_crashes_fails_the_job_at_once(tmp_path):
    # Before, rank 0 waited at exit for rank 1 to leave hora, and rank 1 for rank 0 to exit: a hang.
    results = run_ranks(2, crashing_rank_0_job, str(tmp_path), timeout=80)
    assert (tmp_path / "rank1.txt").exists(), results[1]
    message = (tmp_path / "rank1.txt").read_text()
    assert "rank 0 on host" in message and "was lost: it exited after an uncaught ValueError: boom" in message, message


def malformed_frame_job() -> str:
    import struct

    import hora.numpy as hvd
    from hora.core.api import current

    hvd.init()
    try:  # the others may still be in the warm-up when rank 1 breaks the job
        hvd.allreduce(np.ones(2), name="warm-up")
        if hvd.rank() == 1:  # a broken peer: a control frame of a kind that does not exist
            current().engine.control.links[0].sock.send(struct.pack("<IB", 3, 99) + b"bad")
        hvd.allreduce(np.ones(2), name="after")
        return "no error"
    except hvd.HoraInternalError as exc:
        return str(exc)


@pytest.mark.timeout(60)
def test_a_malformed_frame_fails_the_job_naming_the_rank_that_sent_it():
    for value in run_ranks(3, malformed_frame_job):
        assert "rank 1 on host" in value and "sent a malformed control message" in value, value
        assert "an unexpected control frame (kind 99)" in value, value


def error_classes_job() -> dict[str, list[str]]:
    import hora.numpy as hvd

    hvd.init()
    out: dict[str, list[str]] = {}
    try:  # Horovod raises HorovodInternalError, a RuntimeError, for an op reducescatter lacks
        hvd.reducescatter(np.ones(4), op=hvd.Adasum, name="rs")
    except RuntimeError as exc:
        out["reducescatter"] = [c.__name__ for c in type(exc).__mro__]
    try:  # cross-rank mismatches surface as HorovodInternalError in Horovod
        hvd.allreduce(np.ones(2 + hvd.rank()), name="shape")
    except hvd.HorovodInternalError as exc:
        out["mismatch"] = [c.__name__ for c in type(exc).__mro__]
    hvd.shutdown()
    return out


@pytest.mark.timeout(60)
def test_errors_keep_horovods_classes():
    for out in run_ranks(2, error_classes_job):
        assert "HoraInternalError" in out["reducescatter"] and "NotImplementedError" in out["reducescatter"], out
        assert out["mismatch"][:2] == ["CollectiveMismatchError", "HoraInternalError"], out


def silent_coordinator_job(frozen: bool) -> str:
    """Rank 0 goes quiet before its second allreduce while the workers wait for it: frozen
    (SIGSTOP; a helper kills it later), or alive but busy for 4 s."""
    import time

    import hora.numpy as hvd
    from hora.core.api import current
    from test_data_phase_failures import freeze

    hvd.init()
    hvd.allreduce(np.ones(2), name="warm-up")
    if hvd.rank() == 0:
        if frozen:
            freeze(-10.0)
        time.sleep(4.0)
    start = time.monotonic()
    try:
        hvd.allreduce(np.ones(2), name="after-the-silence")
        outcome = "no error"
    except hvd.HoraInternalError as exc:
        outcome = str(exc)
    answered = sorted(current().engine.control.pings_answered) if hvd.rank() == 0 else []
    hvd.shutdown()
    return f"{time.monotonic() - start:.1f}\n{answered}\n{outcome}"


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
@pytest.mark.timeout(90)
def test_workers_end_the_job_when_a_frozen_rank_0_leaves_their_pings_unanswered(shm):
    env = {
        "HORA_SHARED_MEMORY": "1" if shm else "0",
        "HORA_STALL_CHECK_TIME_SECONDS": "1",
        "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3",
    }
    results = run_ranks(3, silent_coordinator_job, True, env=env, check=False, launcher="torchrun", timeout=80)
    for result in results[1:]:
        assert result.returncode == 0, result.output + (result.error or "")
        seconds, _, message = result.value.split("\n", 2)
        assert "rank 0 (the coordinator) on host" in message and "nor answered a ping for 2 s" in message, message
        assert "shutting the job down after 3 s" in message, message
        assert 2.5 < float(seconds) < 15.0, result.value
        assert "nor answered a ping for 1 s" in result.output  # the warning before


@pytest.mark.timeout(90)
def test_a_busy_rank_0_answers_the_workers_pings_and_the_job_goes_on():
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "1"}  # no shutdown time: a warning could not end the job
    results = run_ranks(3, silent_coordinator_job, False, env=env, check=False, launcher="torchrun", timeout=80)
    for result in results:
        assert result.returncode == 0, result.output + (result.error or "")
        assert result.value.endswith("\nno error"), result.value
        assert "nor answered a ping" not in result.output
    assert results[0].value.split("\n")[1] == "[1, 2]", results[0].value  # both workers asked


def worker_silent_at_shutdown_job(frozen: bool) -> str:
    """Rank 0 shuts down while rank 1 goes quiet: frozen (SIGSTOP; a helper kills it later),
    or alive but busy for 5 s before it shuts down too. Rank 2 shuts down at once."""
    import time

    import hora.numpy as hvd
    from hora.core.api import current
    from test_data_phase_failures import freeze

    hvd.init()
    hvd.allreduce(np.ones(2), name="warm-up")
    engine = current().engine
    if hvd.rank() == 1:
        if frozen:
            freeze(-10.0)
        time.sleep(5.0)
    start = time.monotonic()
    hvd.shutdown()
    return f"{time.monotonic() - start:.1f}\n{sorted(engine.control.pings_answered)}\n{engine.failure}"


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "busy"])
@pytest.mark.timeout(90)
def test_rank_0_shut_down_pings_the_workers_it_waits_for(frozen):
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    results = run_ranks(3, worker_silent_at_shutdown_job, frozen, env=env, check=False, launcher="torchrun", timeout=80)
    seconds, _, failure = results[0].value.split("\n", 2)
    if frozen:
        assert "rank 1 on host" in failure and "nor answered a ping for 2 s" in failure, failure
        assert "shutting the job down after 3 s" in failure, failure
        assert 2.5 < float(seconds) < 9.0, results[0].value
    else:
        assert failure == "None", results[0].output
        assert results[1].value.split("\n")[1] == "[0]", results[1].value  # rank 1 answered rank 0
        assert "nor answered a ping" not in results[0].output
        for result in results:
            assert result.returncode == 0, result.output + (result.error or "")
