"""The settings of a Ray job, as ``RayExecutor.create_settings`` makes them (Horovod's ``MiniSettings``).

Horovod passes a small settings object to its Ray executor; hora keeps the same
fields and defaults. Over Ray no rank is started over ssh (Ray starts the
actors), so the ssh fields are accepted for compatibility and only ``ssh_str`` has
an effect: as in Horovod, it is written to ``ssh_identity_file`` (mode 0600) when
that file does not exist yet.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection
from typing import Any


@dataclasses.dataclass
class RaySettings:
    """What a ``RayExecutor`` needs besides its worker counts.

    Attributes:
        timeout_s: seconds the ranks wait for each other when ``hvd.init()`` forms
            the job (``HORA_START_TIMEOUT``).
        placement_group_timeout_s: seconds to wait for Ray to place the workers'
            placement group before failing.
        nics: network interfaces the ranks may use (``HORA_IFACE``); None lets each
            rank choose.
        ssh_identity_file: accepted for Horovod compatibility; Ray starts the ranks.
        ssh_port: accepted for Horovod compatibility.
        verbose: 2 or more prints where the ranks landed; an elastic job at 1 or more
            prints each new world.
        elastic: set by the executor: whether the job is elastic.
        discovery: an elastic job's source of slots when the executor is made with
            ``override_discovery=False``: any object with Horovod's
            ``find_available_hosts_and_slots() -> {host: slots}``, the hosts named by
            Ray node (``hora.ray.topology.node_label``).
    """

    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0
    nics: Collection[str] | None = None
    ssh_identity_file: str | None = None
    ssh_port: int | None = None
    verbose: int = 1
    elastic: bool = False
    discovery: Any = None

    def validate(self) -> None:
        """Checks the values.

        Raises:
            ValueError: a timeout that is not a positive number, naming the field.
        """
        for name in ("timeout_s", "placement_group_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"RaySettings.{name}={value!r} is not valid: expected a number of seconds > 0")


def create_settings(
    timeout_s: float = 30,
    ssh_identity_file: str | None = None,
    ssh_str: str | None = None,
    placement_group_timeout_s: float = 100,
    nics: Collection[str] | None = None,
) -> RaySettings:
    """Makes the settings of a Ray job (``RayExecutor.create_settings``, Horovod's signature).

    Args:
        timeout_s: seconds the ranks wait for each other at ``hvd.init()``.
        ssh_identity_file: path of an ssh private key file (kept for compatibility).
        ssh_str: the private key's contents, written to ``ssh_identity_file`` if that
            file does not exist (Horovod's behaviour; handle with care).
        placement_group_timeout_s: seconds to wait for the workers' placement group.
        nics: network interfaces the ranks may use.

    Returns:
        The settings, checked.

    Raises:
        ValueError: a timeout is not positive, or ``ssh_str`` is given without
            ``ssh_identity_file``.
    """
    if ssh_str:
        if not ssh_identity_file:
            raise ValueError("create_settings: ssh_str is given without ssh_identity_file to write it to")
        if not os.path.exists(ssh_identity_file):
            # Created with 0600 from the start, so the key is never readable by others.
            descriptor = os.open(ssh_identity_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                handle.write(ssh_str)
    settings = RaySettings(
        timeout_s=timeout_s,
        placement_group_timeout_s=placement_group_timeout_s,
        nics=None if nics is None else frozenset(nics),
        ssh_identity_file=ssh_identity_file,
    )
    settings.validate()
    return settings


@dataclasses.dataclass
class ElasticRaySettings(RaySettings):
    """What ``ElasticRayExecutor.create_settings`` makes (Horovod's ``ElasticSettings``).

    Attributes:
        min_num_proc: the fewest ranks the job runs with.
        max_num_proc: the most ranks; None: every slot discovered.
        reset_limit: the most resets before the job stops; None: no limit.
        elastic_timeout: seconds to wait for ``min_num_proc`` slots, and for every rank
            to reset once one did.
        cooldown_range: ``(MIN, MAX)`` seconds a failed host stays blacklisted; None:
            for good.
        num_proc: the ranks to start with (Horovod sets ``min_num_proc``; the job
            then takes every slot up to ``max_num_proc``).
    """

    min_num_proc: int = 1
    max_num_proc: int | None = None
    reset_limit: int | None = None
    elastic_timeout: int = 600
    cooldown_range: tuple[int, int] | None = None
    num_proc: int = 1
