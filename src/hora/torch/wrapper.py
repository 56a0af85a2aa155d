"""The optimizer wrapper DistributedOptimizer builds on, and what both its variants share.

A ``WrappedOptimizer`` *is* the optimizer it wraps as far as the rest of PyTorch can
tell: ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own
objects, ``isinstance(opt, type(wrapped))`` holds, step hooks and ``state_dict`` go to
the wrapped optimizer, and LR schedulers bind to the wrapper and change the shared
``lr``. No class is generated at run time.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

_ZERO_GRAD_MISUSE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
_TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)


class WrappedOptimizer(torch.optim.Optimizer):
    """Presents a wrapped optimizer as itself: shared state, delegated behaviour.

    ``torch.optim.Optimizer.__init__`` is deliberately not called: ``param_groups``,
    ``state`` and ``defaults`` are the wrapped optimizer's objects (through the
    properties below), and any other attribute (step-hook tables, custom methods)
    is looked up on the wrapped optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"DistributedOptimizer wraps a torch.optim.Optimizer; got {type(optimizer).__name__}")
        if isinstance(optimizer, WrappedOptimizer):  # wrapping twice would reduce every gradient twice
            raise ValueError("this optimizer is already a DistributedOptimizer; wrap the torch.optim optimizer once")
        self._optimizer = optimizer
        self._hook_lock = threading.Lock()

    # Reported class: the wrapped optimizer's, so isinstance(opt, type(wrapped)) holds as with
    # Horovod's generated subclass (type(opt) stays this class).
    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self._optimizer)

    def __getattr__(self, name: str) -> Any:
        if name == "_optimizer":  # not set yet (a half-built object)
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._optimizer.defaults = value

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._optimizer

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._reset()
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)
        self._on_new_params(list(param_group["params"]) if "params" in param_group else [])

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a DistributedOptimizer cannot be pickled or deep-copied; save optimizer.state_dict() instead "
            "and load it into a new DistributedOptimizer"
        )

    # Subclass hooks.
    def _reset(self) -> None:
        pass

    def _on_new_params(self, params: list[torch.Tensor]) -> None:
        pass

    def synchronize(self) -> None:
        """Waits for every gradient's allreduce and writes the results into ``p.grad``."""
        raise NotImplementedError

    def skip_synchronize(self) -> contextlib.AbstractContextManager[None]:
        """A context in which ``step()`` does not synchronize (after an explicit ``synchronize()``)."""
        raise NotImplementedError

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Sets how many backward passes accumulate gradients locally before they are reduced."""
        raise NotImplementedError


class _Names:
    """Parameter names for the allreduces (Horovod's rules and checks)."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Iterable[Any] | None) -> None:
        if named_parameters is not None:
            named = list(named_parameters)
        else:
            named = [
                (f"allreduce.noname.{i}.{j}", p)
                for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])
            ]
        if any(not isinstance(p, tuple) for p in named):
            raise ValueError(
                "named_parameters should be a sequence of tuples (name, parameter), "
                "usually produced by model.named_parameters()."
            )
        seen: set[str] = set()
        dups: set[str] = set()
        for key, _ in named:
            (dups if key in seen else seen).add(key)
        if dups:
            raise ValueError(
                "Parameter names in named_parameters must be unique. Found duplicates: " + ", ".join(sorted(dups))
            )
        named_ids = {id(p) for _, p in named}
        unnamed = [id(p) for group in optimizer.param_groups for p in group["params"] if id(p) not in named_ids]
        if unnamed:
            raise ValueError(
                "named_parameters was specified, but one or more model parameters were not named. "
                "Python object ids: " + ", ".join(str(i) for i in unnamed)
            )
        self.by_id: dict[int, str] = {id(p): k for k, p in named}

    def __getitem__(self, p: torch.Tensor) -> str:
        return self.by_id[id(p)]

    def add(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        index = len(optimizer.param_groups) - 1
        for j, p in enumerate(params):
            self.by_id.setdefault(id(p), f"allreduce.noname.{index}.{j}")


def _check_passes(passes: int) -> int:
    if int(passes) != passes or passes <= 0:
        raise ValueError(f"backward_passes_per_step must be a positive integer; got {passes!r}")
    return int(passes)


def _trainable(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def _hook_for(owner: Any, p: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook that reaches the optimizer through a weak reference,
    so a discarded optimizer neither stays alive through its hooks nor keeps reducing."""
    ref = weakref.ref(owner)

    def hook(_: torch.Tensor) -> None:
        optimizer = ref()
        if optimizer is not None:
            # Backward may run hooks on one thread per device: one at a time per optimizer.
            with optimizer._hook_lock:
                optimizer._gradient_ready(p)

    return hook


def _register_hook(p: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
    """Runs ``hook`` each time backward has accumulated ``p.grad`` (torch leaves this untyped)."""
    return p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call,no-any-return]


def _remove_hooks(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
