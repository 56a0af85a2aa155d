"""Horovod's Ray integration for hora: ``RayExecutor``, and a Ray Train trainer.

``import hora.ray`` needs Ray (``pip install "ray[default,train]"``). The executor runs
each rank as a Ray actor; the function it runs calls ``hvd.init()`` (``import
hora.torch as hvd``, or any binding), which finds the job's rendezvous server in the
executor's process through the environment the executor gave the actor::

    import ray
    from hora.ray import RayExecutor

    ray.init()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    executor.start()
    print(executor.run(train))   # one value per rank
    executor.shutdown()

``HoraTrainer`` and ``HoraConfig`` (Ray Train) are imported on first use, so that
``import hora.ray`` does not import Ray Train; so are ``ElasticRayExecutor`` (Horovod's
older elastic executor) and ``RayHostDiscovery``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hora.ray.executor import RayExecutor
from hora.ray.outcome import WorkerError
from hora.ray.settings import RaySettings, create_settings
from hora.ray.worker import BaseHoraWorker

if TYPE_CHECKING:
    from hora.ray.elastic import RayHostDiscovery
    from hora.ray.elastic_executor import ElasticRayExecutor
    from hora.ray.train import HoraConfig, HoraTrainer

BaseHorovodWorker = BaseHoraWorker
"""Horovod's name for the worker class."""

__all__ = [
    "BaseHoraWorker",
    "BaseHorovodWorker",
    "ElasticRayExecutor",
    "HoraConfig",
    "HoraTrainer",
    "RayExecutor",
    "RayHostDiscovery",
    "RaySettings",
    "WorkerError",
    "create_settings",
]

_LAZY = {
    "ElasticRayExecutor": "hora.ray.elastic_executor",
    "HoraConfig": "hora.ray.train",
    "HoraTrainer": "hora.ray.train",
    "RayHostDiscovery": "hora.ray.elastic",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hora.ray' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
