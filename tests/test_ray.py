"""hora.ray: RayExecutor (fixed and elastic), the Ray Train trainer, and the Ray example.

One Ray cluster serves the whole module: a head and a second node on this machine
(``ray.cluster_utils.Cluster``), small object stores, no
dashboard. The module's fixed executor keeps 1 CPU on each node, so each node has 3
(the elastic test's workers take 2). The functions the workers run are defined here and sent by value (the
workers cannot import this test module).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from hora.ray import RayExecutor, WorkerError  # noqa: E402
from hora.ray.topology import grouped_slots, node_label, slots_in_order  # noqa: E402

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parent.parent
STORE = 150 * 1024 * 1024  # bytes of object store per node
# Ray Train V2's watchers poll the state API, which needs the dashboard; off for the test.
TRAIN_ENV = {
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
}


@pytest.fixture(scope="module")
def ray_cluster() -> Generator[Any, None, None]:
    """A 2-node local Ray cluster for the module; shut down at its end."""
    from ray import cloudpickle
    from ray.cluster_utils import Cluster

    saved = {name: os.environ.get(name) for name in TRAIN_ENV}
    os.environ.update(TRAIN_ENV)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 3, "object_store_memory": STORE, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=3, object_store_memory=STORE)
    ray.init(address=cluster.address, log_to_driver=True)
    cluster.wait_for_nodes()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield cluster
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()
        cluster.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Tally:
    """An executable: built in every worker, handed to ``execute``'s functions."""

    def __init__(self, start: int) -> None:
        self.count = start

    def bump(self) -> int:
        self.count += 1
        return self.count


@pytest.fixture(scope="module")
def executor(ray_cluster: Any) -> Generator[RayExecutor, None, None]:
    """2 ranks, one on each node (num_hosts=2 places one bundle per node)."""
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_hosts=2, num_workers_per_host=1)
    executor.start(executable_cls=Tally, executable_args=[10])
    try:
        yield executor
    finally:
        executor.shutdown()


def torch_training(steps: int) -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())  # different weights: the broadcast must align them
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(steps):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(100 * step + hvd.rank()))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        optimizer.step()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="total")
    return {
        "topology": (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()),
        "total": total.item(),
        "weights": [round(v, 6) for v in torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()],
        "threads": os.environ.get("OMP_NUM_THREADS"),
    }


@pytest.mark.timeout(180)
def test_run_trains_with_torch_and_runs_again(executor: RayExecutor) -> None:
    results = executor.run(torch_training, args=[5])
    assert [r["topology"] for r in results] == [(0, 2, 0, 1, 0, 2), (1, 2, 0, 1, 1, 2)]
    assert [r["total"] for r in results] == [3.0, 3.0]
    assert results[0]["weights"] == results[1]["weights"]  # averaged gradients keep the ranks in step
    assert [r["threads"] for r in results] == ["1", "1"]
    again = executor.run(torch_training, kwargs={"steps": 1})  # the runtime of the first run is reused
    assert [r["total"] for r in again] == [3.0, 3.0]


@pytest.mark.timeout(120)
def test_execute_execute_single_and_run_remote(executor: RayExecutor) -> None:
    assert executor.execute(lambda tally: tally.bump()) == [11, 11]
    assert executor.execute_single(lambda tally: tally.bump()) == 12
    assert executor.execute(lambda tally: tally.count) == [12, 11]
    refs = executor.run_remote(lambda x: (int(os.environ["HORA_RANK"]), x * 2), args=[21])
    assert ray.get(refs) == [(0, 42), (1, 42)]


def log_epochs() -> int:
    from hora.ray import ray_logger

    rank = int(os.environ["HORA_RANK"])
    for epoch in range(3):
        ray_logger.log({"rank": rank, "epoch": epoch})
    return rank


@pytest.mark.timeout(120)
def test_callbacks_receive_what_the_ranks_log(executor: RayExecutor) -> None:
    seen: list[dict[str, int]] = []
    assert executor.run(log_epochs, callbacks=[seen.append]) == [0, 1]
    # every value reaches the driver before run returns; each rank's in its own order
    for rank in (0, 1):
        assert [item["epoch"] for item in seen if item["rank"] == rank] == [0, 1, 2]
    assert len(seen) == 6
    with pytest.warns(UserWarning, match="no callbacks"):
        from hora.ray import ray_logger

        ray_logger.log({"outside": "a call"})


def raise_on_rank_one() -> None:
    import torch

    import hora.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one gives up")
    hvd.allreduce(torch.ones(3), name="never")  # rank 0 blocks here until rank 1 is gone


