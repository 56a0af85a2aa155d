"""hora's binding for NumPy arrays: Horovod's API with arrays for tensors.

``import hora.numpy as hvd`` gives the same functions as ``horovod.torch`` (names,
signatures, defaults), taking and returning NumPy arrays. It is the reference binding
the tests use and a convenient one for NumPy-only jobs.
"""

from hora.core import basics as _basics
from hora.core.basics import *  # noqa: F403 - Horovod's basics, declared once
from hora.core.api import (
    allgather_object,
    barrier,
    broadcast_object,
    is_homogeneous,
    join,
    poll,
    synchronize,
)
from hora.compression import Compression
from hora.numpy import elastic
from hora.numpy.collectives import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
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
    reducescatter,
    reducescatter_async,
)

__all__ = [
    "Compression",
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
    "elastic",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "is_homogeneous",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "synchronize",
]
__all__ += _basics.__all__  # the names every binding offers (hora.core.basics)
