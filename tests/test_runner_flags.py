"""horarun's flags (horovodrun's spellings), --config-file, and what reaches a remote rank's environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hora.runner.cli import parse_settings
from hora.runner.control import decode_marker, encode_marker
from hora.runner.hosts import SlotInfo
from hora.runner.output import Sink, StreamForwarder
from hora.runner.settings import LaunchSettings, rank_env, remote_env

pytestmark = pytest.mark.timeout(60)


def settings(*args: str) -> LaunchSettings:
    parsed = parse_settings([*args, "true"])
    assert parsed is not None
    return parsed


def test_pass_on_flags_become_variables() -> None:
    s = settings(
        "-np", "2", "--autotune", "--autotune-log-file", "a.csv", "--autotune-warmup-samples", "2",
        "--autotune-steps-per-sample", "5", "--autotune-bayes-opt-max-samples", "9",
        "--autotune-gaussian-process-noise", "0.5", "--timeline-filename", "t.json", "--timeline-mark-cycles",
        "--hierarchical-allreduce", "--no-hierarchical-allgather", "--torus-allreduce", "--mpi-threads-disable",
        "--num-nccl-streams", "2", "--thread-affinity", "0,1", "--tcp", "--gloo",
    )  # fmt: skip
    assert s.tuning.env() == {
        "HORA_AUTOTUNE": "1", "HORA_AUTOTUNE_LOG": "a.csv", "HORA_AUTOTUNE_WARMUP_SAMPLES": "2",
        "HORA_AUTOTUNE_STEPS_PER_SAMPLE": "5", "HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "9",
        "HORA_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5", "HORA_TIMELINE": "t.json", "HORA_TIMELINE_MARK_CYCLES": "1",
        "HORA_HIERARCHICAL_ALLREDUCE": "1", "HORA_HIERARCHICAL_ALLGATHER": "0", "HORA_TORUS_ALLREDUCE": "1",
        "HORA_MPI_THREADS_DISABLE": "1", "HORA_NUM_NCCL_STREAMS": "2", "HORA_THREAD_AFFINITY": "0,1",
        "NCCL_IB_DISABLE": "1",
    }  # fmt: skip


def test_ssh_and_network_flags() -> None:
    s = settings("-np", "4", "-H", "a:2,b:2", "-p", "2222", "-i", "/k", "--network-interface", "eth1, eth0",
                 "-x", "FOO", "-x", "BAR=1", "--env", "BAZ=a=b", "--gloo-timeout-seconds", "12")  # fmt: skip
    assert (s.ssh_port, s.ssh_identity_file, s.network_interfaces) == (2222, "/k", "eth1, eth0")
    assert s.forward_env == ("FOO",) and s.env == {"BAR": "1", "BAZ": "a=b"}
    assert s.start_timeout == 12.0
    slot = SlotInfo("a", 0, 4, 0, 2, 0, 2)
    env = rank_env({"PATH": "/bin", "HOROVOD_CONTROLLER": "mpi"}, s, slot, ("10.0.0.1", 5), b"\x01" * 32)
    assert env["HORA_IFACE"] == env["HOROVOD_GLOO_IFACE"] == "eth1,eth0"
    # What horovodrun's Gloo launcher sets, over a stale value from the launching shell.
    assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--jsrun"], "--jsrun: IBM jsrun is not supported"),
        (["--mpi-args=-x A"], "--mpi-args applies to --mpi only"),
        (["--min-np", "2"], "--min-np 2 makes the job elastic, which needs --host-discovery-script"),
        (["--min-np", "3"], "-np 2 is below --min-np 3"),
        (["--max-np", "4"], "--max-np 4 applies only to an elastic job"),
        (["--reset-limit", "-1"], "argument --reset-limit: invalid value '-1': expected an integer >= 0"),
        (["--min-np", "1", "-H", "a:2,b:2", "--mpi"], "--mpi cannot run an elastic job"),
        (["--host-discovery-script", "d.sh", "-H", "a:2"], "-H/--hosts and --host-discovery-script are exclusive"),
        (["--host-discovery-script", "d.sh", "--blacklist-cooldown-range", "5", "2"], "expected MIN <= MAX"),
        (["-x", "1BAD"], "-x '1BAD' is not valid: expected NAME or NAME=VALUE"),
        (["--env", "NOVALUE"], "--env 'NOVALUE' is not valid: expected NAME=VALUE"),
        (["-p", "0"], "argument -p/--ssh-port: invalid value '0': expected an integer in [1, 65535]"),
        (["--autotune-gaussian-process-noise", "2"], "expected a number in [0, 1]"),
        (["--gloo", "--mpi"], "not allowed with argument --gloo"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(
    args: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_settings(["-np", "2", *args, "true"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err


def test_elastic_flags_make_elastic_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "42")
    s = settings("-np", "2", "--min-np", "1", "--max-np", "4", "--host-discovery-script", "./d.sh",
                 "--slots", "2", "--reset-limit", "3", "--blacklist-cooldown-range", "1", "9")  # fmt: skip
    assert s.elastic is not None
    assert (s.elastic.num_proc, s.elastic.min_num_proc, s.elastic.max_num_proc) == (2, 1, 4)
    assert (s.elastic.slots_per_host, s.elastic.reset_limit, s.elastic.blacklist_cooldown_range) == (2, 3, (1, 9))
    assert s.elastic.elastic_timeout == 42  # Horovod's variable when the flag is not given
    assert settings("-np", "2", "--min-np", "1", "-H", "a,b", "--elastic-timeout", "7").elastic.elastic_timeout == 7
    assert settings("-np", "2").elastic is None


def test_config_file_sections_and_the_command_line_wins(tmp_path: Path) -> None:
    path = tmp_path / "hora.yaml"
    path.write_text(
        "controller: gloo\n"
        "params: {fusion_threshold_mb: 32, cycle_time_ms: 10, cache_capacity: 2048, hierarchical_allreduce: true}\n"
        "autotune: {enabled: true, log_file: at.csv, warmup_samples: 5, gaussian_process_noise: 0.9}\n"
        "timeline: {filename: tl.json, mark_cycles: true}\n"
        "stall_check: {enabled: false, warning_time_seconds: 120, shutdown_time_seconds: 240}\n"
        "library_options: {mpi_threads_disable: true, num_nccl_streams: 2, gloo_timeout_seconds: 60}\n"
        "logging: {level: info, hide_timestamp: true}\n"
    )
    s = settings("-np", "2", "--config-file", str(path), "--cycle-time-ms", "3", "--log-level", "ERROR")
    env = s.tuning.env()
    assert env["HORA_FUSION_THRESHOLD"] == str(32 * 1024 * 1024) and env["HORA_CACHE_CAPACITY"] == "2048"
    assert env["HORA_CYCLE_TIME"] == "3.0" and env["HORA_LOG_LEVEL"] == "ERROR"  # the command line wins
    assert env["HORA_STALL_CHECK_DISABLE"] == "1" and env["HORA_STALL_CHECK_TIME_SECONDS"] == "120.0"
    assert env["HORA_AUTOTUNE"] == "1" and env["HORA_AUTOTUNE_LOG"] == "at.csv" and env["HORA_TIMELINE"] == "tl.json"
    assert env["HORA_HIERARCHICAL_ALLREDUCE"] == "1" and env["HORA_LOG_HIDE_TIME"] == "1"
    assert s.start_timeout == 60.0


def test_horovods_negations_override_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "hora.yaml"
    path.write_text(
        "autotune: {enabled: true}\ntimeline: {filename: tl.json, mark_cycles: true}\n"
        "stall_check: {enabled: false}\nlibrary_options: {mpi_threads_disable: true}\n"
        "logging: {hide_timestamp: true}\n"
    )
    flags = ["--no-autotune", "--no-timeline-mark-cycles", "--stall-check", "--no-mpi-threads-disable"]
    for timestamp in ("--log-with-timestamp", "--no-log-hide-timestamp"):
        env = settings("-np", "2", "--config-file", str(path), *flags, timestamp).tuning.env()
        assert {name: env[name] for name in ("HORA_AUTOTUNE", "HORA_TIMELINE_MARK_CYCLES", "HORA_STALL_CHECK_DISABLE",
                                             "HORA_MPI_THREADS_DISABLE", "HORA_LOG_HIDE_TIME")} == {
            "HORA_AUTOTUNE": "0", "HORA_TIMELINE_MARK_CYCLES": "0", "HORA_STALL_CHECK_DISABLE": "0",
            "HORA_MPI_THREADS_DISABLE": "0", "HORA_LOG_HIDE_TIME": "0",
        }  # fmt: skip
    with pytest.raises(SystemExit):  # a flag and its negation together: argparse's one-line error
        parse_settings(["-np", "2", "--autotune", "--no-autotune", "true"])


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("params: {fusion_threshold_mb: big}\n", "params.fusion_threshold_mb: 'big' is not valid: expected a number"),
        ("paramz: {}\n", "unknown section 'paramz': expected controller, params, autotune"),
        ("params: {fusion: 1}\n", "unknown key params.fusion: expected one of fusion_threshold_mb"),
        ("controller: nccl\n", "controller: 'nccl' is not valid: expected gloo or mpi"),
        ("- a\n", "expected a mapping of sections"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_config_file_errors(tmp_path: Path, content: str, fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(SystemExit):
        parse_settings(["-np", "2", "--config-file", str(path), "true"])
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err


def test_remote_env_forwards_what_a_rank_needs_and_nothing_else() -> None:
    base = {
        "PATH": "/venv/bin:/bin", "PYTHONPATH": "/src", "VIRTUAL_ENV": "/venv", "LC_ALL": "C.UTF-8",
        "HOROVOD_FUSION_THRESHOLD": "1", "HORA_SSH_OPTIONS": "-F cfg", "HOME": "/root", "SSH_AUTH_SOCK": "/s",
        "DISPLAY": ":0", "FOO": "forwarded", "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    s = LaunchSettings(command=("true",), num_proc=2, forward_env=("FOO",), env={"BAR": "set"})
    env = remote_env(base, s, SlotInfo("b", 1, 2, 0, 1, 1, 2), ("10.0.0.1", 4000), b"\x02" * 32)
    for name in ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "LC_ALL", "HOROVOD_FUSION_THRESHOLD", "FOO", "OMP_NUM_THREADS"):
        assert env[name] == base[name]
    for name in ("HOME", "SSH_AUTH_SOCK", "DISPLAY", "HORA_SSH_OPTIONS"):
        assert name not in env
    assert env["BAR"] == "set" and env["HORA_RANK"] == "1" and env["HORA_HOSTNAME"] == "b"
    assert env["HORA_RENDEZVOUS_ADDR"] == "10.0.0.1" and env["HORA_SECRET"] == "02" * 32


def test_control_lines_are_taken_out_of_a_remote_rank_stderr() -> None:
    assert decode_marker(b"partial" + encode_marker({"exit": 3})) == (b"partial", {"exit": 3})
    assert decode_marker(b"plain text\n") == (b"plain text\n", None)
    read, write = __import__("os").pipe()
    seen: list[dict[str, object]] = []
    import io

    out = io.StringIO()
    forwarder = StreamForwarder(open(read, "rb"), 4, "stderr", Sink(out), control=seen.append).start()
    with open(write, "wb") as pipe:
        pipe.write(encode_marker({"pid": 77}) + b"line one\nhalf" + encode_marker({"signal": 9}))
    assert forwarder.join(5)
    assert seen == [{"pid": 77}, {"signal": 9}]
    assert out.getvalue() == "[4]<stderr>:line one\n[4]<stderr>:half\n"
    assert list(forwarder.tail) == ["line one", "half"]


@pytest.mark.ranks
def test_help_lists_horovodrun_flags() -> None:
    result = subprocess.run([sys.executable, "-m", "hora.runner", "--help"], capture_output=True, text=True)
    for flag in ("--ssh-port", "--ssh-identity-file", "--network-interfaces", "--config-file", "--check-build",
                 "--timeline-filename", "--autotune", "--hierarchical-allreduce", "--output-filename",
                 "--prefix-output-with-timestamp", "--no-stall-check", "--log-level"):  # fmt: skip
        assert flag in result.stdout