def sleep_forever() -> None:
    time.sleep(600)


@pytest.mark.timeout(180)
def test_failing_rank_fails_run_and_the_executor_recovers(executor: RayExecutor) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        executor.run(raise_on_rank_one)
    assert time.monotonic() - start < 60
    error = caught.value
    assert error.rank == 1
    assert isinstance(error.cause, ValueError)
    assert "rank one gives up" in error.traceback
    assert "failed on rank 1 of 2" in str(error) and "rank 0" in str(error)
    with pytest.raises(TimeoutError, match="ranks still running: 0, 1"):
        executor.run(sleep_forever, timeout=3)
    results = executor.run(torch_training, args=[1])  # new actors, a new job
    assert [r["total"] for r in results] == [3.0, 3.0]
    assert executor.execute(lambda tally: tally.count) == [10, 10]  # the executables were rebuilt


def elastic_training(total: int) -> tuple[int, int, list[int]]:
    import signal

    import torch

    import hora.torch as hvd

    hvd.init()
    model = torch.nn.Linear(2, 1)
    state = hvd.elastic.TorchState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), batch=0,
                                   sizes=[])  # fmt: skip

    @hvd.elastic.run
    def loop(state: Any) -> tuple[int, int, list[int]]:
        while state.batch < total:
            if hvd.rank() == 1 and state.batch == 4:
                os.kill(os.getpid(), signal.SIGKILL)  # the actor dies mid-training
            hvd.allreduce(torch.ones(1), name="step")
            state.sizes.append(hvd.size())
            state.batch += 1
            state.commit()
        return state.batch, hvd.size(), list(state.sizes)

    return loop(state)


@pytest.mark.timeout(180)
def test_elastic_survives_a_killed_actor(ray_cluster: Any) -> None:
    # 2 CPUs per worker: one slot per node (3 // 2), so the killed actor's node is blacklisted alone.
    executor = RayExecutor(
        RayExecutor.create_settings(timeout_s=30), min_workers=1, max_workers=2, cpus_per_worker=2, elastic_timeout=60
    )
    executor.start()
    try:
        results = executor.run(elastic_training, args=[8])
    finally:
        executor.shutdown()
    assert len(results) == 1
    batch, size, sizes = results[0]
    assert (batch, size) == (8, 1)
    assert sizes == [2, 2, 2, 2, 1, 1, 1, 1]  # continued from the commit of batch 4, on one rank


@pytest.mark.timeout(180)
def test_horovods_elastic_ray_executor_survives_a_killed_actor(ray_cluster: Any) -> None:
    from hora.ray import ElasticRayExecutor

    with pytest.warns(DeprecationWarning, match="min_np is deprecated"):
        settings = ElasticRayExecutor.create_settings(min_np=1, max_num_proc=2, elastic_timeout=60, verbose=2)
    executor = ElasticRayExecutor(settings, cpus_per_slot=2)  # one slot per node, as above
    executor.start()
    try:
        results = executor.run(lambda: elastic_training(8))  # Horovod's run: a function of no arguments
    finally:
        executor.shutdown()
    assert [(batch, size) for batch, size, _ in results] == [(8, 1)]
    assert results[0][2] == [2, 2, 2, 2, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="use_gpu must be True"):
        ElasticRayExecutor(settings, gpus_per_slot=1)


def test_test_discovery_hides_and_shows_nodes_within_its_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    from hora.ray.elastic import RayHostDiscovery, TestDiscovery

    nodes = {"a": 2, "b": 2, "c": 2, "d": 2}
    monkeypatch.setattr(RayHostDiscovery, "find_available_hosts_and_slots", lambda self: dict(nodes))
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    discovery = TestDiscovery(min_hosts=2, max_hosts=3, change_frequency_s=5, verbose=False)
    discovery._random = random.Random(7)
    assert discovery.find_available_hosts_and_slots() == nodes  # no change before the first period
    clock[0] += 4
    assert discovery.find_available_hosts_and_slots() == nodes
    counts = []
    for _ in range(40):
        clock[0] += 5
        shown = discovery.find_available_hosts_and_slots()
        assert all(nodes[host] == slots for host, slots in shown.items())
        counts.append(len(shown))
    assert counts[0] == 3  # 4 shown is above max_hosts: one is hidden at the first change
    assert set(counts) == {2, 3}  # then it moves within [min_hosts, max_hosts]
    del nodes["a"], nodes["b"]  # nodes that leave the cluster are no longer counted as hidden
    clock[0] += 5
    assert len(discovery.find_available_hosts_and_slots()) >= 1


