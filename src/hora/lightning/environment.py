"""HoraEnvironment: Lightning's view of a job that a hora launcher started.

Lightning asks a ``ClusterEnvironment`` where the current process sits (global rank,
local rank, node, world size) and whether it must start the other processes itself.
Under hora the launcher (``horarun``, ``hora.run``, mpirun, srun, torchrun, a
Kubernetes operator: whatever ``hvd.init()`` understands) has already started every
rank, so this environment never asks Lightning to spawn anything, and it takes the
topology from ``hvd.init()`` instead of reading launcher variables itself: whatever
launcher hora supports, Lightning sees the same ranks hora does.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from typing_extensions import override

import hora.torch as hvd
from hora.config import knobs

log = logging.getLogger(__name__)



def _read(name: str) -> Any:
    """A launcher variable through hora's knobs (Horovod's alias too); None when unset or
    not valid (the environment only informs Lightning here: ``hvd.init()`` checks it)."""
    try:
        return knobs.read(name, os.environ, None)
    except ValueError:
        return None


class HoraEnvironment(ClusterEnvironment):
    """The cluster environment of a job started by a hora launcher.

    Creating it calls ``hvd.init()`` (which returns at once when hora already runs),
    so the topology is known before Lightning asks for it. Ranks come from hora:
    ``global_rank()`` is ``hvd.rank()``, ``world_size()`` is ``hvd.size()``,
    ``local_rank()`` is ``hvd.local_rank()`` and ``node_rank()`` is
    ``hvd.cross_rank()`` (the index of this rank's host, as Horovod numbers hosts).

    Raises:
        ValueError: from ``hvd.init()``, when the launcher's configuration is wrong.
        HoraInternalError: from ``hvd.init()``, when the other ranks cannot be reached.
    """

    def __init__(self) -> None:
        hvd.init()

    @property
    @override
    def creates_processes_externally(self) -> bool:
        """Always True: the launcher started every rank, Lightning must not spawn any."""
        return True

    @property
    @override
    def main_address(self) -> str:
        """The address where hora's ranks met (its rendezvous), for Lightning's information.

        hora does not use ``torch.distributed``, so Lightning never connects to it
        through this address; it is reported as the launcher gave it.
        """
        address = _read("HORA_RENDEZVOUS_ADDR")
        return str(address) if address else os.environ.get("MASTER_ADDR") or "127.0.0.1"

    @property
    @override
    def main_port(self) -> int:
        """The rendezvous port the launcher gave (0 when it gave none); informational, as ``main_address``."""
        port = _read("HORA_RENDEZVOUS_PORT")
        if port is not None:
            return int(port)
        try:
            return int(os.environ.get("MASTER_PORT") or 0)
        except ValueError:
            return 0

    @staticmethod
    @override
    def detect() -> bool:
        """Whether this process runs under a hora launcher or hora already runs in it.

        Returns:
            True when ``horarun``/``hora.run`` started the process (``HORA_RANK`` or
            ``HOROVOD_RANK`` is set) or ``hvd.init()`` has been called.
        """
        return hvd.is_initialized() or _read("HORA_RANK") is not None

    @override
    def world_size(self) -> int:
        """The number of ranks in the job (``hvd.size()``)."""
        return hvd.size()

    @override
    def set_world_size(self, size: int) -> None:
        """Ignored: the launcher fixed the number of ranks (logged when Lightning asks for another)."""
        if size != hvd.size():
            log.debug("HoraEnvironment.set_world_size(%d) ignored: the job has %d ranks", size, hvd.size())

    @override
    def global_rank(self) -> int:
        """This process's rank in the job (``hvd.rank()``)."""
        return hvd.rank()

    @override
    def set_global_rank(self, rank: int) -> None:
        """Ignored: the launcher fixed every rank (logged when Lightning asks for another)."""
        if rank != hvd.rank():
            log.debug("HoraEnvironment.set_global_rank(%d) ignored: this is rank %d", rank, hvd.rank())

    @override
    def local_rank(self) -> int:
        """This process's rank among the ranks on its host (``hvd.local_rank()``)."""
        return hvd.local_rank()

    @override
    def node_rank(self) -> int:
        """The index of this rank's host (``hvd.cross_rank()``)."""
        return hvd.cross_rank()

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Checks that Lightning was told one device per process, as hora runs one rank per device.

        Args:
            num_devices: the ``devices`` Lightning resolved for this process.
            num_nodes: the ``num_nodes`` given to the Trainer (not checked: hora
                knows the hosts from its launcher).

        Raises:
            ValueError: ``num_devices`` is not 1.
        """
        if num_devices != 1:
            raise ValueError(
                f"HoraStrategy trains on one device per process (got devices={num_devices}); pass devices=1 "
                "and start one process per device with the launcher, e.g. `horarun -np 4 python train.py`"
            )
