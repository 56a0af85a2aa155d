"""horarun across hosts: network-namespace hosts with a real OpenSSH server each (scripts/netns_hosts.py).

Every job here runs real ranks (hora.numpy) on the namespace hosts over ssh, launched by a
real `python -m hora.runner` in the root namespace, and checks results, topology, output,
the addresses ranks advertise, the failure summary and that no process is left on any host.
Needs root (network namespaces); scripts/setup-system.sh installs OpenSSH and iproute2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from netns_hosts import Cluster, ensure_system, namespace_pids  # noqa: E402

from hora.runner import cpu_binding  # noqa: E402

pytestmark = pytest.mark.system

PY = sys.executable

# A rank: one allreduce, then a JSON line with what it sees; options through argv.
RANK = textwrap.dedent(
    """
    import json, os, socket, sys
    import numpy as np
    import hora.numpy as hvd

    def mesh_addresses():
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        found = set()
        with open("/proc/self/net/tcp") as handle:
            for line in list(handle)[1:]:
                parts = line.split()
                if parts[9] in inodes and parts[3] == "01":
                    found.add(socket.inet_ntoa(bytes.fromhex(parts[1].split(":")[0])[::-1]))
        return sorted(found)

    hvd.init()
    total = hvd.allreduce(np.full(3, float(hvd.rank() + 1)), op=hvd.Sum, name="x")
    print(json.dumps({
        "rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "sum": total.tolist(),
        "host": os.environ["HORA_HOSTNAME"], "cwd": os.getcwd(), "addresses": mesh_addresses(),
        "foo": os.environ.get("HORA_TEST_FOO"), "bar": os.environ.get("HORA_TEST_BAR"),
        "baz": os.environ.get("TEST_BAZ"), "home_secret": "HORA_SSH_OPTIONS" in os.environ,
        "cpus": sorted(os.sched_getaffinity(0)),
    }))
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode.startswith("fail:") and hvd.rank() == int(mode[5:]):
        print("rank gives up: simulated failure", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode.startswith("kill:") and hvd.rank() == int(mode[5:]):
        os.kill(os.getpid(), 9)
    if mode == "sleep":
        print("ready", flush=True)
        child = __import__("subprocess").Popen(["sleep", "300"])  # a child of the rank: must not survive either
        __import__("time").sleep(300)
    hvd.allreduce(np.ones(2), name="y")
    hvd.shutdown()
    """
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ensure_system()
    hosts = Cluster(3, subnets=2).up()
    try:
        yield hosts
    finally:
        hosts.down()


@pytest.fixture
def rank_script(tmp_path: Path) -> Path:
    path = tmp_path / "rank.py"
    path.write_text(RANK)
    return path


def horarun_env(cluster: Cluster, **extra: str) -> dict[str, str]:
    env = dict(os.environ, HORA_SSH_OPTIONS=cluster.ssh_options(), HORA_START_TIMEOUT="60")
    env.update(extra)
    return env


def horarun(
    cluster: Cluster, args: list[str], cwd: Path, timeout: float = 90, **extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "hora.runner", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=horarun_env(cluster, **extra),
        cwd=cwd,
    )


def records(output: str) -> dict[int, dict[str, object]]:
    found = {}
    for line in output.splitlines():
        prefix, _, rest = line.partition(">:")
        if prefix.endswith("<stdout") and rest.startswith("{"):
            data = json.loads(rest)
            assert prefix == f"[{data['rank']}]<stdout", line  # each line carries its own rank's prefix
            found[int(data["rank"])] = data
    return found


def assert_no_leftovers(cluster: Cluster, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = {host.address: cluster.processes(host) for host in cluster.hosts if cluster.pids(host)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes left on the test hosts: {left}"


def test_three_hosts_two_slots_each(cluster: Cluster, rank_script: Path, tmp_path: Path) -> None:
    hosts = ",".join(f"{host.address}:2" for host in cluster.hosts)
    out = tmp_path / "out"
    result = horarun(
        cluster,
        ["-np", "6", "-H", hosts, "--verbose", "--output-filename", str(out), "-x", "TEST_BAZ",
         "-x", "HORA_TEST_FOO=foo", "--env", "HORA_TEST_BAR=bar", PY, str(rank_script)],  # fmt: skip
        tmp_path,
        TEST_BAZ="baz",
    )
    assert result.returncode == 0, result.stderr
    ranks = records(result.stdout)
    assert sorted(ranks) == list(range(6))
    for rank, data in ranks.items():
        host = cluster.hosts[rank // 2]
        assert data["sum"] == [21.0] * 3
        assert data["size"] == 6 and data["host"] == host.address
        assert (data["local_rank"], data["local_size"]) == (rank % 2, 2)
        assert (data["cross_rank"], data["cross_size"]) == (rank // 2, 3)
        assert data["cwd"] == str(tmp_path)  # the working directory is kept
        assert (data["foo"], data["bar"], data["baz"]) == ("foo", "bar", "baz")  # -x NAME=V, --env, -x NAME
        assert data["home_secret"] is False  # horarun's own ssh options stay on this machine
        # Every mesh link of the rank uses its host's address: never loopback across hosts.
        assert data["addresses"] == [host.addresses[0]], data
    assert "horarun: 6 ranks on 3 hosts" in result.stderr
    reaches = f"host {cluster.hosts[0].address}: over ssh, reaches the rendezvous at {cluster.gateways[0]}"
    assert reaches in result.stderr
    assert (out / "rank.5" / "stdout").read_text().startswith('{"rank": 5')  # one folder per rank
    assert "hora-remote" not in (out / "rank.5" / "stderr").read_text()  # control lines are taken out
    assert "HORA_SECRET" not in result.stderr and "hora-remote" not in result.stderr
    assert_no_leftovers(cluster)


def test_this_machine_and_a_remote_host_two_by_two(cluster: Cluster, rank_script: Path, tmp_path: Path) -> None:
    remote = cluster.hosts[0]
    result = horarun(
        cluster, ["-np", "4", "-H", f"localhost:2,{remote.address}:2", "--bind-to", "core", PY, str(rank_script)],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    ranks = records(result.stdout)
    # --bind-to core: each host's two ranks split its CPUs, here by horarun, there by its supervisor.
    cores = cpu_binding.cores(sorted(os.sched_getaffinity(0)))
    if len(cores) >= 2:
        assert [ranks[r]["cpus"] for r in range(4)] == [sorted(cpu_binding.block(r % 2, 2, cores) or ()) for r in range(4)]
    assert [ranks[r]["sum"] for r in range(4)] == [[10.0] * 3] * 4
    assert [(ranks[r]["local_rank"], ranks[r]["cross_rank"], ranks[r]["cross_size"]) for r in range(4)] == [
        (0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2)
    ]  # fmt: skip
    # The ranks on this machine advertise the address the remote host reaches it at, not loopback.
    assert ranks[0]["addresses"] == ranks[1]["addresses"] == [cluster.gateways[0]]
    assert ranks[2]["addresses"] == [remote.addresses[0]]
    assert_no_leftovers(cluster)


def test_network_interfaces_picks_the_interface(cluster: Cluster, rank_script: Path, tmp_path: Path) -> None:
    first, second = cluster.hosts[1], cluster.hosts[2]
    result = horarun(
        cluster,
        ["-np", "4", "-H", f"{first.address}:2,{second.address}:2", "--network-interfaces", "eth9,eth1",
         PY, str(rank_script)],  # fmt: skip
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    ranks = records(result.stdout)
    assert [ranks[r]["addresses"] for r in range(4)] == [[first.addresses[1]]] * 2 + [[second.addresses[1]]] * 2


def test_remote_rank_failure_is_named_first_with_its_host(
    cluster: Cluster, rank_script: Path, tmp_path: Path
) -> None:
    hosts = ",".join(f"{host.address}:2" for host in cluster.hosts)
    result = horarun(cluster, ["-np", "6", "-H", hosts, PY, str(rank_script), "fail:3"], tmp_path)
    assert result.returncode == 3, result.stderr
    summary = [line for line in result.stderr.splitlines() if line.startswith("horarun:")]
    failed_host = cluster.hosts[1].address
    assert summary[0].startswith(f"horarun: rank 3 failed first: exit code 3 (host {failed_host} over ssh, pid ")
    assert "rank gives up: simulated failure" in result.stderr.split(summary[0], 1)[1]
    assert "horarun: the other ranks:" in summary
    assert_no_leftovers(cluster)


def test_remote_rank_killed_by_a_signal(cluster: Cluster, rank_script: Path, tmp_path: Path) -> None:
    hosts = f"{cluster.hosts[1].address}:2,{cluster.hosts[2].address}:2"
    result = horarun(cluster, ["-np", "4", "-H", hosts, PY, str(rank_script), "kill:2"], tmp_path)
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    first = next(line for line in result.stderr.splitlines() if "failed first" in line)
    assert first.startswith(
        f"horarun: rank 2 failed first: killed by SIGKILL (host {cluster.hosts[2].address} over ssh, pid "
    ), first
    assert_no_leftovers(cluster)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_horarun_stopped_or_killed_leaves_no_process_on_any_host(
    cluster: Cluster, rank_script: Path, tmp_path: Path, signum: int
) -> None:
    hosts = ",".join(f"{host.address}:2" for host in cluster.hosts)
    process = subprocess.Popen(
        [PY, "-m", "hora.runner", "-np", "6", "-H", hosts, PY, str(rank_script), "sleep"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=horarun_env(cluster),
        cwd=tmp_path,
    )
    assert process.stdout is not None
    ready = 0
    deadline = time.monotonic() + 60
    while ready < 6 and time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        ready += line.rstrip().endswith(">:ready")
    assert ready == 6, process.stderr.read() if process.poll() is not None else "ranks did not get ready"
    assert all(cluster.pids(host) for host in cluster.hosts)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=30)
    if signum == signal.SIGTERM:
        assert process.returncode == 128 + signal.SIGTERM
        assert "horarun: interrupted by SIGTERM: every rank was stopped" in stderr
    else:
        # horarun had no chance to act: its ssh clients see their stdin close, and each host's
        # supervisor stops its rank (SIGTERM, then SIGKILL after the grace period).
        assert process.returncode == -signal.SIGKILL
    assert_no_leftovers(cluster, timeout=15)


def test_hosts_that_cannot_be_used_are_named_one_line_each(
    cluster: Cluster, rank_script: Path, tmp_path: Path
) -> None:
    good = cluster.hosts[0].address
    result = horarun(cluster, ["-np", "3", "-H", f"{good}:1,no-such-host.invalid:1,{good[:-1]}9:1", "true"], tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("horarun: error: host no-such-host.invalid: unknown host") and "-H/--hosts" in lines[0]
    assert lines[1] == f"horarun: error: host {good[:-1]}9: unreachable: no route to it (is it up, is the name right?)"

    refused = horarun(cluster, ["-np", "2", "-H", f"{good}:2", "-p", "2222", "true"], tmp_path)
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        f"horarun: error: host {good}: cannot connect over ssh (port 2222): connection refused: check that sshd "
        "runs there, or give the right port with -p/--ssh-port"
    )

    too_many = horarun(cluster, ["-np", "5", "-H", f"{good}:2,{cluster.hosts[1].address}:2", "true"], tmp_path)
    assert too_many.returncode == 2
    assert too_many.stderr.count("\n") == 1 and "-np 5 exceeds the 4 slots" in too_many.stderr


def test_a_key_the_host_refuses_is_named(cluster: Cluster, tmp_path: Path) -> None:
    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    known = Path(cluster.dir) / "known_hosts"
    options = f"-F /dev/null -o UserKnownHostsFile={known} -o StrictHostKeyChecking=yes"
    host = cluster.hosts[2].address
    result = subprocess.run(
        [PY, "-m", "hora.runner", "-np", "1", "-H", host, "-i", str(key), "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, HORA_SSH_OPTIONS=options),
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"horarun: error: host {host}: ssh refused the login (permission denied): set up key-based login "
        "(ssh-copy-id) or give the key with -i/--ssh-identity-file"
    )


def test_a_lost_ssh_connection_is_named_as_such(cluster: Cluster, rank_script: Path, tmp_path: Path) -> None:
    target = cluster.hosts[1]
    hosts = f"{cluster.hosts[0].address}:2,{target.address}:2"
    process = subprocess.Popen(
        [PY, "-m", "hora.runner", "-np", "4", "-H", hosts, PY, str(rank_script), "sleep"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=horarun_env(cluster),
        cwd=tmp_path,
    )
    assert process.stdout is not None
    ready = 0
    while ready < 4:
        line = process.stdout.readline()
        assert line, process.stderr.read() if process.stderr else ""
        ready += line.rstrip().endswith(">:ready")
    # The host's sshd drops the ranks' sessions (as when sshd or the network goes away).
    listener = target.sshd.pid if target.sshd is not None else -1
    sessions = [pid for pid in namespace_pids(target.namespace) if _is_sshd_session(pid, listener)]
    assert sessions
    for pid in sessions:
        os.kill(pid, signal.SIGKILL)
    _, stderr = process.communicate(timeout=60)
    first = next(line for line in stderr.splitlines() if "failed first" in line)
    assert first.startswith("horarun: rank 2 failed first: lost the ssh connection to host " + target.address) or (
        first.startswith("horarun: rank 3 failed first: lost the ssh connection to host " + target.address)
    ), stderr
    assert "(ssh exit code 255: the host, its sshd or the network went away)" in first
    assert_no_leftovers(cluster, timeout=15)


def _is_sshd_session(pid: int, listener: int) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            comm = handle.read().strip()
        with open(f"/proc/{pid}/stat") as handle:
            parent = int(handle.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return False
    return comm == "sshd" and parent == listener


def test_loopback_across_hosts_is_refused_naming_the_rank(cluster: Cluster, rank_script: Path, tmp_path: Path) -> None:
    hosts = f"{cluster.hosts[0].address}:1,{cluster.hosts[1].address}:1"
    result = horarun(cluster, ["-np", "2", "-H", hosts, "--network-interfaces", "lo", PY, str(rank_script)], tmp_path)
    assert result.returncode == 1
    assert (
        f"HoraInternalError: hora.init: rank 0 on host {cluster.hosts[0].address} would advertise the loopback "
        f"address 127.0.0.1, but the job spans the hosts {cluster.hosts[0].address}, {cluster.hosts[1].address}"
    ) in result.stderr


def test_hora_run_on_remote_hosts(cluster: Cluster, tmp_path: Path) -> None:
    # The call and the results travel through hora.run's store, in pieces past 1 MiB.
    code = textwrap.dedent(
        f"""
        import os, hora
        def where(blob):
            rank = int(os.environ["HORA_RANK"])
            if rank == 1 and len(blob) == 1:
                raise ValueError("rank 1 refuses")
            return os.environ["HORA_HOSTNAME"], rank, len(blob), bytes([rank]) * 1_500_000
        hosts = "{cluster.hosts[0].address}:1,{cluster.hosts[2].address}:1"
        results = hora.run(where, args=(b"x" * 3_000_000,), num_proc=2, hosts=hosts)
        print([(host, rank, size, len(back), set(back)) for host, rank, size, back in results])
        try:
            hora.run(where, args=(b"x",), num_proc=2, hosts=hosts)
        except RuntimeError as exc:
            print("failed:", "ValueError: rank 1 refuses" in str(exc))
        """
    )
    result = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=90, env=horarun_env(cluster),
                            cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    first, third = cluster.hosts[0].address, cluster.hosts[2].address
    assert lines[-2] == str([(first, 0, 3_000_000, 1_500_000, {0}), (third, 1, 3_000_000, 1_500_000, {1})])
    assert lines[-1] == "failed: True", result.stdout