def train_loop(config: dict[str, Any]) -> None:
    import tempfile

    import ray.train
    import torch

    import hora.torch as hvd

    hvd.init()
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for epoch in range(config["epochs"]):
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(10 * epoch + hvd.rank()))
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        optimizer.step()
        average = hvd.allreduce(loss.detach(), name="loss").item()
        checkpoint = None
        if hvd.rank() == 0 and epoch == config["epochs"] - 1:
            directory = tempfile.mkdtemp()
            torch.save(model.state_dict(), os.path.join(directory, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report({"epoch": epoch, "loss": average, "size": hvd.size()}, checkpoint=checkpoint)


@pytest.mark.timeout(240)
def test_hora_trainer_fits_and_reports(ray_cluster: Any, tmp_path: Path) -> None:
    from ray.train import RunConfig, ScalingConfig

    from hora.ray import HoraTrainer

    trainer = HoraTrainer(
        train_loop,
        train_loop_config={"epochs": 3},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="hora", storage_path=str(tmp_path)),
    )
    result = trainer.fit()
    assert result.error is None
    assert result.metrics["epoch"] == 2 and result.metrics["size"] == 2
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as directory:
        assert os.path.exists(os.path.join(directory, "model.pt"))


@pytest.mark.timeout(240)
def test_ray_digits_example_reaches_95_percent(executor: RayExecutor) -> None:
    from ray import cloudpickle

    spec = importlib.util.spec_from_file_location("hora_ray_digits_example", ROOT / "examples" / "ray" / "digits.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    try:
        results = module.run(num_workers=2, epochs=10, executor=executor)  # its actors have torch loaded
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        del sys.modules[spec.name]
    assert [r["rank"] for r in results] == [0, 1] and results[0]["size"] == 2
    assert results[0]["accuracy"] >= 0.95


def test_ranks_are_grouped_by_node() -> None:
    a, b = "a" * 56, "b" * 56
    order, slots = grouped_slots([a, b, a, b, a])
    assert order == [0, 2, 4, 1, 3]
    assert [(s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        (node_label(a), 0, 3, 0, 2), (node_label(a), 1, 3, 0, 2), (node_label(a), 2, 3, 0, 1),
        (node_label(b), 0, 2, 1, 2), (node_label(b), 1, 2, 1, 2),
    ]  # fmt: skip
    fixed = slots_in_order([a, b, a])  # Ray Train's ranks stay as given
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in fixed] == [
        (0, 0, 2, 0, 2), (1, 0, 1, 1, 2), (2, 1, 2, 0, 1),
    ]  # fmt: skip


def test_constructor_checks_counts() -> None:
    with pytest.raises(ValueError, match="min_workers"):
        RayExecutor(None, max_workers=2)
    with pytest.raises(ValueError, match="both min_workers and num_workers"):
        RayExecutor(None, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="num_workers, or as num_hosts"):
        RayExecutor(None)
    with pytest.raises(ValueError, match="timeout_s"):
        RayExecutor.create_settings(timeout_s=0)


def test_worker_error_reports_the_root_cause_first() -> None:
    from hora.errors import HoraInternalError
    from hora.ray.outcome import Outcome

    def failed(rank: int, error: BaseException, at: float) -> Outcome:
        try:
            raise error
        except BaseException as caught:  # noqa: BLE001 - a traceback to report
            outcome = Outcome.failed(rank, caught)
        outcome.at = at
        return outcome

    peer = failed(0, HoraInternalError("rank 1 was lost"), at=1.0)  # first, but only a consequence
    own = failed(1, KeyError("missing"), at=2.0)
    error = WorkerError("train", 3, [peer, own, Outcome.gone(2, "its Ray actor died")], ["h0", "h1", "h2"])
    assert (error.rank, type(error.cause)) == (1, KeyError)
    assert str(error).startswith("hora.ray: train failed on rank 1 of 3 (on h1): KeyError: 'missing'")
    assert "rank 0 (on h0) then failed too: HoraInternalError" in str(error)
    assert [outcome.rank for outcome in error.failures] == [1, 0, 2]


def test_calls_need_a_started_executor() -> None:
    executor = RayExecutor(None, num_workers=2)
    with pytest.raises(RuntimeError, match="call start"):
        executor.run(lambda: None)
    with pytest.raises(RuntimeError, match="call start"):
        executor.run(lambda: None, callbacks=[print])
    executor.shutdown()  # nothing to stop: fine
