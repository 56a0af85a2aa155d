"""Where a Ray job's workers go: a placement group and one bundle per worker (Horovod's strategies).

* ``num_workers`` (or a current placement group, with ``use_current_placement_group``):
  a placement group of one bundle per worker, packed (``PACK``) onto as few nodes as
  fit; inside a current placement group (a Ray Tune trial, say) the workers take its
  bundles in order, wrapping around when it has fewer.
* ``num_hosts`` x ``num_workers_per_host``: one bundle per host holding all its workers,
  on distinct nodes (``STRICT_SPREAD``), so every host runs the same number of ranks.

Creating the group waits at most ``placement_group_timeout_s``; a group that cannot be
placed in time is removed and the error lists what was asked and what is free.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclasses.dataclass
class Placement:
    """A job's placement group and the bundle of each worker.

    Attributes:
        group: the placement group.
        bundles: the bundle index of each worker, in creation order.
        owned: the executor created the group (and removes it at shutdown).
        cpus: CPUs per worker.
        gpus: GPUs per worker (0 without ``use_gpu``).
    """

    group: PlacementGroup
    bundles: list[int]
    owned: bool
    cpus: float
    gpus: float

    def actor_options(self, index: int) -> dict[str, Any]:
        """Ray actor options that put worker ``index`` into its bundle."""
        return {
            "num_cpus": self.cpus,
            "num_gpus": self.gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.bundles[index], placement_group_capture_child_tasks=False
            ),
        }

    def remove(self) -> None:
        """Removes the group if the executor created it."""
        if self.owned:
            remove_placement_group(self.group)


def place(
    num_workers: int | None,
    num_hosts: int | None,
    num_workers_per_host: int,
    cpus: float,
    gpus: float,
    use_current: bool,
    timeout: float,
) -> Placement:
    """Creates (or takes over) the placement group of a job that is not elastic.

    Args:
        num_workers: the number of workers, or None with ``num_hosts``.
        num_hosts: the number of hosts, or None with ``num_workers``.
        num_workers_per_host: workers per host with ``num_hosts``.
        cpus: CPUs per worker.
        gpus: GPUs per worker.
        use_current: take the placement group this code runs in, if any.
        timeout: seconds to wait for a new group to be placed.

    Returns:
        The placement.

    Raises:
        TimeoutError: the group could not be placed in time (it is removed).
    """
    current = get_current_placement_group() if use_current else None
    if current is not None:
        count = num_workers if num_workers is not None else num_workers_per_host * (num_hosts or 1)
        size = len(current.bundle_specs)
        return Placement(current, [index % size for index in range(count)], False, cpus, gpus)
    per_worker = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    if num_workers is not None:
        bundles = [dict(per_worker) for _ in range(num_workers)]
        group = _create(bundles, "PACK", timeout)
        return Placement(group, list(range(num_workers)), True, cpus, gpus)
    assert num_hosts is not None  # the executor checked that one of them is given
    per_host = {name: amount * num_workers_per_host for name, amount in per_worker.items()}
    group = _create([dict(per_host) for _ in range(num_hosts)], "STRICT_SPREAD", timeout)
    indexes = [host for host in range(num_hosts) for _ in range(num_workers_per_host)]
    return Placement(group, indexes, True, cpus, gpus)


def _create(bundles: list[dict[str, float]], strategy: str, timeout: float) -> PlacementGroup:
    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(group)
        free = ray.available_resources()  # type: ignore[no-untyped-call]  # untyped in Ray
        raise TimeoutError(
            f"hora.ray: Ray could not place the workers ({len(bundles)} bundles of {bundles[0]}, {strategy}) "
            f"within {timeout:g} s (placement_group_timeout_s); free resources: {free}. "
            "Make sure the cluster has enough resources, or use an autoscaling cluster"
        )
    return group  # type: ignore[no-any-return]  # placement_group() is untyped in Ray
