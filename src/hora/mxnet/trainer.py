"""DistributedTrainer: a Gluon Trainer that sums gradients over the ranks with hora instead of a kvstore."""

from __future__ import annotations

import warnings
from collections import OrderedDict, defaultdict
from typing import Any

import mxnet as mx

from hora.collectives.reduce import SUM
from hora.compression import Compressor
from hora.core.api import synchronize
from hora.core.process_sets import ProcessSet, global_process_set
from hora.mxnet.compression import Compression
from hora.mxnet.mpi_ops import allreduce_async
from hora.mxnet.optimizer import DistributedOptimizer, split_list


class DistributedTrainer(mx.gluon.Trainer):  # type: ignore[misc]  # mxnet has no type hints
    """A ``gluon.Trainer`` whose ``step`` (and ``allreduce_grads``) average gradients over the ranks.

    Each rank's gradients are summed over the process set, in place, and the trainer's
    scale (``rescale_grad``) is multiplied by ``gradient_predivide_factor /
    process_set.size()``, so that ``step(batch_size)`` with each rank's own batch size
    updates every rank as one process would on all ranks' batches together (Horovod's
    averaging on a build without NCCL averaging, that is every CPU build). Gradients are
    queued one by one as they become ready and all reduced before the update.

    Args:
        params: the parameters to train (``net.collect_params()``, a dict, or a list;
            dicts are taken in sorted name order and lists sorted by name, so every
            rank numbers them alike).
        optimizer: an optimizer name (``"sgd"``) or ``mx.optimizer.Optimizer``; a
            ``DistributedOptimizer`` is unwrapped, with a warning.
        optimizer_params: the optimizer's arguments, with an optimizer name.
        compression: ``Compression.fp16`` sends floating-point gradients as float16.
        gradient_predivide_factor: each gradient is divided by it before the sum
            (and the average multiplied by it after).
        prefix: put before every gradient's name; two trainers in one program need
            different prefixes.
        num_groups: reduce the gradients in this many groups (per dtype) instead of
            one collective each (0).
        process_set: the ranks whose gradients are averaged; other ranks train alone.

    Raises:
        ValueError: ``prefix`` is not a string.
    """

    def __init__(
        self,
        params: Any,
        optimizer: Any,
        optimizer_params: dict[str, Any] | None = None,
        compression: type[Compressor] = Compression.none,
        gradient_predivide_factor: float = 1.0,
        prefix: str | None = None,
        num_groups: int = 0,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError(f"DistributedTrainer: prefix must be a string or None; got {type(prefix).__name__}")
        self._compression = compression
        self._process_set = process_set
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn(
                "DistributedTrainer does not take DistributedOptimizer as its optimizer. We have unwrapped it for you.",
                stacklevel=2,
            )
        # The same parameter order on every rank: the gradients' names are their positions.
        if isinstance(params, dict):
            params = OrderedDict(params)  # gluon.Trainer sorts a dict's keys itself
        elif isinstance(params, (list, tuple)):
            params = sorted(params, key=lambda p: p.name)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._gradient_predivide_factor = gradient_predivide_factor
        self._scale *= gradient_predivide_factor / (process_set.size() or 1)
        self._prefix = prefix or ""
        self._num_groups = num_groups

    def _allreduce_grads(self) -> None:
        """Sums every trainable parameter's gradient over the process set, in place."""
        if self._process_set.size() == 1 or not self._process_set.included():
            return
        entries = []  # (name, gradient as sent, compression context, parameter)
        for i, param in enumerate(self._params):
            if param.grad_req != "null":
                sent, ctx = self._compression.compress(param.list_grad()[0])
                entries.append((self._prefix + str(i), sent, ctx, param))
        prescale = 1.0 / self._gradient_predivide_factor
        handles = []
        if self._num_groups > 0:
            for group in split_list(entries, self._num_groups):
                by_dtype: dict[Any, list[tuple[str, Any]]] = defaultdict(list)
                for name, sent, _, _ in group:
                    by_dtype[sent.dtype].append((name, sent))
                for same in by_dtype.values():
                    name = f"{same[0][0]}:{same[-1][0]}"
                    tensors = [sent for _, sent in same]
                    handles.append(allreduce_async(tensors, None, name, SUM, prescale, 1.0, self._process_set, True, True))
        else:
            for name, sent, _, _ in entries:
                handles.append(allreduce_async([sent], None, name, SUM, prescale, 1.0, self._process_set, True, False))
        for handle in handles:
            synchronize(handle)
        if self._compression is not Compression.none:
            for _, sent, ctx, param in entries:
                param.list_grad()[0][:] = self._compression.decompress(sent, ctx)
