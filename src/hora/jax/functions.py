"""Broadcasting parameter pytrees between ranks.

JAX parameters are immutable pytrees (Flax's ``params``, optax's optimizer state), so
``broadcast_parameters`` returns the root's pytree rather than writing in place as
``hora.torch`` does::

    params = hvd.broadcast_parameters(params, root_rank=0)
    opt_state = hvd.broadcast_parameters(opt_state, root_rank=0)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from hora.core.process_sets import ProcessSet, global_process_set
from hora.jax.collectives import grouped_broadcast


def broadcast_parameters(
    params: Any, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Returns ``root_rank``'s pytree on every rank: every array leaf is broadcast.

    All leaves travel as one batch of broadcasts (one host callback inside jit). Leaves
    that are not arrays (Python numbers, strings, None) are left as they are.

    Args:
        params: a pytree of arrays (a Flax ``params`` dict, an optax state, ...), the
            same structure on every rank.
        root_rank: the global rank whose values every rank receives.
        name: a name for the batch (unnamed batches are numbered, or named when traced).
        process_set: the ranks taking part.

    Returns:
        A pytree of the same structure holding the root's values.
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray))]
    if not positions:
        return params
    received = grouped_broadcast([leaves[i] for i in positions], root_rank, name, process_set)
    for i, value in zip(positions, received):
        leaves[i] = value
    return jax.tree_util.tree_unflatten(treedef, leaves)


__all__ = ["broadcast_parameters"]
