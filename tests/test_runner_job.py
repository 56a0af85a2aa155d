"""In-process tests of the launcher's parts: output forwarding, the Job's stop sequence, summaries."""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hora.runner.hosts import plan
from hora.runner.job import Job, JobResult, RankOutcome
from hora.runner.output import Sink, StreamForwarder, rank_dir
from hora.runner.settings import LaunchSettings, Tuning, rank_env
from hora.runner.summary import failure_lines
from hora.runner.tracebacks import LastTraceback

pytestmark = pytest.mark.timeout(30)


def forward(chunks: list[bytes], copy: Path | None = None, pause: float = 0.0) -> tuple[str, StreamForwarder]:
    read_fd, write_fd = os.pipe()
    text = io.StringIO()
    forwarder = StreamForwarder(
        os.fdopen(read_fd, "rb"), 3, "stderr", Sink(text), None if copy is None else open(copy, "wb")
    ).start()
    for chunk in chunks:
        os.write(write_fd, chunk)
        time.sleep(pause)
    os.close(write_fd)
    assert forwarder.join(5)
    return text.getvalue(), forwarder


def test_forwarder_lines_carriage_returns_and_partial_last_line(tmp_path: Path) -> None:
    raw = [b"a\r", b"\nb\rc\n\xff\n", b"tail"]
    out, forwarder = forward(raw, copy=tmp_path / "copy", pause=0.05)
    assert out == "[3]<stderr>:a\r\n[3]<stderr>:b\r[3]<stderr>:c\n[3]<stderr>:\ufffd\n[3]<stderr>:tail\n"
    assert (tmp_path / "copy").read_bytes() == b"".join(raw)
    assert list(forwarder.tail) == ["a", "b", "c", "\ufffd", "tail"]


def test_forwarder_splits_very_long_lines_and_keeps_a_tail_of_ten() -> None:
    out, forwarder = forward([b"x" * 300000, b"\n"] + [f"line {i}\n".encode() for i in range(20)], pause=0.05)
    lines = out.splitlines()
    pieces = [line for line in lines if "x" in line]
    assert len(pieces) > 2 and all(line.startswith("[3]<stderr>:") for line in lines)
    assert "".join(piece.removeprefix("[3]<stderr>:") for piece in pieces) == "x" * 300000
    assert list(forwarder.tail) == [f"line {i}" for i in range(10, 20)]


def test_rank_dir_pads_to_the_width_of_size_minus_one() -> None:
    assert rank_dir("out", 0, 1) == os.path.join("out", "rank.0")
    assert rank_dir("out", 3, 10) == os.path.join("out", "rank.3")
    assert rank_dir("out", 3, 11) == os.path.join("out", "rank.03")
    assert rank_dir("out", 7, 101) == os.path.join("out", "rank.007")


def test_rank_env_layers_and_start_timeout_inheritance() -> None:
    slot = plan(2)[1]
    settings = LaunchSettings(command=("x",), num_proc=2, env={"USER_VAR": "1", "HORA_RANK": "9"})
    env = rank_env({"HOROVOD_START_TIMEOUT": "44", "PATH": "/bin"}, settings, slot, ("127.0.0.1", 5), b"\x01" * 32)
    assert env["HORA_RANK"] == "1" and env["USER_VAR"] == "1" and env["PATH"] == "/bin"
    assert "HORA_START_TIMEOUT" not in env and env["HOROVOD_START_TIMEOUT"] == "44"  # inherited, read via the alias
    assert env["HORA_SECRET"] == "01" * 32
    tuned = LaunchSettings(command=("x",), num_proc=2, start_timeout=5, tuning=Tuning({"HORA_FUSION_THRESHOLD": 512 * 1024}))
    env = rank_env({}, tuned, slot, ("127.0.0.1", 5), b"\x01" * 32)
    assert env["HORA_START_TIMEOUT"] == "5.0" and env["HORA_FUSION_THRESHOLD"] == str(512 * 1024)


def run_job(source: str, size: int, grace: float, timeout: float | None = None) -> tuple[JobResult, str]:
    settings = LaunchSettings(command=(sys.executable, "-c", textwrap.dedent(source)), num_proc=size)
    err = io.StringIO()
    result = Job(settings, plan(size), Sink(io.StringIO()), Sink(err), os.environ, grace=grace).run(timeout=timeout)
    return result, err.getvalue()


