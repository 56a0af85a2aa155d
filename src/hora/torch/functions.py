"""Broadcasting model and optimizer state, and Python objects, between ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hora.api import allgather_object, broadcast_object, synchronize
from hora.process_sets import ProcessSet, global_process_set
from hora.torch.collectives import broadcast_async_

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[torch.Tensor | tuple[str, torch.Tensor]],
    root_rank: int,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Overwrites parameters (or any tensors) on every rank with ``root_rank``'s, in place.

    Typical use, once after building the model (and after loading a checkpoint on
    rank 0)::

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    Args:
        params: a ``state_dict()``-like mapping (broadcast in sorted name order), or an
            iterable of tensors or ``(name, tensor)`` pairs such as
            ``model.named_parameters()`` or ``model.parameters()``.
        root_rank: the rank whose values every rank receives.
        process_set: the ranks taking part (an addition to Horovod's signature).

    Raises:
        ValueError: ``params`` is neither a mapping nor an iterable of tensors.
    """
    if isinstance(params, Mapping):
        items: list[tuple[str | None, torch.Tensor]] = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name or 'an entry'} is a {type(tensor).__name__}, not a tensor")
        handles.append(broadcast_async_(tensor, root_rank, name, process_set))
    for handle in handles:
        synchronize(handle)


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    """Stands for a state tensor in the skeleton sent to the other ranks."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: torch.nn.Module | None = None,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Makes every rank's optimizer state (per-parameter state and hyperparameters) ``root_rank``'s.

    The root's ``state_dict()`` structure travels as one small pickle; its tensors
    travel as broadcasts straight into tensors of the right shape. A rank whose state is
    empty (no step taken yet) receives the root's state; when the root's state is
    empty, every rank ends with an empty state and the root's hyperparameters, so no
    rank takes a spurious initialization step (Horovod takes one with zero gradients,
    which moves weights under weight decay).

    Works for a plain ``torch.optim`` optimizer and for a ``DistributedOptimizer``.

    Args:
        optimizer: the optimizer, the same kind and parameter groups on every rank.
        root_rank: the rank whose state every rank receives.
        model: accepted for Horovod compatibility; names the broadcasts by parameter.
        process_set: the ranks taking part (an addition to Horovod's signature).

    Raises:
        ValueError: ``optimizer`` is ``torch.optim.LBFGS`` (as in Horovod).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    is_root = process_set.rank() == root_rank
    tensors: list[torch.Tensor] = []
    skeleton = None
    if is_root:
        skeleton = _skeleton(optimizer.state_dict(), tensors)
    skeleton = broadcast_object(skeleton, root_rank, name="broadcast_optimizer_state", process_set=process_set)
    if not is_root:
        tensors = [torch.empty(spec.shape, dtype=spec.dtype) for spec in _specs(skeleton)]
    names = _state_names(optimizer, model, skeleton, len(tensors))
    handles = [broadcast_async_(t, root_rank, name, process_set) for t, name in zip(tensors, names)]
    for handle in handles:
        synchronize(handle)
    if not is_root:
        optimizer.load_state_dict(_fill(skeleton, tensors))


def _skeleton(value: Any, tensors: list[torch.Tensor]) -> Any:
    """Replaces every tensor in a state dict by a ``_TensorSpec``, collecting the tensors in order."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().contiguous())
        return _TensorSpec(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _skeleton(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_skeleton(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_skeleton(v, tensors) for v in value)
    return value


def _specs(skeleton: Any) -> list[_TensorSpec]:
    found: list[_TensorSpec] = []

    def walk(value: Any) -> None:
        if isinstance(value, _TensorSpec):
            found.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(skeleton)
    return sorted(found, key=lambda spec: spec.index)


def _fill(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _TensorSpec):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_fill(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_fill(v, tensors) for v in skeleton)
    return skeleton


def _state_names(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, skeleton: Any, count: int
) -> list[str]:
    """Names the state broadcasts ``optimizer_state.<param>.<key>`` (parameter names from ``model``)."""
    by_param: dict[int, str] = {}
    if model is not None:
        ids = {id(p): name for name, p in model.named_parameters()}
        flat = [p for group in optimizer.param_groups for p in group["params"]]
        by_param = {i: ids[id(p)] for i, p in enumerate(flat) if id(p) in ids}
    names = [f"optimizer_state.{i}" for i in range(count)]
    for param, entries in skeleton.get("state", {}).items():
        for key, value in entries.items():
            if isinstance(value, _TensorSpec):
                names[value.index] = f"optimizer_state.{by_param.get(param, param)}.{key}"
    return names
