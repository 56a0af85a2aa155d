"""The allreduce DistributedOptimizer: averages gradients across ranks while the backward pass runs.

``DistributedOptimizer(optimizer, ...)`` wraps the user's optimizer instead of
generating a subclass of it at run time. The wrapper *is* the same optimizer as far
as the rest of PyTorch can tell: its ``param_groups``, ``state`` and ``defaults`` are
the wrapped optimizer's own objects, ``isinstance(opt, torch.optim.SGD)`` holds for a
wrapped SGD (as it does with Horovod), step hooks and ``state_dict`` go to the wrapped
optimizer, and LR schedulers bind to the wrapper and change the shared ``lr``.

A post-accumulate-grad hook on every parameter starts the allreduce of its gradient
(in place, asynchronously) as soon as backward has accumulated it, so communication
overlaps the rest of the backward pass and the engine fuses the gradients that are
ready together. ``step()`` waits for them, then steps the wrapped optimizer. Where
overlapping only takes CPU that backward needs (``hora.core.api.gradient_overlap``),
the hook only counts the gradient, and ``synchronize()`` starts every one in one batch.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from hora.core.api import broadcast_object, current, gradient_overlap, size, synchronize
from hora.collectives.reduce import AVERAGE
from hora.compression import Compressor
from hora.errors import HoraInternalError
from hora.core.process_sets import ProcessSet
from hora.torch.collectives import allreduce_async_, grouped_allreduce_async_, sparse_allreduce_async
from hora.torch.dynamo import outside_compile
from hora.torch.wrapper import (
    _TOO_MANY_PASSES,
    _ZERO_GRAD_MISUSE,
    Handle,
    WrappedOptimizer,
    _check_gradient,
    _trainable,
)

Unit = tuple[torch.Tensor, ...]
"""The parameters whose gradients travel in one collective: one parameter, or one group."""


def drain(handles: Iterable[Handle]) -> None:
    """Waits for the collectives an optimizer abandons (a reset, a state load), dropping their errors.

    They run on every rank, so each is waited for, which frees its name. Horovod drops
    such handles without waiting, so it raises nothing here: neither does hora. Their
    errors go with them (a rank lost mid-step, before an elastic ``state.restore()``);
    a job that is broken fails at its next collective.

    Args:
        handles: handles of ``synchronize``, or callables that wait (a sparse or
            Adasum gradient's).
    """
    for handle in handles:
        try:
            handle() if callable(handle) else synchronize(handle)
        except HoraInternalError:
            pass


class _DistributedOptimizer(WrappedOptimizer):
    """Gradient allreduce around a wrapped optimizer (see ``DistributedOptimizer``).

    Besides the attributes every wrapper has (``WrappedOptimizer``), it has Horovod's
    ``op``, ``gradient_predivide_factor``, ``sparse_as_dense``, ``process_set``,
    ``_groups`` (the ``groups`` argument, or ``num_groups``), ``_p_to_group``
    (``{parameter: its group}``) and ``_group_counts`` (``{group: gradients ready}``),
    the last two filled only with ``groups``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[Any] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: int,
        gradient_predivide_factor: float,
        groups: int | list[list[torch.Tensor]] | None,
        sparse_as_dense: bool,
        process_set: ProcessSet,
    ) -> None:
        super().__init__(optimizer, named_parameters, compression, backward_passes_per_step)
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._groups = _check_groups(groups)
        # Each gradient's allreduce waits for synchronize() (then all start at once) where
        # overlapping them with backward would only cost CPU (hora.core.api.gradient_overlap).
        self._deferred = self._groups is None and not gradient_overlap()
        self._p_to_group: dict[torch.Tensor, Unit] = {}
        self._group_counts: dict[Unit, int] = {}
        # Every reduced parameter in exactly one unit; the same units in the same order on
        # every rank, so synchronize() launches what is missing in one order everywhere.
        self._units: list[Unit] = []
        # As Horovod: a single rank reduces nothing unless the job is elastic (it may grow).
        self._active = bool(process_set.included()) and (size() > 1 or current().config.elastic)
        if self._active:
            self._register(_trainable(optimizer))

    # ----- set-up -----

    def _register(self, params: list[torch.Tensor]) -> None:
        params = [p for p in params if p not in self._requires_update]
        if not params:
            return
        if self._groups is None:
            units: list[Unit] = [(p,) for p in params]
        else:
            units = self._form_groups(params)
            for unit in units:
                for p in unit:
                    self._p_to_group[p] = unit
                self._group_counts[unit] = 0
        self._units.extend(units)
        for p in params:
            self._watch(p)

    def _form_groups(self, params: list[torch.Tensor]) -> list[Unit]:
        # Every rank orders the parameters as rank 0 does, so groups match across ranks.
        names = self._parameter_names
        order = broadcast_object([names[p] for p in params], root_rank=0, process_set=self.process_set)
        position = {name: i for i, name in enumerate(order)}
        missing = [names[p] for p in params if names[p] not in position]
        if missing:
            raise ValueError(f"DistributedOptimizer groups: parameters {missing} are not named on rank 0")
        params = sorted(params, key=lambda p: position[names[p]])
        if isinstance(self._groups, list):
            ids = {id(p) for p in params}
            units = [tuple(p for p in group if id(p) in ids) for group in self._groups]
            grouped = {id(p) for unit in units for p in unit}
            units += [(p,) for p in params if id(p) not in grouped]
        else:
            units = [tuple(chunk) for chunk in _split_list(params, int(self._groups or 1))]
        return [unit for unit in units if unit]

    def _on_new_params(self, params: list[torch.Tensor]) -> None:
        if self._active:
            self._register([p for p in params if p.requires_grad])

    def _reset(self) -> None:
        # Allreduces already started run on every rank: let them finish, so their names are free.
        launched = [handle for handle, _ in self._handles.values() if handle is not None]
        self._handles.clear()
        drain(launched)
        self._synchronized = False
        self._should_synchronize = True
        self._reset_delays()
        for unit in self._group_counts:
            self._group_counts[unit] = 0

    # ----- during backward -----

    def _gradient_ready(self, p: torch.Tensor) -> None:
        """Counts one backward pass of ``p``; starts its (or its group's) allreduce on the last.

        Raises:
            AssertionError: the gradient requires grad, or more backward passes than
                ``backward_passes_per_step`` before ``step()`` (Horovod's assertions).
        """
        _check_gradient(p)
        if self._allreduce_delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        self._allreduce_delay[p] -= 1
        if self._allreduce_delay[p] == 0 and not self._deferred:
            if self._groups is None:
                self._handles[p] = self._launch((p,))
                return
            group = self._p_to_group[p]
            self._group_counts[group] += 1
            if self._group_counts[group] == len(group):
                self._handles[group] = self._launch(group)
                for member in group:  # Horovod keys a group's members alone until it starts
                    self._handles.pop(member, None)
                self._group_counts[group] = 0
                return
        self._handles[p] = (None, None)

    def _scales(self) -> tuple[float, float]:
        if self.op == AVERAGE:
            # Split the average between the two sides of the sum (the core divides by the size).
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _launch(self, unit: Unit) -> tuple[Handle, Any]:
        """Starts the allreduce of the unit's gradients (zeros for a parameter without one).

        Returns:
            ``(handle, ctx)`` as ``_handles`` holds them: the compression context, a
            tuple of them for a group, None for a sparse allreduce (a callable handle).
        """
        for p in unit:
            if p.grad is None:
                # No gradient on this rank this step; other ranks may have one.
                p.grad = torch.zeros_like(p)
        name = self._parameter_names[unit[0]]
        prescale, postscale = self._scales()
        if self._groups is None:
            grad = unit[0].grad
            assert grad is not None  # invariant: set above
            if grad.is_sparse and not self.sparse_as_dense:
                return sparse_allreduce_async(grad, name=name, op=self.op, process_set=self.process_set), None
            compressed, ctx = self._compression.compress(_dense(grad))
            handle = allreduce_async_(
                compressed, name=name, op=self.op, prescale_factor=prescale, postscale_factor=postscale,
                process_set=self.process_set,
            )  # fmt: skip
            return handle, ctx
        sends, contexts = [], []
        for p in unit:
            grad = p.grad
            assert grad is not None  # invariant: set above
            if grad.is_sparse and not self.sparse_as_dense:
                raise ValueError(
                    f"DistributedOptimizer: parameter '{self._parameter_names[p]}' has a sparse gradient and is in "
                    "a group; grouped allreduce needs dense gradients (pass sparse_as_dense=True)"
                )
            compressed, ctx = self._compression.compress(_dense(grad))
            sends.append(compressed)
            contexts.append(ctx)
        handle = grouped_allreduce_async_(
            sends, name=name, op=self.op, prescale_factor=prescale, postscale_factor=postscale,
            process_set=self.process_set,
        )  # fmt: skip
        return handle, tuple(contexts)

    def _finish(self, unit: Unit, handle: Handle, ctx: Any) -> None:
        """Waits for the unit's allreduce and writes the results into its gradients, in place."""
        if callable(handle):  # a sparse allreduce: its result needs no decompression
            aggregated = [handle()]
        else:
            result = synchronize(handle)
            results = result if self._groups is not None else [result]
            contexts = ctx if self._groups is not None else (ctx,)
            aggregated = [self._compression.decompress(r, c) for r, c in zip(results, contexts)]
        for p, reduced in zip(unit, aggregated):
            grad = p.grad
            assert grad is not None  # invariant: set at launch
            # The gradient tensor stays the same object (as in Horovod); only its values change.
            if grad.is_sparse:
                grad.zero_().add_(reduced if reduced.is_sparse else reduced.to_sparse())
            elif reduced is not grad:
                grad.copy_(reduced)

    # ----- step -----

    @outside_compile
    def synchronize(self) -> None:
        """Waits for every gradient's allreduce and writes the results into ``p.grad``.

        Gradients whose allreduce has not started (a parameter unused this step, or
        fewer backward passes than ``backward_passes_per_step``) are reduced now.
        """
        if not self.process_set.included() or not self._active:
            self._synchronized = True
            return
        grouped = self._groups is not None
        try:
            # Deferred gradients go to the engine in one batch: negotiated and fused as one.
            with current().batch() if self._deferred else contextlib.nullcontext():
                for unit in self._units:  # the same order on every rank
                    key = unit if grouped else unit[0]
                    launched = self._handles.get(key)
                    if launched is None or launched[0] is None:
                        self._handles[key] = self._launch(unit)
                        if grouped:
                            for member in unit:
                                self._handles.pop(member, None)
            for unit in self._units:
                handle, ctx = self._handles[unit if grouped else unit[0]]
                self._finish(unit, handle, ctx)
        finally:
            self._handles.clear()
            self._reset_delays()
            for group in self._group_counts:
                self._group_counts[group] = 0
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """A context in which ``step()`` does not synchronize; use it after an explicit ``synchronize()``::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _synchronize_for_step(self, closure: Callable[[], Any] | None) -> None:
        """What ``step()`` does first: warns (as Horovod) when ``synchronize()`` already ran
        outside ``skip_synchronize()``, and waits for the gradients unless a closure is
        about to compute them."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.",
                    stacklevel=3,
                )
            if self._handles or closure is None:
                self.synchronize()
        self._synchronized = False

    @outside_compile
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Waits for the gradients' allreduces, then steps the wrapped optimizer.

        With a ``closure`` (which recomputes the loss and gradients), the gradients the
        closure computes are reduced before the wrapped optimizer uses them.
        """
        self._synchronize_for_step(closure)
        if closure is None or not self._should_synchronize:
            return self._optimizer.step(closure)

        def synchronized_closure() -> Any:
            loss = closure()
            self.synchronize()
            self._synchronized = False
            return loss

        return self._optimizer.step(synchronized_closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients.

        Raises:
            AssertionError: gradients are still being reduced (called between
                ``backward()`` and ``step()``/``synchronize()``).
        """
        if self._handles:
            raise AssertionError(_ZERO_GRAD_MISUSE)
        self._optimizer.zero_grad(set_to_none)


def _dense(grad: torch.Tensor) -> torch.Tensor:
    """The gradient as the in-place allreduce takes it: dense and contiguous (a copy if it is not)."""
    if grad.is_sparse:
        return grad.to_dense()
    return grad if grad.is_contiguous() else grad.contiguous()


def _check_groups(groups: int | list[list[torch.Tensor]] | None) -> int | list[list[torch.Tensor]] | None:
    if groups is None:
        return None
    if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        seen: set[int] = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
    return groups


def _split_list(items: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
    """Splits into ``n`` nearly equal consecutive chunks (the first ones one longer)."""
    q, r = divmod(len(items), n)
    return [items[i * q + min(i, r) : (i + 1) * q + min(i + 1, r)] for i in range(n)]
