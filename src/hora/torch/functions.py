"""Broadcasting model and optimizer state, and Python objects, between ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from hora.core import api
from hora.core.api import synchronize
from hora.core.process_sets import ProcessSet, global_process_set
from hora.torch.collectives import broadcast_async_
from hora.torch.dynamo import outside_compile
from hora.torch.wrapper import WrappedOptimizer

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]

allgather_object = outside_compile(api.allgather_object)
broadcast_object = outside_compile(api.broadcast_object)


@outside_compile
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
class _Entry:
    """One item of a parameter's optimizer state, as the root describes it to the others.

    Attributes:
        param: the parameter's index in ``state_dict()`` numbering.
        name: the item's key in the parameter's state (``"exp_avg"``, ``"step"``, ...).
        key: Horovod's broadcast name for it: ``<name>.<n>``, its n-th occurrence.
        shape: the tensor's shape; None when the item is not a tensor.
        dtype: the tensor's dtype; None when the item is not a tensor.
        value: the item itself when it is not a tensor (travels in the pickle).
    """

    param: int
    name: Any
    key: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    value: Any


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The root's optimizer state without its tensors' values: one small pickle.

    Attributes:
        options: per parameter group, its options (``lr``, ``momentum``, ...).
        entries: the per-parameter state, in Horovod's order (group by group, parameter
            by parameter).
    """

    options: list[dict[str, Any]]
    entries: list[_Entry]


@outside_compile
def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: torch.nn.Module | None = None,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Makes every rank's optimizer state (per-parameter state and group options) ``root_rank``'s.

    As Horovod does: an optimizer with no state yet (no step taken) first gets it
    initialised: every parameter that requires grad gets a zero ``.grad`` (sparse for
    ``SparseAdam``, and for ``SGD`` on the sparse ``nn.Embedding`` layers of ``model``),
    and the optimizer steps once on them (the wrapped optimizer's step for a
    ``DistributedOptimizer``, so nothing is reduced). The zero gradients stay. Then
    tensors of the state are broadcast in place into this rank's state tensors, and the
    non-tensor items and every group option (``lr``, ``momentum``, ...) travel as one
    pickle and are assigned. An optimizer without state even after that step (``SGD``
    without momentum) is left as it is, options included, as in Horovod.

    Unlike Horovod, parameter values never change: the initialisation step would move
    them under weight decay (or ``ASGD``'s decay), so each parameter's value is restored
    after it (this holds a copy of the trainable parameters for the moment). A rank
    whose state differs in structure from the root's (another optimizer, or state
    loaded from another run) receives the root's tensors into new ones instead of
    waiting for ever.

    Args:
        optimizer: a ``torch.optim`` optimizer or a ``DistributedOptimizer``, with the
            same parameter groups on every rank.
        root_rank: the rank whose state every rank receives (a global rank).
        model: the model, as in Horovod: identifies sparse parameters
            (``nn.Embedding(sparse=True)``) for the initialisation step.
        process_set: the ranks taking part (an addition to Horovod's signature).

    Raises:
        ValueError: ``optimizer`` is ``torch.optim.LBFGS`` (as in Horovod), or this
            rank's optimizer has fewer parameters or parameter groups than the root's
            (raised after every broadcast is done, so no rank waits).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if isinstance(optimizer, WrappedOptimizer) and optimizer._broadcast_state(root_rank, process_set):
        return  # a sharded optimizer: its consolidated state, broadcast whole
    if len(optimizer.state_dict()["state"]) == 0:
        _initialize_state(optimizer, model)
    params = _numbered_params(optimizer)
    layout = broadcast_object(
        _layout(optimizer, params), root_rank, name="broadcast_optimizer_state", process_set=process_set
    )
    if not layout.entries:
        return  # the root's optimizer is stateless: nothing to broadcast (Horovod returns here)
    problems: list[str] = []
    handles = []
    finishers = []
    for entry in layout.entries:
        if entry.shape is None or entry.dtype is None:
            continue
        p = params[entry.param] if entry.param < len(params) else None
        buffer, finish = _receiver(optimizer, p, entry)
        handles.append(broadcast_async_(buffer, root_rank, entry.key, process_set))
        finishers.append(finish)
    for handle in handles:
        synchronize(handle)
    for finish in finishers:
        finish()
    for entry in layout.entries:
        if entry.param >= len(params):
            problems.append(f"parameter {entry.param} (state '{entry.name}')")
        elif entry.shape is None:
            optimizer.state[params[entry.param]][entry.name] = entry.value
    for index, options in enumerate(layout.options):
        if index >= len(optimizer.param_groups):
            problems.append(f"parameter group {index}")
            continue
        optimizer.param_groups[index].update(options)
    if problems:
        raise ValueError(
            f"broadcast_optimizer_state: the root's optimizer has {', '.join(sorted(set(problems)))} that "
            f"this rank's lacks ({len(params)} parameters in {len(optimizer.param_groups)} groups here); "
            "build the same optimizer over the same model on every rank"
        )


def _initialize_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """Horovod's initialisation of an empty state: zero gradients, one step; parameters restored.

    The zero gradients stay on the parameters, as Horovod leaves them.
    """
    sparse_ids: set[int] = set()
    if model is not None:
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding) and module.sparse:
                sparse_ids.update(id(p) for p in module.parameters())
    sparse_all = isinstance(optimizer, torch.optim.SparseAdam)
    sparse_sgd = isinstance(optimizer, torch.optim.SGD)
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            if sparse_all or (sparse_sgd and id(p) in sparse_ids):
                grad = grad.to_sparse()
            p.grad = grad
            saved.append((p, p.detach().clone()))
    # A DistributedOptimizer's own step() would reduce gradients, which deadlocks unless every
    # rank steps: step the optimizer it wraps (Horovod steps its base class for the same reason).
    inner = optimizer.optimizer if isinstance(optimizer, WrappedOptimizer) else optimizer
    inner.step()
    with torch.no_grad():
        for p, value in saved:
            p.copy_(value)


