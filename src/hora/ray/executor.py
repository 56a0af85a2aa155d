"""``RayExecutor``: Horovod's Ray executor, running hora ranks as Ray actors.

Without ``min_workers`` the job has a fixed size (``hora.ray.static``): ``start``
places one actor per slot and gives each its rank; ``run``, ``execute``,
``execute_single`` and ``run_remote`` call functions on them, any number of times.
With ``min_workers`` the job is elastic (``hora.ray.elastic``, Horovod's
``ElasticRayExecutor`` semantics): each ``run`` starts actors on the slots the Ray
cluster offers, and when one dies the others continue from their last commit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from hora.ray.placement import place
from hora.runner.run_func import callable_name
from hora.ray.ray_logger import Relay
from hora.ray.settings import RaySettings, create_settings
from hora.ray.static import StaticJob


class _Call:
    """``fn(*args, **kwargs)`` as a function of the worker's executable (picklable by Ray)."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        self.fn = fn
        self.args = tuple(args)
        self.kwargs = dict(kwargs)

    def __call__(self, executable: Any) -> Any:
        return self.fn(*self.args, **self.kwargs)


class RayExecutor:
    """Runs a hora job on a Ray cluster (Horovod's ``horovod.ray.RayExecutor``).

    Args:
        settings: from ``RayExecutor.create_settings``; None takes the defaults.
        num_workers: the number of ranks (one actor each); or give ``num_hosts``.
        num_hosts: the number of nodes, each running ``num_workers_per_host`` ranks
            (its bundle is placed on a node of its own).
        num_workers_per_host: ranks per node with ``num_hosts``.
        cpus_per_worker: CPUs Ray reserves for each actor.
        use_gpu: reserve GPUs for each actor.
        gpus_per_worker: GPUs per actor with ``use_gpu`` (default 1).
        use_current_placement_group: run inside the placement group this code runs
            in (a Ray Tune trial's), if any, instead of creating one.
        min_workers: makes the job elastic: the fewest ranks it runs with.
        max_workers: elastic: the most ranks (default: every slot found).
        reset_limit: elastic: the most resets before the job stops (default: none).
        cooldown_range: elastic: ``(MIN, MAX)`` seconds a failed node stays
            blacklisted (default: for good).
        elastic_timeout: elastic: seconds to wait for ``min_workers`` slots, and for
            every rank to reset once one did.
        override_discovery: elastic: find the slots from the Ray cluster's alive
            nodes (``RayHostDiscovery``); False requires ``discovery=`` in
            ``settings`` (an object with ``find_available_hosts_and_slots()``).

    Raises:
        ValueError: the counts contradict each other (Horovod's checks, plus: exactly
            one of ``num_workers`` and ``num_hosts`` without ``min_workers``).
    """

    def __init__(
        self,
        settings: RaySettings | None = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: Sequence[int] | None = None,
        elastic_timeout: int = 600,
        override_discovery: bool = True,
    ) -> None:
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError("max_workers is given without a positive min_workers: an elastic job needs min_workers")
        if min_workers and num_workers:
            raise ValueError(
                "both min_workers and num_workers are given: a job is either elastic (min_workers) or "
                "of a fixed size (num_workers), not both"
            )
        elastic = min_workers is not None
        if not elastic:
            if (num_workers is None) == (num_hosts is None):
                raise ValueError("give the job's size as num_workers, or as num_hosts (x num_workers_per_host)")
            for label, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                                 ("num_workers_per_host", num_workers_per_host)):  # fmt: skip
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ValueError(f"{label}={value!r} is not valid: expected an integer >= 1")
        if not cpus_per_worker > 0:
            raise ValueError(f"cpus_per_worker={cpus_per_worker!r} is not valid: expected a number > 0")
        self.settings = settings if settings is not None else create_settings()
        self.settings.validate()
        self.settings.elastic = elastic
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.reset_limit = reset_limit
        self.cooldown_range = None if cooldown_range is None else (int(cooldown_range[0]), int(cooldown_range[1]))
        self.elastic_timeout = elastic_timeout
        self.override_discovery = override_discovery
        self._job: StaticJob | None = None
        self._elastic: Any = None  # hora.ray.elastic.ElasticJob, imported only for elastic jobs

    create_settings = staticmethod(create_settings)

    # ----- life cycle -----

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: Sequence[Any] | None = None,
        executable_kwargs: Mapping[str, Any] | None = None,
        extra_env_vars: Mapping[str, Any] | None = None,
    ) -> None:
        """Starts the workers (an elastic job starts its workers at each ``run``).

        Args:
            executable_cls: a class built in every worker (``executable_cls(*args,
                **kwargs)``), which ``execute`` hands to its function.
            executable_args: its positional arguments.
            executable_kwargs: its keyword arguments.
            extra_env_vars: variables set in every worker before anything runs there
                (``OMP_NUM_THREADS=1`` is set unless given here).

        Raises:
            RuntimeError: Ray is not initialized, or the executor was started already.
            TimeoutError: Ray could not place the workers in time.
        """
        if not ray.is_initialized():
            raise RuntimeError("hora.ray: Ray is not initialized: call ray.init() (or ray.init(address=...)) first")
        if self._job is not None or self._elastic is not None:
            raise RuntimeError("hora.ray: this RayExecutor was started already; call shutdown() first")
        executable = (executable_cls, list(executable_args or ()), dict(executable_kwargs or {}))
        if self.settings.elastic:
            from hora.ray.elastic import ElasticJob

            self._elastic = ElasticJob(self, executable, extra_env_vars)
            self._elastic.start()
            return
        placement = place(
            self.num_workers,
            self.num_hosts,
            self.num_workers_per_host,
            self.cpus_per_worker,
            self.gpus_per_worker,
            self.use_current_placement_group,
            self.settings.placement_group_timeout_s,
        )
        job = StaticJob(self.settings, placement, extra_env_vars, executable)
        try:
            job.start()
        except BaseException:
            placement.remove()
            raise
        self._job = job

    def shutdown(self) -> None:
        """Stops every worker and frees what the executor holds; safe to call twice."""
        job, self._job = self._job, None
        if job is not None:
            job.shutdown()
        elastic, self._elastic = self._elastic, None
        if elastic is not None:
            elastic.shutdown()

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _static(self, method: str) -> StaticJob:
        if self._elastic is not None:
            raise NotImplementedError(f"hora.ray: {method} is not available in an elastic job: use run()")
        if self._job is None:
            raise RuntimeError(f"hora.ray: {method} needs a started executor: call start() first")
        return self._job

    # ----- calls -----

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        callbacks: Sequence[Callable[[Any], None]] | None = None,
        *,
        timeout: float | None = None,
    ) -> list[Any]:
        """Calls ``fn(*args, **kwargs)`` on every rank and returns the values by rank.

        Args:
            fn: the function; it calls ``hvd.init()`` to join the job.
            args: its positional arguments.
            kwargs: its keyword arguments.
            callbacks: each is called on the driver with every value a rank sends
                with ``hora.ray.ray_logger.log`` while the call runs.
            timeout: seconds after which the ranks are stopped; None: no limit.

        Returns:
            The values, by rank (an elastic job: the ranks of its last world).

        Raises:
            WorkerError: a rank raised; names it and carries its traceback.
            TimeoutError: ``timeout`` passed.
            RuntimeError: the executor is not started, or an elastic job failed.
        """
        return self._call(_Call(fn, args or (), kwargs or {}), callable_name(fn), callbacks, timeout)

    def execute(
        self,
        fn: Callable[[Any], Any],
        callbacks: Sequence[Callable[[Any], None]] | None = None,
        *,
        timeout: float | None = None,
    ) -> list[Any]:
        """Calls ``fn(executable)`` on every rank; returns the values by rank.

        Args:
            fn: the function, given the worker's executable (None without one).
            callbacks: as ``run``'s.
            timeout: seconds after which the ranks are stopped; None: no limit.

        Raises:
            WorkerError: a rank raised.
            TimeoutError: ``timeout`` passed.
        """
        return self._call(fn, callable_name(fn), callbacks, timeout, "execute")

    def _call(
        self,
        func: Callable[[Any], Any],
        name: str,
        callbacks: Sequence[Callable[[Any], Any]] | None,
        timeout: float | None,
        method: str = "run",
    ) -> list[Any]:
        """Calls ``func(executable)`` on every rank, relaying logged values to ``callbacks``."""
        on_ranks = self._elastic.run if self._elastic is not None else self._static(method).call
        if not callbacks:
            return list(on_ranks(func, name, timeout))
        with Relay(callbacks) as relay:
            return list(on_ranks(relay.wrap(func), name, timeout))

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Calls ``fn(executable)`` on rank 0 only and returns its value.

        Raises:
            ray.exceptions.RayTaskError: the function raised (Ray's error, carrying it).
        """
        return ray.get(self._static("execute_single").workers[0].execute.remote(fn))

    def run_remote(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[ray.ObjectRef[Any]]:
        """Starts ``fn(*args, **kwargs)`` on every rank without waiting.

        Returns:
            One ObjectRef per rank, by rank: ``ray.get`` them for the values.
        """
        return self._static("run_remote").call_async(_Call(fn, args or (), kwargs or {}))

    @property
    def workers(self) -> list[Any]:
        """The actors, by rank (a job of a fixed size, once started)."""
        return self._static("workers").workers
