"""Ray Train entry point: ``HoraTrainer`` runs a hora training loop on Ray Train's workers.

Ray 2.60 runs Ray Train "V2" by default (``RAY_TRAIN_V2_ENABLED``, default on), whose
``ray.train.v2.api.data_parallel_trainer.DataParallelTrainer`` takes any
``ray.train.backend.BackendConfig``; its backend's ``on_start`` runs once the worker
group is up, before the training function. ``HoraConfig`` is that config and
``_HoraBackend`` sets hora's job up, as ``RayExecutor`` does: it asks every worker for
its node, computes the topology for Ray Train's ranks (grouped by node), starts the
job's rendezvous server in the process that runs the backend (Ray Train's controller)
with a fresh secret, and gives every worker its rank's ``HORA_*`` environment. The
training function then calls ``hvd.init()`` and reports with ``ray.train.report``
(every rank calls it; checkpoints from rank 0).

Ray Train's ``HorovodTrainer`` is deprecated in V2 (it raises); this is hora's.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import ray
from ray.train.backend import Backend, BackendConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from hora.ray.topology import slots_in_order
from hora.ray.worker import node_ip_address
from hora.runner.placement import ANY, LOOPBACK
from hora.runner.rendezvous import RendezvousServer
from hora.runner.settings import LaunchSettings, rank_env
from hora.transport import auth


@dataclasses.dataclass
class HoraConfig(BackendConfig):
    """How ``HoraTrainer`` sets up hora on Ray Train's workers.

    Attributes:
        timeout_s: seconds the ranks wait for each other at ``hvd.init()``.
        nics: network interfaces the ranks may use (``HORA_IFACE``); None: any.
        env: more variables for every worker (e.g. hora's knobs).
    """

    timeout_s: float = 30.0
    nics: frozenset[str] | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def backend_cls(self) -> type[Backend]:
        return _HoraBackend

    def to_dict(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s, "nics": sorted(self.nics) if self.nics else None}


def _node() -> tuple[str, str]:
    return ray.get_runtime_context().get_node_id(), node_ip_address()


def _set_env(env: Mapping[str, str]) -> None:
    os.environ.update(env)


def _shutdown_hora() -> None:
    """Ends the worker's hora runtime if its training function left it running."""
    import sys

    api = sys.modules.get("hora.core.api")  # never imported here if the function did not
    if api is not None:
        api.shutdown()


class _HoraBackend(Backend):
    """Starts the rendezvous server and sets every worker's hora environment."""

    share_cuda_visible_devices: bool = True

    def __init__(self) -> None:
        self._servers: dict[int, RendezvousServer] = {}  # by id(worker group)

    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, HoraConfig)  # HoraConfig.backend_cls names this class
        nodes = worker_group.execute(_node)
        slots = slots_in_order([node_id for node_id, _ in nodes])
        here = node_ip_address()
        local = {ip for _, ip in nodes} == {here}
        secret = auth.new_secret()
        server = RendezvousServer(secret, host=LOOPBACK if local else ANY).start()
        self._servers[id(worker_group)] = server
        launch = LaunchSettings(
            command=("ray-train",),
            num_proc=len(slots),
            start_timeout=float(backend_config.timeout_s),
            network_interfaces=",".join(sorted(backend_config.nics)) if backend_config.nics else None,
            env=dict(backend_config.env),
        )
        address = LOOPBACK if local else here
        endpoint = (address, server.port)
        ray.get([
            worker_group.execute_single_async(slot.rank, _set_env, rank_env({}, launch, slot, endpoint, secret))
            for slot in slots
        ])  # fmt: skip

    def on_shutdown(self, worker_group: Any, backend_config: BackendConfig) -> None:
        try:
            worker_group.execute(_shutdown_hora)
        finally:
            server = self._servers.pop(id(worker_group), None)
            if server is not None:
                server.stop()


class HoraTrainer(DataParallelTrainer):
    """A Ray Train trainer for hora training loops (``import hora.torch as hvd``).

    Args:
        train_loop_per_worker: the training function, run on every worker; it calls
            ``hvd.init()`` and ``ray.train.report(...)``. Takes ``train_loop_config``
            as its argument if it has one.
        train_loop_config: the function's argument.
        hora_config: hora's setup (default ``HoraConfig()``).
        scaling_config: Ray Train's ``ScalingConfig`` (number of workers, resources).
        run_config: Ray Train's ``RunConfig`` (name, storage, failure handling).
        datasets: Ray Datasets for ``ray.train.get_dataset_shard``.
        dataset_config: Ray Train's ``DataConfig``.
        metadata: passed on to Ray Train.
        resume_from_checkpoint: passed on to Ray Train.

    Example::

        trainer = HoraTrainer(train_func, scaling_config=ScalingConfig(num_workers=2))
        result = trainer.fit()          # result.metrics: rank 0's last report
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        hora_config: HoraConfig | None = None,
        scaling_config: Any = None,
        run_config: Any = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: Any = None,
        metadata: dict[str, Any] | None = None,
        resume_from_checkpoint: Any = None,
    ) -> None:
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=hora_config or HoraConfig(),
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            metadata=metadata,
            resume_from_checkpoint=resume_from_checkpoint,
        )
