"""horarun's elastic driver end to end on this machine: real workers, a real discovery script.

The "hosts" are names of this machine (``localhost``, ``127.0.0.1``, ``127.0.0.2``, ...):
to the driver each is a host of its own, so a failed worker blacklists only its name.
The discovery script prints a file the test rewrites while the job runs.

The workers train a counter: every step allreduces ``size`` ones, adds the result to
``state.total`` and commits. Rank 0 logs each committed step with the world size, so a
test checks the steps are consecutive and ``total`` is the sum of the sizes of the
worlds each step ran in: no committed step lost or counted twice across resets.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(240)]

PY = sys.executable
RUN_TIMEOUT = 180.0  # seconds one job may take: generous on a busy 2-core machine

WORKER = r"""
import json, os, sys, time
import numpy as np
import hora.numpy as hvd
from hora.numpy import elastic

out, steps, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
fail_host, fail_step = os.environ.get("FAIL_HOST"), int(os.environ.get("FAIL_STEP", "0"))
slot = f"{os.environ['HORA_HOSTNAME']}[{os.environ['HORA_LOCAL_RANK']}]"
with open(os.path.join(out, "pid-" + slot), "w") as f:
    f.write(str(os.getpid()))
hvd.init()
state = elastic.ObjectState(step=0, total=0.0)
local_steps = 0

@elastic.run
def train(state):
    global local_steps
    while state.step < steps:
        x = hvd.allreduce(np.ones(1), op=hvd.Sum)
        state.total = state.total + float(x[0])
        state.step += 1
        local_steps += 1
        if os.environ["HORA_HOSTNAME"] == fail_host and local_steps == fail_step:
            sys.exit(3)
        state.commit()
        if hvd.rank() == 0:
            with open(os.path.join(out, "log"), "a") as f:
                f.write(json.dumps({"step": state.step, "size": hvd.size(), "total": state.total}) + "\n")
        time.sleep(delay)
    return state.total

