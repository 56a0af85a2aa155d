"""hora's binding for Apache MXNet: ``import hora.mxnet as hvd`` in place of ``import horovod.mxnet as hvd``.

The same names, signatures and defaults as ``horovod.mxnet`` 0.28.1: the basics
(``init``, ``rank``, ``size``, ...), the collectives on NDArrays (``allreduce``,
``allreduce_``, ``grouped_allreduce``, ``allgather``, ``broadcast``, ``alltoall``,
``reducescatter``, ...), ``broadcast_parameters``, ``broadcast_object``,
``allgather_object``, ``Compression``, ``DistributedOptimizer`` and, for Gluon,
``DistributedTrainer``; process sets and the op constants. CPU NDArrays move without
copies (``tensors``).

MXNet 1.9.1 needs NumPy < 2; importing this package first restores the NumPy aliases
NumPy 1.24 removed, which MXNet still reads (``numpy_compat``), then imports mxnet.

    import mxnet as mx
    import hora.mxnet as hvd

    hvd.init()
    net = mx.gluon.nn.Dense(10)
    net.initialize()
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1 * hvd.size()})
"""

from hora.mxnet import numpy_compat as _numpy_compat

_numpy_compat.restore()  # before anything below imports mxnet

from hora.core import basics as _basics  # noqa: E402
from hora.core.basics import *  # noqa: E402,F403 - Horovod's basics, declared once
from hora.mxnet import mpi_ops  # noqa: E402
from hora.mxnet.compression import Compression  # noqa: E402
from hora.mxnet.functions import allgather_object, broadcast_object, broadcast_parameters  # noqa: E402
from hora.mxnet.mpi_ops import (  # noqa: E402
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
)
from hora.mxnet.optimizer import DistributedOptimizer  # noqa: E402
from hora.mxnet.trainer import DistributedTrainer  # noqa: E402

__all__ = [
    "Compression",
    "DistributedOptimizer",
    "DistributedTrainer",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "alltoall",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_parameters",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_reducescatter",
    "mpi_ops",
    "reducescatter",
]
__all__ += _basics.__all__  # the names every binding offers (hora.core.basics)
