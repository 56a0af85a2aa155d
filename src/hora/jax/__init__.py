"""hora's binding for JAX: Horovod's API on ``jax.Array`` s, eager and inside ``jax.jit``.

Horovod never had a JAX binding; ``import hora.jax as hvd`` gives the functions
``horovod.torch`` has, with the same names, arguments and defaults, taking and
returning ``jax.Array`` s. Collectives run eagerly and inside ``jax.jit`` (as ordered
host callbacks, named when traced: ``hora.jax.bridge``), and are differentiable with
Horovod's gradients. ``DistributedOptimizer`` wraps an optax optimizer::

    import hora.jax as hvd
    hvd.init()
    tx = hvd.DistributedOptimizer(optax.adam(1e-3 * hvd.size()))
    params = hvd.broadcast_parameters(params, root_rank=0)

See docs/jax.md.
"""

from hora.core import basics as _basics
from hora.core.basics import *  # noqa: F403 - Horovod's basics, declared once
from hora.core.api import (
    allgather_object,
    barrier,
    broadcast_object,
    is_homogeneous,
    join,
)
from hora.jax.collectives import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_broadcast,
    grouped_reducescatter,
    reducescatter,
)
from hora.jax.compression import Compression
from hora.jax.functions import broadcast_parameters
from hora.jax.optimizer import DistributedOptimizer, allreduce_gradients

__all__ = [
    "Compression",
    "DistributedOptimizer",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_gradients",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_parameters",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_broadcast",
    "grouped_reducescatter",
    "is_homogeneous",
    "join",
    "reducescatter",
]
__all__ += _basics.__all__  # the names every binding offers (hora.core.basics)