def _numbered_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters in ``state_dict()`` numbering: group by group, each once."""
    params: list[torch.Tensor] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def _layout(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> _Layout:
    """This rank's state as ``_Layout`` (only the root's travels), in Horovod's order and names."""
    number = {id(p): i for i, p in enumerate(params)}
    options = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    entries: list[_Entry] = []
    occurrences: dict[str, int] = {}
    done: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            # `in` first: the state is a defaultdict, and indexing it would add an entry.
            if id(p) in done or p not in optimizer.state:
                continue
            done.add(id(p))
            for name, value in optimizer.state[p].items():
                occurrences[str(name)] = occurrences.get(str(name), 0) + 1
                key = f"{name}.{occurrences[str(name)]}"
                if isinstance(value, torch.Tensor):
                    entries.append(_Entry(number[id(p)], name, key, tuple(value.shape), value.dtype, None))
                else:
                    entries.append(_Entry(number[id(p)], name, key, None, None, value))
    return _Layout(options, entries)


def _receiver(
    optimizer: torch.optim.Optimizer, p: torch.Tensor | None, entry: _Entry
) -> tuple[torch.Tensor, Callable[[], None]]:
    """Where a state tensor's broadcast lands on this rank, and what to do once it has.

    In place into this rank's own state tensor when it has the root's shape and dtype
    (always on the root; on the others once their state is initialised); otherwise into
    a new tensor that then replaces the item (on the item's device, else the parameter's;
    ``step`` counters stay on the CPU, as torch keeps them).
    """
    assert entry.shape is not None and entry.dtype is not None  # invariant: a tensor entry
    if p is None:  # the root has more parameters than this rank: receive, then report
        return torch.empty(entry.shape, dtype=entry.dtype), lambda: None
    state = optimizer.state[p]
    current = state.get(entry.name)
    if (
        isinstance(current, torch.Tensor)
        and tuple(current.shape) == entry.shape
        and current.dtype == entry.dtype
    ):
        if current.is_contiguous():
            return current, lambda: None
        staging = current.contiguous()

        def copy_back() -> None:
            current.copy_(staging)

        return staging, copy_back
    if isinstance(current, torch.Tensor):
        device = current.device
    else:
        device = torch.device("cpu") if entry.name == "step" else p.device
    fresh = torch.empty(entry.shape, dtype=entry.dtype, device=device)

    def replace() -> None:
        state[entry.name] = fresh

    return fresh, replace
