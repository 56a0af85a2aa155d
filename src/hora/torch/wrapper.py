"""The optimizer wrapper DistributedOptimizer builds on, and what both its variants share.

A ``WrappedOptimizer`` *is* the optimizer it wraps as far as the rest of PyTorch can
tell: ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own
objects, ``isinstance(opt, type(wrapped))`` holds, step hooks and ``state_dict`` go to
the wrapped optimizer, and LR schedulers bind to the wrapper and change the shared
``lr``. No class is generated at run time.

It also carries the attributes integrations read from Horovod's optimizer, with
Horovod's meaning and types (``_parameter_names``, ``_allreduce_delay``, ``_handles``,
``_grad_accs``, ``_requires_update``, ``_synchronized``, ``_should_synchronize``,
``backward_passes_per_step``, ``_compression``).
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from hora.compression import Compressor

_ZERO_GRAD_MISUSE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
_TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
_GRAD_REQUIRES_GRAD = (
    "DistributedOptimizer cannot reduce a gradient that requires grad (backward(create_graph=True)); "
    "Horovod asserts the same"
)

Handle = Any
"""What ``_handles`` holds for a launched collective: an ``int`` handle for ``synchronize``,
or a callable that waits and returns the result (sparse gradients), as in Horovod."""


class NotPicklableError(TypeError, pickle.PicklingError):
    """A DistributedOptimizer was pickled or deep-copied.

    A ``TypeError`` (what Python raises for objects that cannot be pickled) and a
    ``pickle.PicklingError`` (what pickling Horovod's generated optimizer class raises).
    """


class WrappedOptimizer(torch.optim.Optimizer):
    """Presents a wrapped optimizer as itself: shared state, delegated behaviour.

    ``torch.optim.Optimizer.__init__`` is deliberately not called: ``param_groups``,
    ``state`` and ``defaults`` are the wrapped optimizer's objects (through the
    properties below), and any other attribute (step-hook tables, custom methods)
    is looked up on the wrapped optimizer.

    Attributes (Horovod's, with Horovod's meaning):
        _parameter_names: ``{parameter: name}``, in name order: each gradient's
            collective is named after its parameter.
        _allreduce_delay: ``{parameter: backward passes left before its gradient is
            reduced}``; reset to ``backward_passes_per_step`` after each step.
        _handles: the gradients in flight since the last ``synchronize()``/``step()``,
            keyed by parameter (or, with ``groups``, by the tuple of a group's
            parameters): ``(handle, ctx)``, where ``handle`` is None until the
            collective starts and ``ctx`` is the compression context.
        _grad_accs: the gradient accumulators (autograd nodes) of the parameters whose
            gradients are reduced, kept alive as Horovod keeps them.
        _requires_update: the parameters whose gradients are reduced.
        _synchronized: ``synchronize()`` ran since the last ``step()``.
        _should_synchronize: False inside ``skip_synchronize()``.
        backward_passes_per_step: backward passes accumulated before one reduction.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[Any] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"DistributedOptimizer wraps a torch.optim.Optimizer; got {type(optimizer).__name__}")
        if isinstance(optimizer, WrappedOptimizer):  # wrapping twice would reduce every gradient twice
            raise ValueError("this optimizer is already a DistributedOptimizer; wrap the torch.optim optimizer once")
        self._optimizer = optimizer
        self._hook_lock = threading.Lock()
        self._compression = compression
        self._parameter_names: dict[torch.Tensor, str] = _parameter_names(optimizer, named_parameters)
        self.backward_passes_per_step = _check_passes(backward_passes_per_step)
        self._allreduce_delay: dict[torch.Tensor, int] = {p: self.backward_passes_per_step for p in self._parameter_names}
        self._handles: dict[Any, tuple[Handle | None, Any]] = {}
        self._grad_accs: list[Any] = []
        self._requires_update: set[torch.Tensor] = set()
        self._synchronized = False
        self._should_synchronize = True
        self._hooks: list[RemovableHandle] = []
        weakref.finalize(self, _remove_hooks, self._hooks)

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
        params = list(self._optimizer.param_groups[-1]["params"])
        _add_names(self._parameter_names, len(self._optimizer.param_groups) - 1, params)
        for p in params:
            self._allreduce_delay.setdefault(p, self.backward_passes_per_step)
        self._on_new_params(params)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise NotPicklableError(
            "a DistributedOptimizer cannot be pickled or deep-copied; save optimizer.state_dict() instead "
            "and load it into a new DistributedOptimizer"
        )

    @staticmethod
    def find_duplicates(lst: Iterable[Any]) -> set[Any]:
        """The items that occur more than once in ``lst`` (Horovod's helper, kept for callers)."""
        seen: set[Any] = set()
        dups: set[Any] = set()
        for item in lst:
            (dups if item in seen else seen).add(item)
        return dups

    def _watch(self, p: torch.Tensor) -> None:
        """Reduces ``p``'s gradient from now on: a hook, and Horovod's bookkeeping."""
        self._requires_update.add(p)
        self._grad_accs.append(_grad_accumulator(p))
        self._hooks.append(_register_hook(p, _hook_for(self, p)))

    def _reset_delays(self) -> None:
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Sets how many backward passes accumulate gradients locally before they are reduced.

        Raises:
            ValueError: ``passes`` is not a positive integer.
        """
        self.backward_passes_per_step = _check_passes(passes)
        self._reset_delays()

    _shard_stage = 0
    """The ZeRO stage of ``shard_optimizer_state`` (0: the whole state on every rank)."""

    # Subclass hooks.
    def _reset(self) -> None:
        pass

    def _broadcast_state(self, root_rank: int, process_set: Any) -> bool:
        """``broadcast_optimizer_state``'s own path for this wrapper; False: use the generic one."""
        return False

    def _on_new_params(self, params: list[torch.Tensor]) -> None:
        pass

    def _gradient_ready(self, p: torch.Tensor) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Waits for every gradient's allreduce and writes the results into ``p.grad``."""
        raise NotImplementedError

    def skip_synchronize(self) -> contextlib.AbstractContextManager[None]:
        """A context in which ``step()`` does not synchronize (after an explicit ``synchronize()``)."""
        raise NotImplementedError


