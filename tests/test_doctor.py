"""horarun doctor: against network-namespace hosts with real sshds (scripts/netns_hosts.py), and its report logic.

One host gets its sshd stopped, another a firewall (nftables in its namespace) that drops
every new TCP connection but ssh's: the report must name each, with the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hora.runner.doctor import HostCheck, PairCheck, find_problems, render
from hora.runner.ssh import HostInfo
from hora.version import __version__

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from netns_hosts import Cluster, ensure_system  # noqa: E402

PY = sys.executable


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ensure_system()
    hosts = Cluster(4).up()
    try:
        yield hosts
    finally:
        hosts.down()


def doctor(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "hora.runner", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, HORA_SSH_OPTIONS=cluster.ssh_options()),
    )


def test_doctor_on_healthy_hosts_and_on_broken_ones(cluster: Cluster) -> None:
    a, b, c, d = cluster.hosts
    healthy = doctor(cluster, "-H", f"localhost,{a.address}:2,{b.address}", "--bandwidth-mb", "2")
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    report = healthy.stdout
    assert "horarun doctor: 3 hosts" in report and "no problems found" in report
    assert f"uses eth0 {a.address}" in report and f"uses eth0 {b.address}" in report
    assert f"{cluster.gateways[0]}" in report  # this machine uses the address the hosts reach it at
    matrix = report.split("(row connects to column):\n", 1)[1].split("\n\n", 1)[0]
    assert "FAILED" not in matrix and matrix.count(" / ") == 6  # every ordered pair measured

    cluster.stop_sshd(c)
    cluster.firewall(d)
    try:
        broken = doctor(cluster, "-H", f"{a.address},{b.address},{c.address},{d.address}", "--bandwidth-mb", "1")
    finally:
        cluster.start_sshd(c)
        subprocess.run(["ip", "netns", "exec", d.namespace, "nft", "flush", "ruleset"], check=True)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    problems = broken.stdout.split("problems:\n", 1)[1].rstrip().splitlines()
    assert len(problems) == 2, broken.stdout
    assert problems[0] == (
        f"  - host {c.address}: cannot connect over ssh (port 22): connection refused: check that sshd runs there, "
        "or give the right port with -p/--ssh-port"
    )
    assert problems[1].startswith(f"  - host {d.address}: cannot be reached on its rank port {d.address}:")
    assert f"from {a.address}, {b.address}: the connections time out: a firewall" in problems[1]
    assert f"  {c.address}  unreachable" in broken.stdout


def test_doctor_names_a_missing_interface(cluster: Cluster) -> None:
    a, b = cluster.hosts[:2]
    result = doctor(cluster, "-H", f"{a.address},{b.address}", "--network-interfaces", "eth7", "--bandwidth-mb", "0")
    assert result.returncode == 1
    missing = f"host {a.address}: has none of the interfaces eth7; it has lo (127.0.0.1), eth0 ({a.address})"
    assert missing in result.stdout
    assert "(fix --network-interfaces)" in result.stdout


@pytest.mark.ranks
def test_doctor_bad_flags_are_one_line() -> None:
    result = subprocess.run([PY, "-m", "hora.runner", "doctor", "--hosts"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--hosts" in result.stderr
    result = subprocess.run([PY, "-m", "hora.runner", "doctor", "-H", "a::2"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("horarun doctor: error: -H/--hosts: 'a::2'")


def _check(host: str, python: str = "", hora: str = __version__, **fields: object) -> HostCheck:
    import platform

    info = HostInfo(host, host, python or platform.python_version(), "/py", hora, "10.0.0.1", None, 0.0, 0.1, ())
    check = HostCheck(host, local=False, info=info, address=f"10.0.0.{len(host)}", interface="eth0", port=4000)
    for name, value in fields.items():
        setattr(check, name, value)
    return check


def test_problems_in_plain_words_clock_versions_loopback() -> None:
    checks = [
        _check("a"),
        _check("bb", clock_offset=3.25),
        _check("ccc", python="3.9.1", hora="0.0.1"),
        _check("dddd", address="127.0.0.1"),
        _check("eeeee", address=None, setup_error="has none of the interfaces ib0; it has eth0 (10.0.0.5)"),
    ]
    pairs = [
        PairCheck("a", "bb", True, latency_ms=0.1, mb_per_s=900.0),
        PairCheck("bb", "a", False, "connection refused"),
    ]
    problems = find_problems(checks, pairs)
    assert problems[0].startswith("host bb: its clock is 3.2 s ahead of this machine's: run NTP")
    assert problems[1].startswith("host ccc: runs Python 3.9.1 with hora 0.0.1, this machine Python ")
    assert problems[2].startswith("host dddd: its ranks would advertise the loopback address 127.0.0.1")
    assert problems[3] == (
        "host eeeee: has none of the interfaces ib0; it has eth0 (10.0.0.5) (fix --network-interfaces)"
    )
    assert problems[4].startswith("host a: cannot be reached on its rank port 10.0.0.1:4000 from bb: the connections "
                                  "are refused: a firewall rejects them")  # fmt: skip
    lines = render(checks, pairs, problems)
    assert "5 problems:" in lines
    assert any(line.strip().startswith("a ") and "0.10 / 900" in line for line in lines)
