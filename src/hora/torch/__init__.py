"""hora's binding for PyTorch: ``import hora.torch as hvd`` in place of ``import horovod.torch as hvd``.

The same names, signatures, defaults and return types as ``horovod.torch`` 0.28.1:
the basics (``init``, ``rank``, ``size``, ...), the collectives on tensors and their
asynchronous and in-place variants, ``DistributedOptimizer``,
``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object``,
``allgather_object``, ``SyncBatchNorm``, ``Compression``, process sets and the op
constants. CPU tensors move without copies; tensors on other devices are staged
through host memory. ``is_homogeneous`` lives in ``hora.torch.mpi_ops``, as in Horovod.

    import torch
    import hora.torch as hvd

    hvd.init()
    model = torch.nn.Linear(10, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
"""

from hora.core import basics as _basics
from hora.core.basics import *  # noqa: F403 - Horovod's basics, declared once
from hora.torch import elastic, mpi_ops
from hora.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hora.torch.mpi_ops import (
    Compression,
    HorovodAllgather,
    HorovodAllreduce,
    HorovodAlltoall,
    HorovodBroadcast,
    HorovodGroupedAllgather,
    HorovodGroupedAllreduce,
    HorovodGroupedReducescatter,
    HorovodReducescatter,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from hora.torch.optimizer import DistributedOptimizer
from hora.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "Compression",
    "DistributedOptimizer",
    "HorovodAllgather",
    "HorovodAllreduce",
    "HorovodAlltoall",
    "HorovodBroadcast",
    "HorovodGroupedAllgather",
    "HorovodGroupedAllreduce",
    "HorovodGroupedReducescatter",
    "HorovodReducescatter",
    "SyncBatchNorm",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "elastic",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "mpi_ops",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
]
__all__ += _basics.__all__  # the names every binding offers (hora.core.basics)
