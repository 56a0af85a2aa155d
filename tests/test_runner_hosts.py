"""Unit tests for hora.runner.hosts, placement and ssh: -H and host files, placing ranks, reaching hosts."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

import pytest

from hora.runner.hosts import HostSpec, SlotInfo, assign_slots, is_local_host, parse_hostfile, parse_hosts, plan
from hora.runner.placement import HostsError, plan_placement
from hora.runner.ssh import HostInfo, SshSettings, describe_failure
from hora.version import __version__

pytestmark = pytest.mark.timeout(30)


def _everywhere(name: str) -> bool:
    return True


def test_parse_hosts_slots_default_to_one() -> None:
    assert parse_hosts("a:2, b ,c:4") == [HostSpec("a", 2), HostSpec("b", 1), HostSpec("c", 4)]


def test_parse_hosts_ipv6_in_brackets() -> None:
    assert parse_hosts("[::1]:3,[fe80::1]") == [HostSpec("::1", 3), HostSpec("fe80::1", 1)]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("a:0", ["'a:0'", ">= 1"]),
        ("a:x", ["'a:x'", ">= 1"]),
        ("a:-1", ["'a:-1'"]),
        (":2", ["':2'", "HOST"]),
        ("", ["names no host"]),
        ("a:1,a:2", ["'a'", "listed twice"]),
        ("::1:2", ["brackets"]),
    ],
)
def test_parse_hosts_errors_name_the_entry(text: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        parse_hosts(text)
    message = str(info.value)
    assert "\n" not in message and "-H/--hosts" in message
    for word in words:
        assert word in message


def test_parse_hostfile_comments_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("# the cluster\n\nnode1 slots=2\n  node2   slots=4  # big one\nnode3\n")
    assert parse_hostfile(str(path)) == [HostSpec("node1", 2), HostSpec("node2", 4), HostSpec("node3", 1)]


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("node1 slots=2\nnode2 slots=zero\n", ["line 2", "node2 slots=zero"]),
        ("node1 cpus=2\n", ["line 1", "slots=N"]),
        ("# nothing\n\n", ["names no host"]),
        ("a slots=1\na slots=2\n", ["listed twice"]),
    ],
)
def test_parse_hostfile_errors(tmp_path: Path, content: str, words: list[str]) -> None:
    path = tmp_path / "hosts"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        parse_hostfile(str(path))
    for word in words:
        assert word in str(info.value)


def test_parse_hostfile_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        parse_hostfile(str(tmp_path / "absent"))


def test_assign_two_hosts_full() -> None:
    slots = assign_slots(parse_hosts("a:2,b:2"), 4)
    assert slots == [
        SlotInfo("a", rank=0, size=4, local_rank=0, local_size=2, cross_rank=0, cross_size=2),
        SlotInfo("a", rank=1, size=4, local_rank=1, local_size=2, cross_rank=0, cross_size=2),
        SlotInfo("b", rank=2, size=4, local_rank=0, local_size=2, cross_rank=1, cross_size=2),
        SlotInfo("b", rank=3, size=4, local_rank=1, local_size=2, cross_rank=1, cross_size=2),
    ]


def test_assign_partial_last_host() -> None:
    slots = assign_slots(parse_hosts("a:2,b:2"), 3)
    assert [(s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        ("a", 0, 2, 0, 2),
        ("a", 1, 2, 0, 1),  # no other host has a local rank 1
        ("b", 0, 1, 1, 2),
    ]


def test_assign_uneven_hosts() -> None:
    slots = assign_slots(parse_hosts("a:3,b:1,c:2"), 6)
    assert [(s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        ("a", 0, 3, 0, 3),
        ("a", 1, 3, 0, 2),
        ("a", 2, 3, 0, 1),
        ("b", 0, 1, 1, 3),
        ("c", 0, 2, 2, 3),
        ("c", 1, 2, 1, 2),
    ]


def test_assign_leaves_unneeded_hosts_out() -> None:
    slots = assign_slots(parse_hosts("a:4,b:4"), 2)
    assert {s.hostname for s in slots} == {"a"}
    assert all(s.cross_size == 1 and s.local_size == 2 for s in slots)


def test_assign_too_many_processes() -> None:
    with pytest.raises(ValueError) as info:
        assign_slots(parse_hosts("a:2,b:2"), 5)
    message = str(info.value)
    assert "-np 5" in message and "4 slots" in message and "a:2,b:2" in message and "lower -np" in message


def test_plan_defaults_to_localhost() -> None:
    slots = plan(3)
    assert [s.hostname for s in slots] == ["localhost"] * 3
    assert [s.local_rank for s in slots] == [0, 1, 2]


def test_plan_with_made_up_hosts(tmp_path: Path) -> None:
    assert len(plan(4, hosts="a:2,b:2")) == 4
    path = tmp_path / "hosts"
    path.write_text("x slots=1\ny slots=1\n")
    assert [s.hostname for s in plan(2, hostfile=str(path))] == ["x", "y"]


def test_plan_hosts_and_hostfile_are_exclusive() -> None:
    with pytest.raises(ValueError, match="exclusive"):
        plan(1, hosts="a", hostfile="f")


def _info(host: str, launcher: str | None = "10.0.0.1", hora: str = __version__) -> HostInfo:
    return HostInfo(host, host, "3.11.7", "/py", hora, launcher, None, 0.0, 0.01, ())


def test_placement_all_local_stays_on_loopback() -> None:
    def no_probe(hosts: Sequence[str], ssh: SshSettings) -> dict[str, HostInfo | str]:
        raise AssertionError("nothing to probe")

    placement = plan_placement(plan(4, hosts="a:2,b:2"), SshSettings(), _everywhere, no_probe)
    assert placement.server_bind == "127.0.0.1" and not placement.remote_hosts
    assert dict(placement.rendezvous_addr) == {"a": "127.0.0.1", "b": "127.0.0.1"}


def test_placement_remote_hosts_reach_the_launcher_where_ssh_came_from() -> None:
    seen: list[str] = []

    def probe(hosts: Sequence[str], ssh: SshSettings) -> dict[str, HostInfo | str]:
        seen.extend(hosts)
        return {"b": _info("b", "10.0.0.1"), "c": _info("c", "10.1.0.1")}

    placement = plan_placement(plan(6, hosts="a:2,b:2,c:2"), SshSettings(), lambda name: name == "a", probe)
    assert seen == ["b", "c"]  # this machine is not probed
    assert placement.server_bind == "0.0.0.0" and placement.remote_hosts == {"b", "c"}
    # Ranks on this machine use the address the first remote host reaches it at: never loopback.
    assert dict(placement.rendezvous_addr) == {"a": "10.0.0.1", "b": "10.0.0.1", "c": "10.1.0.1"}


def test_placement_names_every_host_that_cannot_take_part() -> None:
    def probe(hosts: Sequence[str], ssh: SshSettings) -> dict[str, HostInfo | str]:
        return {"b": "host b: cannot connect over ssh (port 22): connection refused", "c": _info("c", hora="0.0.1")}

    with pytest.raises(HostsError) as info:
        plan_placement(plan(3, hosts="a,b,c"), SshSettings(), lambda name: name == "a", probe)
    assert info.value.lines == [
        "host b: cannot connect over ssh (port 22): connection refused",
        f"host c: runs hora 0.0.1, this machine runs hora {__version__}: install the same version on every host",
    ]


@pytest.mark.parametrize(
    "stderr, returncode, expected",
    [
        ("ssh: Could not resolve hostname h: Name or service not known", 255, "unknown host"),
        ("ssh: connect to host h port 22: Connection refused", 255, "connection refused: check that sshd runs"),
        ("ssh: connect to host h port 22: Connection timed out", 255, "timed out: the host is down or a firewall"),
        ("ssh: connect to host h port 22: No route to host", 255, "unreachable: no route to it"),
        ("root@h: Permission denied (publickey).", 255, "permission denied"),
        ("Host key verification failed.", 255, "host key verification failed"),
        ("bash: line 1: /venv/bin/python: No such file or directory", 127, "does not exist there"),
        ("/venv/bin/python: No module named hora.runner.remote", 1, "hora is not installed"),
    ],
)
def test_ssh_failures_are_one_line_with_the_fix(stderr: str, returncode: int, expected: str) -> None:
    line = describe_failure("h", returncode, stderr, SshSettings())
    assert line.startswith("host h: ") and expected in line and "\n" not in line


def test_ssh_command_is_safe_for_a_program() -> None:
    argv = SshSettings(2222, None, ("-F", "cfg")).command("node1", "exec true")
    assert argv[:2] == ["ssh", "-T"] and "BatchMode=yes" in argv and argv[-3:] == ["--", "node1", "exec true"]
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-F") + 1] == "cfg"
    assert "StrictHostKeyChecking=no" not in argv


@pytest.mark.parametrize("name", ["localhost", "LOCALHOST", "127.0.0.1", "127.0.1.1", socket.gethostname()])
def test_is_local_host_true(name: str) -> None:
    assert is_local_host(name)


@pytest.mark.parametrize("name", ["192.0.2.1", "no-such-host.invalid"])
def test_is_local_host_false(name: str) -> None:
    assert not is_local_host(name)
