"""horarun end to end: a real `python -m hora.runner` subprocess running small Python scripts.

The scripts the ranks run need nothing from hora's runtime, only the environment the
launcher gives them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hora.runner import cli
from hora.version import __version__

TOPOLOGY = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")
PY = sys.executable


def horarun(*args: str, timeout: float = 30, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "hora.runner", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def script(source: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(source)]


def rank_lines(output: str, rank: int, stream: str = "stdout") -> list[str]:
    prefix = f"[{rank}]<{stream}>:"
    return [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (dead, waiting for a parent that may never reap it) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: signal 0 reached it


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    """Returns the pids still alive after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


ENV_DUMP = """
    import json, os
    keys = [p + k for p in ("HORA_", "HOROVOD_") for k in {topology}]
    keys += ["HORA_RENDEZVOUS_ADDR", "HORA_RENDEZVOUS_PORT", "HORA_SECRET", "HORA_START_TIMEOUT", "PYTHONUNBUFFERED"]
    print(json.dumps({{k: os.environ.get(k) for k in keys}}))
""".format(topology=list(TOPOLOGY))


def rank_envs(result: subprocess.CompletedProcess[str], size: int) -> list[dict[str, str]]:
    envs = []
    for rank in range(size):
        lines = rank_lines(result.stdout, rank)
        assert len(lines) == 1, result.stdout
        envs.append(json.loads(lines[0]))
    return envs


