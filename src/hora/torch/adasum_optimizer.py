"""DistributedOptimizer with ``op=Adasum``: each rank steps locally, the ranks combine weight changes.

Horovod's delta optimizer. When backward has accumulated a parameter's gradient, the
hook steps the wrapped optimizer on that parameter alone, turns the parameter into
the change the step made (``delta = new - start``), and starts an in-place Adasum
allreduce of the delta. ``step()`` waits and sets each parameter to
``start + Adasum(deltas)``. Adasum adds orthogonal deltas and averages parallel ones,
so the learning rate need not be scaled with the number of ranks.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from hora.api import synchronize
from hora.collectives.reduce import ADASUM
from hora.compression import Compressor
from hora.torch.collectives import allreduce_async_
from hora.torch.wrapper import (
    _TOO_MANY_PASSES,
    _ZERO_GRAD_MISUSE,
    WrappedOptimizer,
    _check_passes,
    _hook_for,
    _Names,
    _register_hook,
    _remove_hooks,
    _trainable,
)


class _DistributedAdasumOptimizer(WrappedOptimizer):
    """Adasum of per-rank weight changes around a wrapped optimizer (see ``DistributedOptimizer``)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[Any] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
    ) -> None:
        super().__init__(optimizer)
        self._names = _Names(optimizer, named_parameters)
        self._compression = compression
        self.backward_passes_per_step = _check_passes(backward_passes_per_step)
        self._start: dict[torch.Tensor, torch.Tensor] = {}
        self._delay: dict[torch.Tensor, int] = {}
        self._params: list[torch.Tensor] = []
        # Invariant: a parameter is a key of _handles from its first hook of a step until
        # step(); its value is None until its delta's allreduce is launched.
        self._handles: dict[torch.Tensor, tuple[int, torch.Tensor, Any] | None] = {}
        self._hooks: list[RemovableHandle] = []
        weakref.finalize(self, _remove_hooks, self._hooks)
        self._register(_trainable(optimizer))

    def _register(self, params: list[torch.Tensor]) -> None:
        for p in params:
            if p in self._delay:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._params.append(p)
            self._start[p] = torch.zeros_like(p, requires_grad=False)
            self._delay[p] = self.backward_passes_per_step
            self._hooks.append(_register_hook(p, _hook_for(self, p)))

    def _on_new_params(self, params: list[torch.Tensor]) -> None:
        self._names.add(self._optimizer, params)
        self._register([p for p in params if p.requires_grad])

    def _reset(self) -> None:
        # Deltas already in flight run on every rank: apply them, so parameters are weights again.
        launched = {p: h for p, h in self._handles.items() if h is not None}
        self._handles.clear()
        for p, launched_delta in launched.items():
            self._apply(p, launched_delta)
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    def _apply(self, p: torch.Tensor, launched: tuple[int, torch.Tensor, Any]) -> None:
        """Waits for the combined delta and sets ``p = start + delta``."""
        handle, _, ctx = launched
        delta = self._compression.decompress(synchronize(handle), ctx)
        start = self._start[p]
        start.add_(delta)
        p.data.copy_(start)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = _check_passes(passes)
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    def _gradient_ready(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        self._delay[p] -= 1
        self._handles[p] = self._launch(p) if self._delay[p] == 0 else None

    def _launch(self, p: torch.Tensor) -> tuple[int, torch.Tensor, Any]:
        """Steps the wrapped optimizer on ``p`` alone and starts the Adasum of the change."""
        start = self._start[p]
        stashed = [group["params"] for group in self._optimizer.param_groups]
        try:
            for group in self._optimizer.param_groups:
                group["params"] = [p] if any(p is q for q in group["params"]) else []
            start.copy_(p.data)
            self._optimizer.step()
        finally:
            for group, params in zip(self._optimizer.param_groups, stashed):
                group["params"] = params
        p.data.sub_(start)  # p now holds this rank's delta
        compressed, ctx = self._compression.compress(p.data)
        handle = allreduce_async_(compressed, name=self._names[p], op=ADASUM)
        return handle, compressed, ctx

    def synchronize(self) -> None:
        """Nothing to do: the Adasum optimizer combines weight changes in ``step()``."""

    def skip_synchronize(self) -> contextlib.AbstractContextManager[None]:
        """Not supported: Adasum combines weight changes, not gradients, inside ``step()``.

        Raises:
            AssertionError: always (as in Horovod).
        """
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finishes every parameter's local step and Adasum; returns the closure's loss, if any."""
        loss = closure() if closure is not None else None
        for p in self._params:  # the same order on every rank
            if self._handles.get(p) is None:
                self._handles[p] = self._launch(p)
        try:
            for p in self._params:
                launched = self._handles[p]
                assert launched is not None  # invariant: launched above
                self._apply(p, launched)
        finally:
            self._handles.clear()
            for p in self._delay:
                self._delay[p] = self.backward_passes_per_step
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients.

        Raises:
            AssertionError: called between ``backward()`` and ``step()``.
        """
        if self._handles:
            raise AssertionError(_ZERO_GRAD_MISUSE)
        self._optimizer.zero_grad(set_to_none)
