"""Horovod's basics: the names every framework binding offers as the same objects.

Topology, start and stop, process sets, the timeline, what was built, the reduce ops
and the errors are the framework-free core's, and ``hora.numpy``, ``hora.torch``,
``hora.torch.mpi_ops`` and ``hora.tensorflow`` re-export all of them from here
(``from hora.core.basics import *``, ``__all__ += basics.__all__``), so the common surface
is declared once; each binding declares only what is its own (its collectives, its
``Compression``, ``join``/``barrier`` where they return framework tensors, ...).
"""

from hora.core.api import (
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hora.collectives.reduce import ADASUM as Adasum
from hora.collectives.reduce import AVERAGE as Average
from hora.collectives.reduce import MAX as Max
from hora.collectives.reduce import MIN as Min
from hora.collectives.reduce import PRODUCT as Product
from hora.collectives.reduce import SUM as Sum
from hora.errors import (
    CollectiveMismatchError,
    HoraInternalError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
)
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = [
    "Adasum",
    "Average",
    "CollectiveMismatchError",
    "HoraInternalError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