total = train(state)
print(f"finished {slot} rank {hvd.rank()} of {hvd.size()} total {total}", flush=True)
"""


class ElasticJob:
    """One elastic horarun job in ``tmp``: its discovery file, its log and its workers' pids."""

    def __init__(self, tmp: Path, hosts: list[str]) -> None:
        self.dir = tmp
        self.hosts_file = tmp / "hosts.txt"
        self.set_hosts(hosts)
        self.script = tmp / "discover.sh"
        self.script.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        self.script.chmod(0o755)
        (tmp / "worker.py").write_text(WORKER)

    def set_hosts(self, hosts: list[str]) -> None:
        """Lists ``hosts`` (one slot each) from the next discovery on."""
        staged = self.hosts_file.with_suffix(".new")
        staged.write_text("".join(f"{host}:1\n" for host in hosts))
        staged.replace(self.hosts_file)  # the script never reads half a file

    def rows(self) -> list[dict[str, Any]]:
        path = self.dir / "log"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for(self, condition: Callable[[list[dict[str, Any]]], bool], timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if condition(self.rows()):
                return
            time.sleep(0.05)
        raise AssertionError(f"the job's log never met the condition: {self.rows()[-3:]}")

    def kill(self, slot: str) -> None:
        os.kill(int((self.dir / f"pid-{slot}").read_text()), signal.SIGKILL)

    def run(
        self,
        *flags: str,
        steps: int = 40,
        delay: float = 0.05,
        env: dict[str, str] | None = None,
        during: Callable[[ElasticJob], None] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Runs the job; ``during(self)`` runs in a thread meanwhile (its error fails the test)."""
        command = [PY, "-m", "hora.runner", *flags, "--host-discovery-script", str(self.script),
                   PY, str(self.dir / "worker.py"), str(self.dir), str(steps), str(delay)]  # fmt: skip
        errors: list[BaseException] = []

        def act() -> None:
            try:
                assert during is not None
                during(self)
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                errors.append(exc)

        thread = threading.Thread(target=act, daemon=True) if during is not None else None
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, **(env or {})}, cwd=self.dir)  # fmt: skip
        if thread is not None:
            thread.start()
        try:
            out, err = process.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=30)
            raise AssertionError(f"the elastic job did not end within {RUN_TIMEOUT} s:\n{err[-3000:]}") from None
        if thread is not None:
            thread.join(timeout=30)
        if errors:
            raise AssertionError(f"the test's actions failed: {errors[0]!r}\n{err[-3000:]}") from errors[0]
        return subprocess.CompletedProcess(command, process.returncode, out, err)


def check_committed_steps(rows: list[dict[str, Any]], steps: int) -> list[int]:
    """Checks that no committed step was lost or counted twice; returns the sizes seen, in order.

    A step whose commit raised (a reset) is not logged; it ran in the world of the step
    before it, and the logged total says so.
    """
    assert rows, "nothing was committed"
    assert [row["step"] for row in rows] == sorted({row["step"] for row in rows}), "a committed step repeats"
    total, previous, size = 0.0, 0, rows[0]["size"]
    for row in rows:
        skipped = row["step"] - previous - 1
        assert skipped in (0, 1), f"steps {previous + 1}..{row['step'] - 1} were lost"
        total += skipped * size + row["size"]  # the skipped step ran in the previous world
        size, previous = row["size"], row["step"]
        assert row["total"] == total, f"step {row['step']}: total {row['total']}, expected {total}"
    # The last step is logged too, unless its own commit raised (the world changed right
    # then): the reset restores that commit, the loop finds every step done, and ends.
    assert rows[-1]["step"] in (steps - 1, steps), f"the job ended after step {rows[-1]['step']} of {steps}"
    sizes = [rows[0]["size"]]
    for row in rows:
        if row["size"] != sizes[-1]:
            sizes.append(row["size"])
    return sizes


def test_a_killed_worker_the_job_goes_on_smaller_from_the_last_commit(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, ["localhost", "127.0.0.1", "127.0.0.2", "127.0.0.3"])

    def kill_one(job: ElasticJob) -> None:
        job.wait_for(lambda rows: len(rows) >= 5)
        job.kill("127.0.0.2[0]")

    result = job.run("-np", "4", "--min-np", "2", steps=60, during=kill_one)
    assert result.returncode == 0, result.stderr[-3000:]
    assert check_committed_steps(job.rows(), 60) == [4, 3]
    assert "127.0.0.2[0] failed (killed by SIGKILL): host 127.0.0.2 blacklisted" in result.stderr
    assert "elastic world 1: 3 ranks on localhost, 127.0.0.1, 127.0.0.3" in result.stderr
    assert result.stdout.count("finished") == 3 and "elastic job finished" in result.stderr


def test_an_added_host_grows_the_job_at_the_next_commit(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, ["localhost", "127.0.0.1", "127.0.0.2"])

    def add_one(job: ElasticJob) -> None:
        job.wait_for(lambda rows: len(rows) >= 5)
        job.set_hosts(["localhost", "127.0.0.1", "127.0.0.2", "127.0.0.3"])

    result = job.run("-np", "3", "--min-np", "2", "--max-np", "4", steps=80, during=add_one)
    assert result.returncode == 0, result.stderr[-3000:]
    assert check_committed_steps(job.rows(), 80) == [3, 4]
    assert "elastic world 1: 4 ranks" in result.stderr and result.stdout.count("finished") == 4


def add_a_host_once_waiting(job: ElasticJob) -> None:
    """``during`` of the one-rank jobs below: adds 127.0.0.1 once the worker wrote ``waiting``."""
    end = time.monotonic() + 120
    while not (job.dir / "waiting").exists():
        assert time.monotonic() < end, "the worker never started waiting"
        time.sleep(0.05)
    job.set_hosts(["localhost", "127.0.0.1"])


NOTIFIED_WORKER = r"""
import os, sys, threading
import hora.numpy as hvd
from hora.numpy import elastic

out = sys.argv[1]
hvd.init()
notified = threading.Event()

class State(elastic.ObjectState):
    def on_hosts_updated(self, timestamp, update_res):
        super().on_hosts_updated(timestamp, update_res)
        notified.set()

@elastic.run
def train(state):
    if hvd.size() == 1:
        open(os.path.join(out, "waiting"), "w").close()
        # No hora call from here on until the notification: it must come on hora's own thread.
        if not notified.wait(60):
            raise TimeoutError("on_hosts_updated was not called")
        state.commit()  # the change of hosts: HostsUpdatedInterrupt, then the bigger world
        raise AssertionError("commit() did not raise HostsUpdatedInterrupt")
    return hvd.size()

print("finished in a world of", train(State(step=0)), flush=True)
"""


def test_a_change_of_hosts_reaches_on_hosts_updated_without_a_commit(tmp_path: Path) -> None:
    # Horovod's own elastic test program waits for state._host_messages between commits:
    # Horovod's notification service calls on_hosts_updated as the driver's message comes.
    job = ElasticJob(tmp_path, ["localhost"])
    (tmp_path / "worker.py").write_text(NOTIFIED_WORKER)

    result = job.run("-np", "1", "--min-np", "1", "--max-np", "2", during=add_a_host_once_waiting)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("finished in a world of 2") == 2, result.stdout + result.stderr[-3000:]


TF_WORKER = r"""
import os, sys, threading
import tensorflow as tf
import hora.tensorflow as hvd

out = sys.argv[1]
hvd.init()
w = tf.Variable([1.0, 2.0])
notified = threading.Event()

class State(hvd.elastic.TensorFlowState):
    def on_hosts_updated(self, timestamp, update_res):
        super().on_hosts_updated(timestamp, update_res)
        notified.set()

@tf.function
def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * x)
    (g,) = hvd.DistributedGradientTape(tape).gradient(loss, [w])
    w.assign_sub(0.01 * g)
    return g

@hvd.elastic.run
def train(state):
    g = None
    while state.step < 6:
        g = step(tf.constant([float(hvd.rank() + 1)] * 2))  # rank 0 traced it in a world of 1
        state.step += 1
        if hvd.size() == 1 and state.step == 3:
            open(os.path.join(out, "waiting"), "w").close()
            if not notified.wait(60):
                raise TimeoutError("no change of hosts")
        state.commit()
    return g.numpy().tolist()

last = train(State([w], step=0))
print("finished", hvd.size(), last, flush=True)
"""


def test_a_tf_function_traced_in_a_world_of_one_reduces_gradients_once_the_world_grows(tmp_path: Path) -> None:
    # Horovod's own elastic_tensorflow2_main.py: the step traced at size 1 skipped the
    # allreduce for good, so after a host was added rank 0 ran none while the new rank
    # waited in its own. The size is now read when the step runs, as Horovod's size_op().
    job = ElasticJob(tmp_path, ["localhost"])
    (tmp_path / "worker.py").write_text(TF_WORKER)

    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}
    result = job.run("-np", "1", "--min-np", "1", "--max-np", "2", env=env, during=add_a_host_once_waiting)
    assert result.returncode == 0, result.stderr[-3000:]
    # Both ranks' last gradient is the average of rank 0's [1, 1] and rank 1's [2, 2].
    assert result.stdout.count("finished 2 [1.5, 1.5]") == 2, result.stdout + result.stderr[-3000:]


def test_a_removed_host_loses_its_worker_and_the_rest_go_on(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, ["localhost", "127.0.0.1", "127.0.0.2"])

    def remove_one(job: ElasticJob) -> None:
        job.wait_for(lambda rows: len(rows) >= 5)
        job.set_hosts(["localhost", "127.0.0.2"])

    result = job.run("-np", "3", "--min-np", "2", steps=60, during=remove_one)
    assert result.returncode == 0, result.stderr[-3000:]
    assert check_committed_steps(job.rows(), 60) == [3, 2]
    assert "elastic world 1: 2 ranks on localhost, 127.0.0.2" in result.stderr
    assert result.stdout.count("finished") == 2 and "finished 127.0.0.1[0]" not in result.stdout
    assert "blacklisted" not in result.stderr  # removed, not failed


def test_a_host_that_keeps_failing_is_blacklisted_each_time_and_the_job_goes_on(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, ["localhost", "127.0.0.1", "127.0.0.2"])
    # 127.0.0.2's worker exits 3 at its 4th step, each time it is started; after its
    # cooldown (2 s) the host comes back, fails again, and is blacklisted again.
    result = job.run("-np", "3", "--min-np", "2", "--blacklist-cooldown-range", "1", "2", steps=140, delay=0.06,
                     env={"FAIL_HOST": "127.0.0.2", "FAIL_STEP": "4"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    failures = result.stderr.count("127.0.0.2[0] failed (exit code 3): host 127.0.0.2 blacklisted")
    assert failures >= 2, result.stderr[-3000:]
    sizes = check_committed_steps(job.rows(), 140)
    assert sizes[:3] == [3, 2, 3] and sizes[-1] in (2, 3)


def test_the_reset_limit_stops_the_job_with_horovods_message(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, ["localhost", "127.0.0.1", "127.0.0.2"])

    def two_changes(job: ElasticJob) -> None:
        job.wait_for(lambda rows: len(rows) >= 3)
        job.kill("127.0.0.2[0]")
        job.wait_for(lambda rows: rows[-1]["size"] == 2)
        job.kill("127.0.0.1[0]")

    result = job.run("-np", "3", "--min-np", "1", "--reset-limit", "1", steps=400, during=two_changes)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == "horarun: Horovod was shutdown because number of resets during elastic job exceeded limit: 1"


def test_too_few_slots_for_longer_than_the_elastic_timeout_stops_the_job_naming_them(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, ["localhost", "127.0.0.1"])

    def kill_one(job: ElasticJob) -> None:
        job.wait_for(lambda rows: len(rows) >= 3)
        job.kill("127.0.0.1[0]")

    started = time.monotonic()
    result = job.run("-np", "2", "--min-np", "2", "--elastic-timeout", "2", steps=400, during=kill_one)
    assert result.returncode == 1
    assert time.monotonic() - started < 60
    last = result.stderr.strip().splitlines()[-1]
    assert "Timed out waiting for minimum number of slots" in last
    assert "2 needed after 2 s (--elastic-timeout), 1 available (hosts: localhost:1; blacklisted: 127.0.0.1)" in last
    assert "finished" not in result.stdout  # the survivor waiting for its world was stopped


def test_a_worker_that_never_resets_does_not_hang_the_job(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, ["localhost", "127.0.0.1", "127.0.0.2"])

    def stop_one(job: ElasticJob) -> None:
        job.wait_for(lambda rows: len(rows) >= 3)
        os.kill(int((job.dir / "pid-127.0.0.1[0]").read_text()), signal.SIGSTOP)  # frozen: neither resets nor exits
        job.kill("127.0.0.2[0]")

    result = job.run("-np", "3", "--min-np", "1", "--elastic-timeout", "3", steps=400, during=stop_one)
    assert result.returncode == 1
    assert "127.0.0.1[0] neither reset nor exited within 3 s" in result.stderr.strip().splitlines()[-1]


SAMPLER_WORKER = r"""
import json, os, sys, time
import torch
import hora.torch as hvd

out, count = sys.argv[1], int(sys.argv[2])
slot = f"{os.environ['HORA_HOSTNAME']}[{os.environ['HORA_LOCAL_RANK']}]"
with open(os.path.join(out, "pid-" + slot), "w") as f:
    f.write(str(os.getpid()))
hvd.init()
sampler = hvd.elastic.ElasticSampler(list(range(count)), shuffle=True, seed=7)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, seen=[])
BATCH = 2

