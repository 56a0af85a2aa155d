"""``DistributedOptimizer``: an optax transformation that averages gradients across ranks.

``hvd.DistributedOptimizer(optax.adam(1e-3))`` is an ``optax.GradientTransformation``
whose ``update`` first reduces the gradient pytree over the ranks of the set, then
runs the wrapped optimizer on the result. A Flax/optax training step changes two
lines (wrap the optimizer, broadcast the initial parameters)::

    tx = hvd.DistributedOptimizer(optax.adam(1e-3 * hvd.size()))
    params = hvd.broadcast_parameters(params, root_rank=0)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

The reduction is one grouped allreduce of every leaf (``num_groups`` or ``groups``
split it), so the engine fuses them into as few collectives as its fusion buffer
allows; inside ``jit`` that is one host callback per group per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import optax  # type: ignore[import-untyped]

from hora.collectives.reduce import AVERAGE, SUM
from hora.compression import Compressor, NoneCompressor
from hora.core.process_sets import ProcessSet, global_process_set
from hora.jax.collectives import grouped_allreduce


class AllreduceState(NamedTuple):
    """``allreduce_gradients`` keeps no state."""


def _split(count: int, num_groups: int, groups: int | Sequence[Sequence[int]] | None) -> list[list[int]]:
    """Leaf indices per grouped allreduce: one group of all; ``num_groups`` contiguous
    ones; or ``groups`` as lists of leaf indices (leaves in none of them: one group more).

    Raises:
        ValueError: a group names a leaf that does not exist, or one twice.
    """
    if isinstance(groups, int):
        num_groups, groups = groups, None
    if groups is not None:
        chosen = [list(map(int, g)) for g in groups if len(g)]
        seen = [i for g in chosen for i in g]
        if len(seen) != len(set(seen)) or any(not 0 <= i < count for i in seen):
            raise ValueError(
                f"hora.jax.DistributedOptimizer: groups must name each gradient leaf (0..{count - 1}) at most once"
            )
        rest = [i for i in range(count) if i not in set(seen)]
        return chosen + ([rest] if rest else [])
    if num_groups <= 1 or count <= 1:
        return [list(range(count))] if count else []
    parts = min(num_groups, count)
    q, m = divmod(count, parts)
    out, start = [], 0
    for p in range(parts):
        n = q + (1 if p < m else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def allreduce_gradients(
    compression: type[Compressor] = NoneCompressor,
    op: int = AVERAGE,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[int]] | None = None,
    process_set: ProcessSet = global_process_set,
    name: str | None = None,
) -> optax.GradientTransformation:
    """An optax transformation that reduces the update pytree over the ranks of the set.

    Args:
        compression: ``Compression.fp16`` sends floating-point leaves as float16.
        op: Average (default), Sum or Adasum.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after (Horovod's split of the averaging).
        num_groups: split the leaves into this many grouped allreduces (0: one).
        groups: leaf indices (in ``jax.tree_util.tree_leaves`` order) per group.
        process_set: the ranks taking part.
        name: a base name for the collectives (None: named when traced or numbered).

    Raises:
        ValueError: ``gradient_predivide_factor`` with an op other than Average.
    """
    if gradient_predivide_factor != 1.0 and op != AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")

    def init(params: Any) -> AllreduceState:
        return AllreduceState()

    def update(updates: Any, state: AllreduceState, params: Any = None) -> tuple[Any, AllreduceState]:
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        if not leaves:
            return updates, state
        reduce_op, pre, post = op, 1.0, 1.0
        if op == AVERAGE and gradient_predivide_factor != 1.0:
            size = process_set.size() or 1
            reduce_op, pre, post = SUM, 1.0 / gradient_predivide_factor, gradient_predivide_factor / size
        out = list(leaves)
        for g, indices in enumerate(_split(len(leaves), num_groups, groups)):
            group_name = None if name is None else f"{name}.{g}"
            reduced = grouped_allreduce(
                [leaves[i] for i in indices],
                name=group_name,
                compression=compression,
                op=reduce_op,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=process_set,
            )
            for i, r in zip(indices, reduced):
                out[i] = r
        return jax.tree_util.tree_unflatten(treedef, out), state

    return optax.GradientTransformation(init, update)


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: optax.GradientTransformation,
    compression: type[Compressor] = NoneCompressor,
    backward_passes_per_step: int = 1,
    op: int = AVERAGE,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[int]] | None = None,
    process_set: ProcessSet = global_process_set,
    name: str | None = None,
) -> optax.GradientTransformation:
    """Makes an optax optimizer reduce gradients across ranks before it applies them.

    Args:
        optimizer: any ``optax.GradientTransformation``.
        compression, op, gradient_predivide_factor, num_groups, groups, process_set,
            name: see ``allreduce_gradients``.
        backward_passes_per_step: accumulate this many steps' gradients locally (their
            mean, as ``optax.MultiSteps`` does) before one reduction and one update;
            the steps between return zero updates.

    Returns:
        An ``optax.GradientTransformation`` (an ``optax.MultiSteps`` one's with
        ``backward_passes_per_step > 1``).

    Raises:
        ValueError: ``backward_passes_per_step < 1``, or a predivide factor with an op
            other than Average.
    """
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be at least 1; got {backward_passes_per_step}")
    chained = optax.chain(
        allreduce_gradients(compression, op, gradient_predivide_factor, num_groups, groups, process_set, name),
        optimizer,
    )
    if backward_passes_per_step == 1:
        return chained
    return optax.MultiSteps(chained, every_k_schedule=backward_passes_per_step).gradient_transformation()


__all__ = ["AllreduceState", "DistributedOptimizer", "allreduce_gradients"]
