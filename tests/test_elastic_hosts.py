"""Elastic horarun across hosts: network-namespace hosts with a real OpenSSH server each
(scripts/netns_hosts.py), as in tests/test_multihost.py.

A real ``python -m hora.runner --host-discovery-script ...`` in the root namespace runs an
elastic job (hora.numpy) on the namespace hosts over ssh; the discovery script reads a file
the test rewrites. One test kills a remote worker with SIGKILL mid-training (its host is
blacklisted, the survivors go on at the smaller size from the last commit), the other adds
a host (the workers reset at their next commit and the job grows). Each checks the
committed steps rank 0 logged: consecutive, none lost or repeated, and the running total
equal to the sum of the sizes the log shows; then that no process is left on any host.
Needs root (network namespaces); scripts/setup-system.sh installs OpenSSH and iproute2.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from netns_hosts import Cluster, Host, ensure_system, namespace_pids  # noqa: E402

pytestmark = pytest.mark.system

PY = sys.executable
JOB_TIMEOUT = 180.0  # seconds a whole elastic job may take before the test stops it

# An elastic worker. argv: LOG STEPS MAX_STEPS TARGET_SIZE SLEEP. It trains until it has
# committed STEPS steps at TARGET_SIZE ranks (at most MAX_STEPS steps, so a job that never
# reaches the size still ends). Before each commit rank 0 appends the step to LOG: the
# commit saves first, so a logged step is a committed one (rank 0 is never the one killed).
WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np
    import hora.numpy as hvd
    from hora.numpy import elastic

    log = sys.argv[1]
    steps, max_steps, target, pause = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    hvd.init()
    state = elastic.ObjectState(step=0, total=0.0)

    @elastic.run
    def train(state):
        while state.step < max_steps and not (state.step >= steps and hvd.size() == target):
            x = hvd.allreduce(np.ones(4), op=hvd.Sum, name="x")
            state.total = state.total + float(x[0])
            state.step += 1
            if hvd.rank() == 0:
                with open(log, "a") as handle:
                    handle.write(json.dumps({"step": state.step, "size": hvd.size(), "total": state.total,
                                             "host": os.environ.get("HORA_HOSTNAME"), "time": time.time()}) + "\\n")
            state.commit()
            time.sleep(pause)

    train(state)
    print(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "total": state.total}), flush=True)
    hvd.shutdown()
    """
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ensure_system()
    hosts = Cluster(3).up()
    try:
        yield hosts
    finally:
        hosts.down()


