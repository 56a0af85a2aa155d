"""Everything ``horovod.torch.mpi_ops`` offers: the basics, the op constants and the collectives.

``hora.torch`` re-exports all of it except ``is_homogeneous`` and ``gpu_available``, which Horovod keeps
here only.
"""

from hora.core import api as _api
from hora.core import basics as _basics
from hora.core.basics import *  # noqa: F403 - Horovod's basics, declared once
from hora.core.api import gpu_available, is_homogeneous
from hora.torch.autograd import (
    HorovodAllgather,
    HorovodAllreduce,
    HorovodAlltoall,
    HorovodBroadcast,
    HorovodGroupedAllgather,
    HorovodGroupedAllreduce,
    HorovodGroupedReducescatter,
    HorovodReducescatter,
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from hora.torch.collectives import (
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    reducescatter_async,
    sparse_allreduce_async,
)
from hora.torch.compression import Compression
from hora.torch.dynamo import outside_compile

# Inside torch.compile these run as they are, as the collectives do (hora.torch.dynamo).
barrier = outside_compile(_api.barrier)
join = outside_compile(_api.join)
poll = outside_compile(_api.poll)
synchronize = outside_compile(_api.synchronize)

__all__ = [
    "Compression",
    "HorovodAllgather",
    "HorovodAllreduce",
    "HorovodAlltoall",
    "HorovodBroadcast",
    "HorovodGroupedAllgather",
    "HorovodGroupedAllreduce",
    "HorovodGroupedReducescatter",
    "HorovodReducescatter",
    "allgather",
    "allgather_async",
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
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "gpu_available",
    "is_homogeneous",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
]
__all__ += _basics.__all__  # the names every binding offers (hora.core.basics)
