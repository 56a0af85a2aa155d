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
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import torch

from hora.core.api import synchronize
from hora.collectives.reduce import ADASUM
from hora.compression import Compressor
from hora.torch.collectives import allreduce_async_
from hora.torch.dynamo import outside_compile
from hora.torch.wrapper import (
    _TOO_MANY_PASSES,
    _ZERO_GRAD_MISUSE,
    Handle,
    WrappedOptimizer,
    _check_gradient,
    _trainable,
)

_NO_SKIP = "Skipping synchronization is not supported when using Adasum optimizer."


class _RefusedContext(contextlib.AbstractContextManager[None]):
    """What Adasum's ``skip_synchronize()`` returns: entering it raises, as Horovod's does."""

    def __enter__(self) -> None:
        raise AssertionError(_NO_SKIP)

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        return None


class _DistributedAdasumOptimizer(WrappedOptimizer):
    """Adasum of per-rank weight changes around a wrapped optimizer (see ``DistributedOptimizer``).

    Besides the attributes every wrapper has (``WrappedOptimizer``; ``_handles`` is keyed
    by parameter), it has Horovod's ``_starting_models``: ``{parameter: its value before
    this step's local update}``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[Any] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
    ) -> None:
        super().__init__(optimizer, named_parameters, compression, backward_passes_per_step)
        self._starting_models: dict[torch.Tensor, torch.Tensor] = {
            p: torch.zeros_like(p, requires_grad=False) for p in self._parameter_names
        }
        self._params: list[torch.Tensor] = []  # the reduced parameters, in the same order on every rank
        self._register(_trainable(optimizer))

    def _register(self, params: list[torch.Tensor]) -> None:
        for p in params:
            if p in self._requires_update:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._params.append(p)
            self._starting_models.setdefault(p, torch.zeros_like(p, requires_grad=False))
            self._watch(p)

    def _on_new_params(self, params: list[torch.Tensor]) -> None:
        self._register([p for p in params if p.requires_grad])

    def _reset(self) -> None:
        # Deltas already in flight run on every rank: apply them, so parameters are weights again.
        launched = {p: entry for p, entry in self._handles.items() if entry[0] is not None}
        self._handles.clear()
        for p, (handle, ctx) in launched.items():
            self._apply(p, handle, ctx)
        self._reset_delays()

    def _apply(self, p: torch.Tensor, handle: Handle, ctx: Any) -> None:
        """Waits for the combined delta and sets ``p = start + delta``."""
        delta = self._compression.decompress(synchronize(handle), ctx)
        start = self._starting_models[p]
        start.add_(delta)
        p.data.copy_(start)

    def _gradient_ready(self, p: torch.Tensor) -> None:
        """Counts one backward pass of ``p``; steps it and starts the Adasum of its change on the last.

        Raises:
            AssertionError: the gradient requires grad, or more backward passes than
                ``backward_passes_per_step`` before ``step()`` (Horovod's assertions).
        """
        _check_gradient(p)
        if self._allreduce_delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        self._allreduce_delay[p] -= 1
        self._handles[p] = self._launch(p) if self._allreduce_delay[p] == 0 else (None, None)

    def _launch(self, p: torch.Tensor) -> tuple[Handle, Any]:
        """Steps the wrapped optimizer on ``p`` alone and starts the Adasum of the change.

        Returns:
            ``(handle, compression context)``, as ``_handles`` holds them.
        """
        start = self._starting_models[p]
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
        return allreduce_async_(compressed, name=self._parameter_names[p], op=ADASUM), ctx

    @outside_compile
    def synchronize(self) -> None:
        """Nothing to do: the Adasum optimizer combines weight changes in ``step()``."""

    def skip_synchronize(self) -> contextlib.AbstractContextManager[None]:
        """Not supported: Adasum combines weight changes, not gradients, inside ``step()``.

        Returns:
            A context manager whose entry raises ``AssertionError`` (as Horovod's does).
        """
        return _RefusedContext()

    @outside_compile
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finishes every parameter's local step and Adasum; returns the closure's loss, if any."""
        loss = closure() if closure is not None else None
        try:
            for p in self._params:  # the same order on every rank
                launched = self._handles.get(p)
                if launched is None or launched[0] is None:
                    self._handles[p] = self._launch(p)
            for p in self._params:
                handle, ctx = self._handles[p]
                self._apply(p, handle, ctx)
        finally:
            self._handles.clear()
            self._reset_delays()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients.

        Raises:
            AssertionError: called between ``backward()`` and ``step()``.
        """
        if self._handles:
            raise AssertionError(_ZERO_GRAD_MISUSE)
        self._optimizer.zero_grad(set_to_none)