class ElasticJob:
    """One elastic horarun job on the cluster, its discovery file and rank 0's step log."""

    def __init__(self, cluster: Cluster, tmp_path: Path) -> None:
        self.cluster = cluster
        self.dir = tmp_path
        self.worker = tmp_path / "elastic_worker.py"  # the path marks the job's workers in `ps`
        self.worker.write_text(WORKER)
        self.log = tmp_path / "steps.jsonl"
        self.hosts_file = tmp_path / "hosts.txt"
        self.discover = tmp_path / "discover.sh"
        self.discover.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        self.discover.chmod(self.discover.stat().st_mode | stat.S_IXUSR)
        self.process: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.started_wall = self.ended_wall = 0.0

    def set_hosts(self, hosts: list[Host]) -> None:
        """Rewrites the discovery output at once (one ``HOST:1`` per line)."""
        temporary = self.hosts_file.with_suffix(".tmp")
        temporary.write_text("".join(f"{host.address}:1\n" for host in hosts))
        os.replace(temporary, self.hosts_file)

    def start(self, flags: list[str], steps: int, max_steps: int, target: int, pause: float) -> None:
        env = dict(os.environ, HORA_SSH_OPTIONS=self.cluster.ssh_options(), HORA_START_TIMEOUT="60")
        worker = [PY, str(self.worker), str(self.log), str(steps), str(max_steps), str(target), str(pause)]
        command = [PY, "-m", "hora.runner", *flags, "--host-discovery-script", str(self.discover),
                   "--elastic-timeout", "30", "--verbose", *worker]  # fmt: skip
        with open(self.dir / "stdout", "wb") as out, open(self.dir / "stderr", "wb") as err:
            self.process = subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=self.dir)
        self.started = time.monotonic()
        self.started_wall = time.time()

    def steps(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def wait_for(self, what: str, condition: Callable[[list[dict[str, Any]]], bool], timeout: float = 90) -> None:
        """Waits until the step log satisfies ``condition``; fails naming ``what`` otherwise."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while not condition(self.steps()):
            if self.process.poll() is not None:
                pytest.fail(f"horarun ended ({self.process.returncode}) before {what}:\n{self.stderr()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout} s:\n{self.stderr()}")
            time.sleep(0.05)

    def finish(self) -> int:
        """Waits for horarun to end (stopping it after ``JOB_TIMEOUT``); returns its exit code."""
        assert self.process is not None
        try:
            code = self.process.wait(timeout=max(1.0, JOB_TIMEOUT - (time.monotonic() - self.started)))
            self.ended_wall = time.time()
            return code
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"the elastic job did not end within {JOB_TIMEOUT} s:\n{self.stderr()}")

    def stop(self) -> None:
        """Stops horarun if it still runs (SIGTERM, then SIGKILL): its workers go with it."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def timings(self) -> str:
        """Seconds from horarun's start to rank 0's first step, of training, and from its last step to the job's end."""
        steps = self.steps()
        first, last = float(steps[0]["time"]), float(steps[-1]["time"])
        return (f"first step after {first - self.started_wall:.1f} s, {len(steps)} steps in {last - first:.1f} s, "
                f"horarun ended {self.ended_wall - last:.1f} s after the last")

    def stdout(self) -> str:
        return (self.dir / "stdout").read_text(errors="replace")

    def stderr(self) -> str:
        return (self.dir / "stderr").read_text(errors="replace")

    def worker_pids(self, host: Host) -> list[int]:
        """The job's worker processes on ``host`` (not its supervisor, which runs ``hora.runner.remote``)."""
        found = []
        for pid in namespace_pids(host.namespace):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    words = handle.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            if str(self.worker) in words:
                found.append(pid)
        return found


@pytest.fixture
def job(cluster: Cluster, tmp_path: Path) -> Iterator[ElasticJob]:
    elastic_job = ElasticJob(cluster, tmp_path)
    try:
        yield elastic_job
    finally:
        elastic_job.stop()
        # A failed test must not leave workers that spoil the next one's "no leftovers".
        deadline = time.monotonic() + 15
        while any(cluster.pids(host) for host in cluster.hosts) and time.monotonic() < deadline:
            time.sleep(0.1)
        for host in cluster.hosts:
            for pid in cluster.pids(host):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def assert_no_leftovers(cluster: Cluster, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = {host.address: cluster.processes(host) for host in cluster.hosts if cluster.pids(host)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes left on the test hosts: {left}"


def assert_committed_steps(steps: list[dict[str, Any]], sizes: list[int], stderr: str) -> None:
    """The log holds steps 1..N once each, at the sizes given in order, with the right totals."""
    assert [entry["step"] for entry in steps] == list(range(1, len(steps) + 1)), (steps, stderr)
    seen = [int(entry["size"]) for entry in steps]
    assert [size for index, size in enumerate(seen) if index == 0 or seen[index - 1] != size] == sizes, (seen, stderr)
    total = 0.0
    for entry in steps:
        total += float(entry["size"])
        assert entry["total"] == total, (entry, steps)


def test_a_worker_killed_on_a_remote_host_leaves_the_job_at_two_ranks(cluster: Cluster, job: ElasticJob) -> None:
    victim = cluster.hosts[2]
    job.set_hosts(cluster.hosts)
    job.start(["-np", "3", "--min-np", "2", "--max-np", "3"], steps=40, max_steps=400, target=2, pause=0.05)
    job.wait_for("10 steps at 3 ranks", lambda steps: sum(entry["size"] == 3 for entry in steps) >= 10)
    pids = job.worker_pids(victim)
    assert len(pids) == 1, (pids, job.stderr())
    killed_at = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    job.wait_for("a step at 2 ranks", lambda steps: any(entry["size"] == 2 for entry in steps))
    recovered = time.monotonic() - killed_at
    code = job.finish()
    stderr = job.stderr()
    assert code == 0, stderr
    steps = job.steps()
    assert_committed_steps(steps, [3, 2], stderr)
    assert len(steps) >= 40 and steps[-1]["size"] == 2
    assert {entry["host"] for entry in steps} == {cluster.hosts[0].address}  # rank 0 stayed on host 0
    assert f"failed (killed by SIGKILL): host {victim.address} blacklisted" in stderr, stderr
    survivors = f"{cluster.hosts[0].address}, {cluster.hosts[1].address}"
    assert f"horarun: elastic world 1: 2 ranks on {survivors}" in stderr, stderr
    assert "horarun: elastic job finished" in stderr, stderr
    finals = [json.loads(line.partition(">:")[2]) for line in job.stdout().splitlines() if ">:{" in line]
    assert sorted((final["rank"], final["size"], final["step"]) for final in finals) == [
        (0, 2, len(steps)), (1, 2, len(steps))
    ], job.stdout()  # fmt: skip
    print(f"\nkilled -> next step at 2 ranks: {recovered:.1f} s; {job.timings()}")
    assert_no_leftovers(cluster)


def test_a_host_added_to_the_discovery_output_grows_the_job_to_three_ranks(
    cluster: Cluster, job: ElasticJob
) -> None:
    job.set_hosts(cluster.hosts[:2])
    job.start(["-np", "2", "--min-np", "2", "--max-np", "3"], steps=40, max_steps=400, target=3, pause=0.05)
    job.wait_for("10 steps at 2 ranks", lambda steps: sum(entry["size"] == 2 for entry in steps) >= 10)
    added_at = time.monotonic()
    job.set_hosts(cluster.hosts)
    job.wait_for("a step at 3 ranks", lambda steps: any(entry["size"] == 3 for entry in steps))
    grown = time.monotonic() - added_at
    code = job.finish()
    stderr = job.stderr()
    assert code == 0, stderr
    steps = job.steps()
    assert_committed_steps(steps, [2, 3], stderr)
    assert len(steps) >= 40 and steps[-1]["size"] == 3
    assert "horarun: hosts changed (added): workers reset at their next commit" in stderr, stderr
    everyone = ", ".join(host.address for host in cluster.hosts)
    assert f"horarun: elastic world 1: 3 ranks on {everyone}" in stderr, stderr
    assert "blacklisted" not in stderr, stderr
    assert "horarun: elastic job finished: 3 worker(s) of world 1 succeeded" in stderr, stderr
    finals = [json.loads(line.partition(">:")[2]) for line in job.stdout().splitlines() if ">:{" in line]
    assert sorted((final["rank"], final["size"], final["step"]) for final in finals) == [
        (rank, 3, len(steps)) for rank in range(3)
    ], job.stdout()
    print(f"\nhost added -> first step at 3 ranks: {grown:.1f} s; {job.timings()}")
    assert_no_leftovers(cluster)