@hvd.elastic.run
def train(state):
    mine = list(state.sampler)
    for batch_idx, start in enumerate(range(0, len(mine), BATCH)):
        # Every rank adds what every rank processed: state.seen is the same everywhere.
        state.seen = state.seen + [i for chunk in hvd.allgather_object(mine[start:start + BATCH]) for i in chunk]
        state.sampler.record_batch(batch_idx, BATCH)
        state.commit()
        if hvd.rank() == 0:
            with open(os.path.join(out, "log"), "a") as f:
                f.write(json.dumps({"size": hvd.size(), "seen": len(state.seen)}) + "\n")
        time.sleep(0.05)
    return state.seen

seen = train(state)
if hvd.rank() == 0:
    with open(os.path.join(out, "seen.json"), "w") as f:
        json.dump({"seen": seen, "size": hvd.size()}, f)
"""


def test_elastic_sampler_processes_every_sample_once_across_two_resizes(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, ["localhost", "127.0.0.1", "127.0.0.2", "127.0.0.3"])
    (tmp_path / "worker.py").write_text(SAMPLER_WORKER)
    count = 600

    def shrink_then_grow(job: ElasticJob) -> None:
        job.wait_for(lambda rows: len(rows) >= 5)
        job.kill("127.0.0.2[0]")
        job.wait_for(lambda rows: rows[-1]["size"] == 3)
        job.set_hosts(["localhost", "127.0.0.1", "127.0.0.3", "127.0.0.4"])

    result = job.run("-np", "4", "--min-np", "2", steps=count, during=shrink_then_grow)
    assert result.returncode == 0, result.stderr[-3000:]
    sizes = [row["size"] for row in job.rows()]
    assert [size for index, size in enumerate(sizes) if index == 0 or size != sizes[index - 1]] == [4, 3, 4]
    final = json.loads((tmp_path / "seen.json").read_text())
    seen = final["seen"]
    assert set(seen) == set(range(count)), f"skipped: {sorted(set(range(count)) - set(seen))[:20]}"
    # Only the epoch's last batch may repeat samples: the padding that gives every rank as
    # many (it can sit anywhere in that batch: each rank pads its own share).
    last_batch = seen[-final["size"] * 2 :]
    repeated = {index: times for index, times in Counter(seen).items() if times > 1}
    assert all(times == 2 and index in last_batch for index, times in repeated.items()), repeated
    assert len(seen) - count == len(repeated) < final["size"] * 2


SHARDED_WORKER = r"""
import json, os, sys, time
import torch
import hora.torch as hvd