def _parameter_names(optimizer: torch.optim.Optimizer, named_parameters: Iterable[Any] | None) -> dict[torch.Tensor, str]:
    """``{parameter: name}`` in name order, with Horovod's default names and checks.

    Raises:
        ValueError: an entry is not a ``(name, parameter)`` tuple, a name occurs twice,
            or a parameter of the optimizer has no name.
    """
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
    dups = WrappedOptimizer.find_duplicates(k for k, _ in named)
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
    # Names are unique, so sorting never compares two tensors.
    return {p: k for k, p in sorted(named, key=lambda item: item[0])}


def _add_names(names: dict[torch.Tensor, str], group_index: int, params: Sequence[torch.Tensor]) -> None:
    """Names the parameters of a group added later ``allreduce.noname.<group>.<j>`` (unless named)."""
    for j, p in enumerate(params):
        names.setdefault(p, f"allreduce.noname.{group_index}.{j}")


def _check_passes(passes: int) -> int:
    if int(passes) != passes or passes <= 0:
        raise ValueError(f"backward_passes_per_step must be > 0 (a positive integer); got {passes!r}")
    return int(passes)


def _trainable(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def _grad_accumulator(p: torch.Tensor) -> Any:
    """The autograd node that accumulates ``p.grad`` (Horovod's ``p.expand_as(p).grad_fn...``)."""
    with torch.enable_grad():  # also when the optimizer is built under no_grad()
        return p.expand_as(p).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _hook_for(owner: WrappedOptimizer, p: torch.Tensor) -> Callable[[torch.Tensor], None]:
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


def _check_gradient(p: torch.Tensor) -> None:
    """Horovod's hook assertion: a gradient that requires grad cannot be reduced in place.

    Raises:
        AssertionError: ``p.grad`` requires grad (``backward(create_graph=True)``).
    """
    if p.grad is not None and p.grad.requires_grad:
        raise AssertionError(_GRAD_REQUIRES_GRAD)


def _register_hook(p: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
    """Runs ``hook`` each time backward has accumulated ``p.grad`` (torch leaves this untyped)."""
    return p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call,no-any-return]


def _remove_hooks(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
