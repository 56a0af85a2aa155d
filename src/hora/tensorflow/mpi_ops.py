"""``horovod.tensorflow.mpi_ops``: the basics, the op constants and the TensorFlow ops that
Horovod's module of that name offers (``hora.tensorflow``'s objects; its allreduce is
``hora.tensorflow.allreduce``, as Horovod keeps its own private here)."""

from hora.core import basics as _basics
from hora.core.basics import *  # noqa: F403 - Horovod's basics, declared once
from hora.core.api import gpu_available, is_homogeneous
from hora.tensorflow.basics import join, local_rank_op, local_size_op, process_set_included_op, rank_op, size_op
from hora.tensorflow.collectives import allgather, alltoall, broadcast, broadcast_, grouped_allgather

__all__ = [
    "allgather",
    "alltoall",
    "broadcast",
    "broadcast_",
    "gpu_available",
    "grouped_allgather",
    "is_homogeneous",
    "join",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "size_op",
]
__all__ += _basics.__all__