@pytest.mark.ranks
def test_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    # Rank 1 fails only once ranks 0 and 2 have set their SIGTERM handlers (flag files),
    # however slowly they start on a busy machine.
    source = f"""
        import os, pathlib, signal, sys, time
        rank = int(os.environ["HORA_RANK"])
        flags = pathlib.Path({str(tmp_path)!r})
        if rank == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if rank == 2:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))
        if rank == 1:
            deadline = time.monotonic() + 20
            while not all((flags / f"ready-{{r}}").exists() for r in (0, 2)) and time.monotonic() < deadline:
                time.sleep(0.01)
            sys.exit(4)
        (flags / f"ready-{{rank}}").touch()
        time.sleep(30)
    """
    started = time.monotonic()
    result, _ = run_job(source, 3, grace=0.5)
    assert time.monotonic() - started < 25
    assert result.first_failure == 1 and result.exit_code == 4
    assert [rank.returncode for rank in result.ranks] == [-signal.SIGKILL, 4, 5]
    assert result.running_at_stop == (0, 2)
    lines = failure_lines(result)
    assert lines[0].startswith("horarun: rank 1 failed first: exit code 4")
    assert lines[1] == "horarun: rank 1 wrote nothing to stderr"
    assert lines[3].endswith("did not stop within 0.5 s of SIGTERM: killed by SIGKILL")
    assert lines[4].endswith("stopped after SIGTERM (exit code 5)")


@pytest.mark.ranks
def test_timeout_stops_the_job() -> None:
    result, _ = run_job("import time; time.sleep(30)", 2, grace=1.0, timeout=0.5)
    assert result.timed_out and result.first_failure is None and result.exit_code == 124
    assert result.running_at_stop == (0, 1)
    assert failure_lines(result)[0] == "horarun: timed out: ranks still running: 0, 1; every rank was stopped"


@pytest.mark.ranks
def test_success_has_no_summary() -> None:
    result, err = run_job("print('ok')", 2, grace=1.0)
    assert result.exit_code == 0 and failure_lines(result) == [] and err == ""
    assert all(rank.signals_sent == () for rank in result.ranks)


def test_summary_of_a_detail_replacing_the_tail() -> None:
    slots = plan(2)
    result = JobResult(
        ranks=(
            RankOutcome(slots[0], 10, 0, 0.1, (), ()),
            RankOutcome(slots[1], 11, -signal.SIGSEGV, 0.2, (), ("segfault",)),
        ),
        first_failure=1,
    )
    assert result.exit_code == 128 + signal.SIGSEGV
    assert failure_lines(result, ["Traceback", "Boom"], "traceback of rank 1") == [
        "horarun: rank 1 failed first: killed by SIGSEGV (host localhost, pid 11, 0.20 s after start)",
        "horarun: traceback of rank 1:",
        "    Traceback",
        "    Boom",
        "horarun: the other ranks:",
        "    rank 0 (host localhost, pid 10): had finished (exit code 0)",
    ]


def test_summary_shows_the_last_traceback_then_what_followed_it() -> None:
    slots = plan(2)
    caught = LastTraceback(("Traceback (most recent call last):", '  File "t.py", line 1', "KeyError: 'x'"), ("bye",), 12)
    result = JobResult(
        ranks=(
            RankOutcome(slots[0], 10, 1, 0.1, (), ("KeyError: 'x'", "bye"), traceback=caught),
            RankOutcome(slots[1], 11, -signal.SIGTERM, 0.3, (signal.SIGTERM,), ()),
        ),
        first_failure=0,
    )
    assert failure_lines(result) == [
        "horarun: rank 0 failed first: exit code 1 (host localhost, pid 10, 0.10 s after start)",
        "horarun: rank 0's last traceback (from its stderr):",
        "    Traceback (most recent call last):",
        '      File "t.py", line 1',
        "    KeyError: 'x'",
        "horarun: rank 0 wrote 12 more lines to stderr after it; the last 1:",
        "    bye",
        "horarun: the other ranks:",
        "    rank 1 (host localhost, pid 11): stopped by SIGTERM",
    ]
    whole = dataclasses.replace(caught, after_count=1)
    ranks = (dataclasses.replace(result.ranks[0], traceback=whole), result.ranks[1])
    lines = failure_lines(dataclasses.replace(result, ranks=ranks))
    assert lines[5] == "horarun: rank 0 wrote 1 more line to stderr after it:"