out, steps, stage, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
slot = f"{os.environ['HORA_HOSTNAME']}[{os.environ['HORA_LOCAL_RANK']}]"
with open(os.path.join(out, "pid-" + slot), "w") as f:
    f.write(str(os.getpid()))
hvd.init()


def model_and_optimizer(sharded):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    optimizer = (torch.optim.Adam if kind == "adam" else torch.optim.Adafactor)(model.parameters(), lr=0.05)
    if sharded:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             shard_optimizer_state=stage)
    return model, optimizer


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(12, 7, generator=g), torch.randn(12, 3, generator=g)


model, optimizer = model_and_optimizer(True)
state = hvd.elastic.TorchState(model, optimizer, step=0)


@hvd.elastic.run
def train(state):
    while state.step < steps:
        # Every rank takes the whole batch: the average gradient is the same in every world,
        # so the weights must follow one process's Adam whatever the world's size.
        x, y = batch(state.step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        state.step += 1
        state.commit()
        if hvd.rank() == 0:
            with open(os.path.join(out, "log"), "a") as f:
                f.write(json.dumps({"step": state.step, "size": hvd.size()}) + "\n")
        time.sleep(0.05)


train(state)
reference, plain = model_and_optimizer(False)
for step in range(steps):
    x, y = batch(step)
    plain.zero_grad()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    plain.step()
gap = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), reference.parameters()))
optimizer.consolidate_state_dict(to=0)
if hvd.rank() == 0:
    full, want = optimizer.state_dict()["state"], plain.state_dict()["state"]
    assert full.keys() == want.keys()
    state_gap = max(float((full[i][key] - value).abs().max()) for i in want for key, value in want[i].items()
                    if isinstance(value, torch.Tensor) and value.numel())
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"gap": gap, "state_gap": state_gap, "size": hvd.size()}, f)
"""


@pytest.mark.parametrize("stage, kind", [(1, "adam"), (2, "adam"), (2, "adafactor")])
def test_a_sharded_optimizer_is_resharded_whenever_the_world_changes(tmp_path: Path, stage: int, kind: str) -> None:
    """A killed worker takes its shard of the Adam state with it; the commit's full copy
    reshards it over the survivors, again over the grown world, and over the shrunk one
    when a host is only removed (no sync then): the weights and the state end as one
    process's optimizer on the same batches (Adam: slices of every parameter per rank;
    Adafactor: whole parameters per rank)."""
    job = ElasticJob(tmp_path, ["localhost", "127.0.0.1", "127.0.0.2"])
    (tmp_path / "worker.py").write_text(SHARDED_WORKER)

    def shrink_grow_shrink(job: ElasticJob) -> None:
        job.wait_for(lambda rows: len(rows) >= 5)
        job.kill("127.0.0.2[0]")  # a failure: restore, reset, sync
        job.wait_for(lambda rows: rows[-1]["size"] == 2)
        job.set_hosts(["localhost", "127.0.0.1", "127.0.0.3"])  # added: reset, sync
        job.wait_for(lambda rows: rows[-1]["size"] == 3)
        job.set_hosts(["localhost", "127.0.0.1"])  # only removed: reset without a sync

    command = [PY, "-m", "hora.runner", "-np", "3", "--min-np", "2", "--host-discovery-script", str(job.script),
               PY, str(tmp_path / "worker.py"), str(tmp_path), "300", str(stage), kind]  # fmt: skip
    errors: list[BaseException] = []

    def act() -> None:
        try:
            shrink_grow_shrink(job)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=act, daemon=True)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    thread.start()
    try:
        _, err = process.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        raise AssertionError(f"the job did not end within {RUN_TIMEOUT} s:\n{err[-3000:]}") from None
    thread.join(timeout=30)
    assert not errors, f"{errors[0]!r}\n{err[-3000:]}"
    assert process.returncode == 0, err[-3000:]
    sizes = [row["size"] for row in job.rows()]
    changes = [size for index, size in enumerate(sizes) if index == 0 or size != sizes[index - 1]]
    assert changes == [3, 2, 3, 2], f"{changes}\n{err[-4000:]}"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["size"] == 2
    assert result["gap"] < 1e-5 and result["state_gap"] < 1e-6, result


def test_fixed_hosts_make_an_elastic_job_that_survives_a_killed_worker(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, [])
    command = [PY, "-m", "hora.runner", "-np", "3", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1,127.0.0.2:1",
               PY, str(tmp_path / "worker.py"), str(tmp_path), "60", "0.05"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        job.wait_for(lambda rows: len(rows) >= 5)
        job.kill("127.0.0.1[0]")
        out, err = process.communicate(timeout=RUN_TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err[-3000:]
    assert check_committed_steps(job.rows(), 60) == [3, 2]
    assert "elastic world 1: 2 ranks on localhost, 127.0.0.2" in err


def test_killing_horarun_stops_every_worker(tmp_path: Path) -> None:
    job = ElasticJob(tmp_path, ["localhost", "127.0.0.1"])
    command = [PY, "-m", "hora.runner", "-np", "2", "--host-discovery-script", str(job.script),
               PY, str(tmp_path / "worker.py"), str(tmp_path), "100000", "0.05"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        job.wait_for(lambda rows: len(rows) >= 3)
    finally:
        process.kill()  # SIGKILL: no chance to stop its workers itself
        process.wait()
    pids = [int((tmp_path / f"pid-{slot}").read_text()) for slot in ("localhost[0]", "127.0.0.1[0]")]
    end = time.monotonic() + 30
    while time.monotonic() < end and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "a worker outlived horarun"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
