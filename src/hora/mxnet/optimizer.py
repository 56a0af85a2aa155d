"""DistributedOptimizer: an MXNet optimizer whose updates use gradients summed over the ranks.

The averaging is Horovod's on a build without NCCL averaging (every CPU build): the
gradients are summed (each first divided by ``gradient_predivide_factor``) and the
wrapped optimizer's ``rescale_grad`` is multiplied by ``gradient_predivide_factor /
process_set.size()`` once, when the wrapper is made, so its update sees the average.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import mxnet as mx

from hora.collectives.reduce import SUM
from hora.core.api import synchronize
from hora.core.process_sets import ProcessSet, global_process_set
from hora.mxnet.mpi_ops import allreduce_async

T = TypeVar("T")

# The wrapper's own attributes; every other attribute is the wrapped optimizer's.
_OWN = frozenset({"_optimizer", "_gradient_predivide_factor", "_num_groups", "_process_set"})


def split_list(items: Sequence[T], parts: int) -> list[list[T]]:
    """Splits ``items`` into ``parts`` consecutive runs whose lengths differ by at most one
    (the first ones longer), as Horovod groups gradients for ``num_groups``."""
    quotient, remainder = divmod(len(items), parts)
    bounds = [i * quotient + min(i, remainder) for i in range(parts + 1)]
    return [list(items[bounds[i] : bounds[i + 1]]) for i in range(parts)]


class DistributedOptimizer(mx.optimizer.Optimizer):  # type: ignore[misc]  # mxnet has no type hints
    """Wraps an MXNet optimizer: ``update`` first sums the gradient over the ranks (in place).

    Use it with the Module API (``module.init_optimizer(optimizer=opt)``) or an
    ``mx.optimizer.Updater``; for Gluon, ``DistributedTrainer`` is the one to use.

    Everything but the wrapper's own fields is the wrapped optimizer's: reading an
    attribute reads the wrapped optimizer's, and, unlike Horovod (where such writes
    stay on the wrapper and never reach the updates), setting one sets the wrapped
    optimizer's; so ``gluon.Trainer``'s per-step ``rescale_grad`` reaches the update.

    Args:
        optimizer: the MXNet optimizer to wrap. Its ``rescale_grad`` is multiplied by
            ``gradient_predivide_factor / process_set.size()`` (see the module).
        gradient_predivide_factor: each gradient is divided by it before the sum
            (and the average multiplied by it after).
        num_groups: when an update gets several gradients at once (aggregated
            updates), reduce them in this many groups (0: one collective each).
        process_set: the ranks whose gradients are summed; other ranks update alone.
    """

    def __init__(
        self,
        optimizer: mx.optimizer.Optimizer,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        # Optimizer.__init__ is not called (as in Horovod): its fields are the wrapped optimizer's.
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_gradient_predivide_factor", gradient_predivide_factor)
        object.__setattr__(self, "_num_groups", num_groups)
        object.__setattr__(self, "_process_set", process_set)
        optimizer.rescale_grad *= gradient_predivide_factor / (process_set.size() or 1)

    def __getattr__(self, item: str) -> Any:
        if item in _OWN:  # not set yet (a copy or an unpickling in progress)
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, item: str, value: Any) -> None:
        if item in _OWN:
            object.__setattr__(self, item, value)
        else:
            setattr(self._optimizer, item, value)

    def create_state(self, index: Any, weight: Any) -> Any:
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index: Any, weight: Any) -> Any:
        return self._optimizer.create_state_multi_precision(index, weight)

    def _do_allreduce(self, index: Any, grad: Any) -> None:
        """Sums the gradient(s) of one update over the process set, in place."""
        if self._process_set.size() == 1:
            return
        prescale = 1.0 / self._gradient_predivide_factor
        handles = []
        if isinstance(index, (tuple, list)):
            if self._num_groups > 0:
                for grads, indices in zip(split_list(grad, self._num_groups), split_list(index, self._num_groups)):
                    if grads:  # more groups than gradients: the rest are empty
                        name = f"{indices[0]}:{indices[-1]}"
                        handles.append(
                            allreduce_async(grads, None, name, SUM, prescale, 1.0, self._process_set, True, True)
                        )
            else:
                for one_index, one_grad in zip(index, grad):
                    handles.append(
                        allreduce_async(
                            [one_grad], None, str(one_index), SUM, prescale, 1.0, self._process_set, True, False
                        )
                    )
        else:
            handles.append(allreduce_async([grad], None, str(index), SUM, prescale, 1.0, self._process_set, True, False))
        for handle in handles:
            synchronize(handle)

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        if self._process_set.included():
            self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        if self._process_set.included():
            self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr: float) -> None:
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult: dict[Any, float]) -> None:
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: dict[Any, float]) -> None:
        self._optimizer.set_wd_mult(args_wd_mult)
