"""``ElasticRayExecutor``: Horovod's elastic Ray executor, deprecated there since 0.25.

Horovod 0.28 still ships it (its examples/ray programs use it); its successor is
``RayExecutor(min_workers=...)``, which this class drives: the same elastic job
(``hora.ray.elastic``), with Horovod's older spellings (``create_settings(min_num_proc=...)``,
``cpus_per_slot``, ``env_vars``) and its ``run(worker_fn)``, whose function takes no
arguments.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from hora.ray.executor import RayExecutor
from hora.ray.settings import ElasticRaySettings, create_settings


class ElasticRayExecutor:
    """Runs an elastic hora job on a Ray cluster (Horovod's ``horovod.ray.ElasticRayExecutor``).

    Args:
        settings: from ``ElasticRayExecutor.create_settings``; its ``discovery`` is the
            source of slots with ``override_discovery=False``.
        use_gpu: reserve GPUs for each worker.
        cpus_per_slot: CPUs Ray reserves for each worker.
        gpus_per_slot: GPUs per worker with ``use_gpu`` (default 1).
        env_vars: variables set in every worker before anything runs there.
        override_discovery: find the slots from the Ray cluster's alive nodes
            (``RayHostDiscovery``, which then becomes ``settings.discovery``).

    Raises:
        ValueError: ``gpus_per_slot`` without ``use_gpu``, or below 1 (Horovod's checks).
    """

    def __init__(
        self,
        settings: ElasticRaySettings,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: float | None = None,
        env_vars: Mapping[str, Any] | None = None,
        override_discovery: bool = True,
    ) -> None:
        if gpus_per_slot and not use_gpu:
            raise ValueError(
                "gpus_per_slot is set, but use_gpu is False. use_gpu must be True if gpus_per_slot is set."
            )
        gpus_per_slot = gpus_per_slot or int(use_gpu)
        if use_gpu and gpus_per_slot < 1:
            raise ValueError(f"gpus_per_slot must be >= 1: Got {gpus_per_slot}.")
        if override_discovery:
            from hora.ray.elastic import RayHostDiscovery

            settings.discovery = RayHostDiscovery(use_gpu, cpus_per_slot, gpus_per_slot or 1)
        self.settings = settings
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot
        self.env_vars = dict(env_vars or {})
        self._executor = RayExecutor(
            settings,
            cpus_per_worker=cpus_per_slot,
            use_gpu=use_gpu,
            gpus_per_worker=gpus_per_slot or None,
            min_workers=settings.min_num_proc,
            max_workers=settings.max_num_proc,
            reset_limit=settings.reset_limit,
            cooldown_range=settings.cooldown_range,
            elastic_timeout=settings.elastic_timeout,
            override_discovery=False,  # settings.discovery: ours above, or the caller's (None: Ray's nodes)
        )

    @staticmethod
    def create_settings(
        min_num_proc: int = 1,
        max_num_proc: int | None = None,
        reset_limit: int | None = None,
        elastic_timeout: int = 600,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        nics: Collection[str] | None = None,
        min_np: int | None = None,
        max_np: int | None = None,
        verbose: int | bool = 1,
        cooldown_range: Sequence[int] | None = None,
    ) -> ElasticRaySettings:
        """Makes the settings of an elastic Ray job (Horovod's signature).

        Args:
            min_num_proc: the fewest ranks the job runs with.
            max_num_proc: the most ranks (default: every slot).
            reset_limit: the most resets before the job stops (default: none).
            elastic_timeout: seconds to wait for ``min_num_proc`` slots, and for every
                rank to reset once one did.
            timeout_s: seconds the ranks wait for each other at ``hvd.init()``.
            ssh_identity_file: accepted for Horovod compatibility; Ray starts the ranks.
            nics: network interfaces the ranks may use.
            min_np: deprecated: ``min_num_proc``.
            max_np: deprecated: ``max_num_proc``.
            verbose: 1 or more prints each new world; 2 or more also where ranks landed.
            cooldown_range: ``(MIN, MAX)`` seconds a failed host stays blacklisted.

        Returns:
            The settings; ``discovery`` is set when the executor is made.

        Raises:
            ValueError: a timeout is not positive.
        """
        if min_np is not None:
            min_num_proc = min_np
            warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning, 2)
        if max_np is not None:
            max_num_proc = max_np
            warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, 2)
        base = create_settings(timeout_s=timeout_s, ssh_identity_file=ssh_identity_file, nics=nics)
        return ElasticRaySettings(
            timeout_s=base.timeout_s,
            placement_group_timeout_s=base.placement_group_timeout_s,
            nics=base.nics,
            ssh_identity_file=base.ssh_identity_file,
            verbose=int(verbose),
            min_num_proc=min_num_proc,
            max_num_proc=max_num_proc,
            reset_limit=reset_limit,
            elastic_timeout=elastic_timeout,
            cooldown_range=None if cooldown_range is None else (int(cooldown_range[0]), int(cooldown_range[1])),
            num_proc=min_num_proc,
        )

    def start(self) -> None:
        """Starts the job: waits for ``min_num_proc`` slots.

        Raises:
            RuntimeError: Ray is not initialized, or the executor was started already.
        """
        self._executor.start(extra_env_vars=self.env_vars)

    def run(self, worker_fn: Callable[[], Any], callbacks: Sequence[Callable[[Any], None]] | None = None) -> list[Any]:
        """Calls ``worker_fn()`` on every worker of the elastic job until it ends.

        Args:
            worker_fn: the function (it uses ``hvd.elastic.run`` and a state).
            callbacks: each is called on the driver with every value a worker logs with
                ``hora.ray.ray_logger.log``.

        Returns:
            The values of the last world's ranks, by rank.

        Raises:
            WorkerError: every worker of a world failed.
            RuntimeError: the job could not go on (too few slots in time, the reset
                limit).
        """
        return self._executor.run(worker_fn, callbacks=callbacks)

    def shutdown(self) -> None:
        """Stops every worker; safe to call twice (Horovod's executor has no such call)."""
        self._executor.shutdown()