@pytest.mark.ranks
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_environment_per_rank(size: int) -> None:
    result = horarun("-np", str(size), *script(ENV_DUMP))
    assert result.returncode == 0, result.stderr
    envs = rank_envs(result, size)
    secrets = {env["HORA_SECRET"] for env in envs}
    assert len(secrets) == 1
    assert re.fullmatch(r"[0-9a-f]{64}", secrets.pop())
    ports = {env["HORA_RENDEZVOUS_PORT"] for env in envs}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, env in enumerate(envs):
        expected = {"RANK": rank, "SIZE": size, "LOCAL_RANK": rank, "LOCAL_SIZE": size}
        expected.update({"CROSS_RANK": 0, "CROSS_SIZE": 1, "HOSTNAME": "localhost"})
        for key, value in expected.items():
            assert env[f"HORA_{key}"] == str(value), (rank, key)
            assert env[f"HOROVOD_{key}"] == str(value), (rank, key)
        assert env["HORA_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert env["HORA_START_TIMEOUT"] == "30.0"
        assert env["PYTHONUNBUFFERED"] == "1"


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_two_host_names_on_one_machine() -> None:
    result = horarun("-np", "4", "-H", "localhost:2,127.0.0.1:2", "--start-timeout", "7", *script(ENV_DUMP))
    assert result.returncode == 0, result.stderr
    envs = rank_envs(result, 4)
    topology = [
        (e["HORA_HOSTNAME"], e["HORA_LOCAL_RANK"], e["HORA_LOCAL_SIZE"], e["HORA_CROSS_RANK"], e["HORA_CROSS_SIZE"])
        for e in envs
    ]
    assert topology == [
        ("localhost", "0", "2", "0", "2"),
        ("localhost", "1", "2", "0", "2"),
        ("127.0.0.1", "0", "2", "1", "2"),
        ("127.0.0.1", "1", "2", "1", "2"),
    ]
    assert {e["HORA_START_TIMEOUT"] for e in envs} == {"7.0"}


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_tuning_flags_reach_the_ranks_config() -> None:
    check = """
        import json, os
        from hora.config import Config
        c = Config.from_env()
        print(json.dumps([c.fusion_threshold, c.cycle_time_ms, c.cache_capacity, c.stall_check_disable,
                          c.stall_check_time_seconds, c.stall_shutdown_time_seconds, c.log_level,
                          c.log_hide_time, c.start_timeout, os.environ["PYTHONUNBUFFERED"]]))
    """
    flags = [
        "--fusion-threshold-mb", "2", "--cycle-time-ms", "3.5", "--cache-capacity", "7", "--no-stall-check",
        "--stall-check-warning-time-seconds", "9", "--stall-check-shutdown-time-seconds", "11",
        "--log-level", "debug", "--log-without-timestamp", "--start-timeout", "12",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="0")
    result = horarun("-np", "2", *flags, *script(check), env=env)
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert json.loads(rank_lines(result.stdout, rank)[0]) == [
            2 * 1024 * 1024, 3.5, 7, True, 9.0, 11.0, "DEBUG", True, 12.0, "0",
        ]  # fmt: skip
    result = horarun("-np", "1", "--disable-cache", *script(check))
    assert result.returncode == 0, result.stderr
    assert json.loads(rank_lines(result.stdout, 0)[0])[2] == 0


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_output_prefixes_partial_lines_and_bytes() -> None:
    source = """
        import os, sys
        r = os environ_rank
        print(f"out-{r}")
        print(f"err-{r}", file=sys.stderr)
        sys.stdout.buffer.write(b"bytes \\xff\\xfe end\\n")
        sys.stdout.write(f"partial-{r}")
    """.replace("os environ_rank", 'os.environ["HORA_RANK"]')
    result = subprocess.run([PY, "-m", "hora.runner", "-np", "2", *script(source)], capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        out = [line for line in result.stdout.splitlines() if line.startswith(f"[{rank}]<stdout>:".encode())]
        assert out == [
            f"[{rank}]<stdout>:out-{rank}".encode(),
            f"[{rank}]<stdout>:bytes \xff\xfe end".encode("latin-1"),
            f"[{rank}]<stdout>:partial-{rank}".encode(),
        ]
        assert f"[{rank}]<stderr>:err-{rank}".encode() in result.stderr.splitlines()
        assert f"<stderr>:out-{rank}".encode() not in result.stderr


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_prefix_output_with_timestamp() -> None:
    result = horarun("-np", "1", "-prefix-timestamp", *script("print('hello')"))
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[0\]<stdout>:hello\n", result.stdout)


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_output_filename_writes_raw_streams(tmp_path: Path) -> None:
    source = """
        import os, sys
        r = os.environ["HORA_RANK"]
        print("out", r)
        print("err", r, file=sys.stderr)
    """
    result = horarun("-np", "2", "--output-filename", str(tmp_path / "logs"), *script(source))
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        folder = tmp_path / "logs" / f"rank.{rank}"
        assert (folder / "stdout").read_text() == f"out {rank}\n"
        assert (folder / "stderr").read_text() == f"err {rank}\n"
        assert f"[{rank}]<stdout>:out {rank}" in result.stdout


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_verbose_prints_plan_and_port_but_never_the_secret(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    source = f"""
        import os
        if os.environ["HORA_RANK"] == "0":
            open({str(secret_file)!r}, "w").write(os.environ["HORA_SECRET"])
    """
    result = horarun("-np", "2", "--verbose", *script(source))
    assert result.returncode == 0, result.stderr
    assert re.search(r"rendezvous server on 127\.0\.0\.1:\d+", result.stderr)
    assert "rank 1: host localhost, local rank 1 of 2, cross rank 0 of 1" in result.stderr
    secret = secret_file.read_text()
    assert len(secret) == 64 and secret not in result.stderr + result.stdout


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_failing_rank_is_named_first_with_its_stderr_tail() -> None:
    source = """
        import os, sys, time
        rank = int(os.environ["HORA_RANK"])
        print("pid", os.getpid(), flush=True)
        if rank == 1:
            time.sleep(0.3)
            for i in range(12):
                print(f"complaint {i}", file=sys.stderr)
            sys.exit(3)
        time.sleep(30)
    """
    started = time.monotonic()
    result = horarun("-np", "3", *script(source))
    assert time.monotonic() - started < 20
    assert result.returncode == 3
    summary = [line for line in result.stderr.splitlines() if not line.startswith("[")]
    assert summary[0].startswith("horarun: rank 1 failed first: exit code 3 (host localhost, pid ")
    assert summary[1] == "horarun: last 10 lines of rank 1's stderr:"
    assert summary[2:12] == [f"    complaint {i}" for i in range(2, 12)]
    assert summary[12] == "horarun: the other ranks:"
    assert re.fullmatch(r"    rank 0 \(host localhost, pid \d+\): stopped by SIGTERM", summary[13])
    assert re.fullmatch(r"    rank 2 \(host localhost, pid \d+\): stopped by SIGTERM", summary[14])
    pids = [int(rank_lines(result.stdout, rank)[0].split()[1]) for rank in range(3)]
    assert wait_gone(pids) == []


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_a_crashed_rank_s_whole_traceback_leads_the_summary() -> None:
    """Twelve nested calls make a traceback of 26 lines: a ten-line tail would start mid-traceback."""
    source = """
        import os, sys, time
        if os.environ["HORA_RANK"] == "1":
            print("loading", file=sys.stderr)
            def ping(level):
                if level == 0:
                    raise ValueError("boom at the bottom")
                pong(level - 1)
            def pong(level):
                ping(level)
            ping(12)
        time.sleep(30)
    """
    result = horarun("-np", "2", *script(source))
    assert result.returncode == 1
    traceback = rank_lines(result.stderr, 1, "stderr")[1:]
    assert traceback[0] == "Traceback (most recent call last):" and traceback[-1] == "ValueError: boom at the bottom"
    assert len(traceback) > 20
    summary = [line for line in result.stderr.splitlines() if not line.startswith("[")]
    assert summary[0].startswith("horarun: rank 1 failed first: exit code 1 (host localhost, pid ")
    assert summary[1] == "horarun: rank 1's last traceback (from its stderr):"
    assert summary[2 : 2 + len(traceback)] == ["    " + line for line in traceback]
    assert summary[2 + len(traceback)] == "horarun: the other ranks:"


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_rank_killed_by_signal_stops_the_others_and_their_children() -> None:
    source = """
        import os, signal, subprocess, sys, time
        rank = int(os.environ["HORA_RANK"])
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("pids", os.getpid(), child.pid, flush=True)
        if rank == 0:
            time.sleep(0.5)
            print("about to die", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """
    result = horarun("-np", "3", *script(source))
    assert result.returncode == 128 + signal.SIGKILL
    summary = [line for line in result.stderr.splitlines() if not line.startswith("[")]
    assert summary[0].startswith("horarun: rank 0 failed first: killed by SIGKILL (host localhost")
    assert summary[1:3] == ["horarun: last 1 line of rank 0's stderr:", "    about to die"]
    assert sum("stopped by SIGTERM" in line for line in summary) == 2
    pids = [int(pid) for rank in range(3) for pid in rank_lines(result.stdout, rank)[0].split()[1:]]
    assert len(pids) == 6
    assert wait_gone(pids) == []


@pytest.mark.ranks
@pytest.mark.timeout(30)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_horarun_stops_every_rank(signum: int) -> None:
    source = """
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("pids", os.getpid(), child.pid, flush=True)
        time.sleep(60)
    """
    proc = subprocess.Popen(
        [PY, "-m", "hora.runner", "-np", "3", *script(source)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    pids: list[int] = []
    while len(pids) < 6:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        pids.extend(int(pid) for pid in line.split(":", 1)[1].split()[1:])
    proc.send_signal(signum)
    assert proc.wait(timeout=15) == 128 + signum
    stderr = proc.stderr.read()
    assert f"interrupted by {signal.Signals(signum).name}" in stderr
    assert stderr.count("stopped by SIGTERM") == 3
    assert wait_gone(pids) == []


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_sigkill_of_horarun_stops_its_silent_local_ranks(tmp_path: Path) -> None:
    """Ranks that write nothing never meet a closed pipe; rank 0 ignores SIGTERM, and each
    rank's child stands for what a wrapper script or a data loader starts."""
    source = """
        import os, signal, subprocess, sys, time
        rank = int(os.environ["HORA_RANK"])
        if rank == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        with open(os.path.join(sys.argv[1], f"rank{rank}.tmp"), "w") as handle:
            handle.write(f"{os.getpid()} {child.pid}")
        os.rename(os.path.join(sys.argv[1], f"rank{rank}.tmp"), os.path.join(sys.argv[1], f"rank{rank}"))
        time.sleep(60)
    """
    launcher = subprocess.Popen(
        [PY, "-m", "hora.runner", "-np", "2", *script(source), str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"rank{rank}").exists() for rank in range(2)):
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
            time.sleep(0.05)
        pids = [int(pid) for rank in range(2) for pid in (tmp_path / f"rank{rank}").read_text().split()]
        launcher.kill()
        assert launcher.wait(10) == -signal.SIGKILL
        # SIGTERM at once, SIGKILL after the default 5 s grace for rank 0, which ignores SIGTERM.
        assert wait_gone(pids, timeout=20) == []
        assert launcher.stderr is not None
        assert b"is gone without stopping its ranks: stopping its 2 local ranks" in launcher.stderr.read()
    finally:
        for pid in pids:  # never leave them behind, even when the test fails
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_success_exits_zero_and_unstarted_command_fails() -> None:
    assert horarun("-np", "2", PY, "-c", "pass").returncode == 0
    result = horarun("-np", "2", "/no/such/program")
    assert result.returncode == 127
    assert "cannot start rank 0" in result.stderr and "No such file" in result.stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["-np", "0", "true"], ["-np/--num-proc", "'0'"]),
        (["-np", "-2", "true"], ["-np/--num-proc", "'-2'"]),
        (["-np", "two", "true"], ["-np/--num-proc", "'two'"]),
        (["-np", "2", "--cycle-time-ms", "-5", "true"], ["--cycle-time-ms", "'-5'"]),
        (["-np", "2", "--fusion-threshold-mb", "nan", "true"], ["--fusion-threshold-mb", "'nan'"]),
        (["-np", "2", "--cache-capacity", "-1", "true"], ["--cache-capacity", "'-1'"]),
        (["-np", "2", "--start-timeout", "0", "true"], ["--start-timeout", "'0'"]),
        (["-np", "2", "--stall-check-warning-time-seconds", "0", "true"], ["--stall-check-warning-time-seconds"]),
        (["-np", "2", "--log-level", "LOUD", "true"], ["--log-level", "'LOUD'", "TRACE"]),
        (["-np", "2"], ["no command"]),
        (["true"], ["-np/--num-proc", "required"]),
        (["-np", "2", "-H", "a", "--hostfile", "f", "true"], ["--hostfile", "-H/--hosts"]),
        (["-np", "2", "-H", "localhost:0", "true"], ["-H/--hosts", "'localhost:0'"]),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    args: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("horarun: error: "), err
    for word in words:
        assert word in err


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_bad_flag_through_the_real_command() -> None:
    result = horarun("-np", "2", "--cycle-time-ms", "-1", "true")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--cycle-time-ms" in result.stderr and "'-1'" in result.stderr


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_more_processes_than_slots() -> None:
    result = horarun("-np", "5", "-H", "localhost:2,127.0.0.1:2", "true")
    assert result.returncode == 2
    assert result.stderr.startswith("horarun: error: -np 5 exceeds the 4 slots")


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_unknown_host_is_one_line_naming_it(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\nno-such-host.invalid slots=1\n")
    result = horarun("-np", "2", "-hostfile", str(hostfile), "true")
    assert result.returncode == 1
    assert result.stderr == (
        "horarun: error: host no-such-host.invalid: unknown host (the name does not resolve): fix the name in "
        "-H/--hosts or --hostfile\n"
    )


@pytest.mark.ranks
@pytest.mark.timeout(30)
def test_version() -> None:
    result = horarun("-v")
    assert result.returncode == 0
    assert result.stdout.strip() == f"hora {__version__}"
