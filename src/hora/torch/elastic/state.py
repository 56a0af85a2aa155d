"""``TorchState`` and its handlers (``horovod.torch.elastic.state``): what an elastic PyTorch
job saves with ``commit()``, puts back with ``restore()`` and takes from rank 0 with ``sync()``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from hora.core.api import rank
from hora.elastic import ObjectState
from hora.torch.elastic.sampler import ElasticSampler
from hora.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from hora.torch.wrapper import WrappedOptimizer


class StateHandler:
    """How ``TorchState`` saves, restores and synchronizes one kind of object.

    Args:
        value: the object.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        """Keeps a copy of the object's state."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Puts the copy back."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Makes every rank's object rank 0's."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Adjusts the object to the new world after a reset (before any sync); by default nothing."""

    def set_value(self, value: Any) -> None:
        """Tracks another object instead, saving it at once.

        Args:
            value: the new object.
        """
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    """A ``torch.nn.Module``: its ``state_dict()``, broadcast with ``broadcast_parameters``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._saved_model_state = copy.deepcopy(model.state_dict())

    def save(self) -> None:
        self._saved_model_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_model_state)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    """A ``torch.optim.Optimizer``: its ``state_dict()``, broadcast with
    ``broadcast_optimizer_state``.

    A ``DistributedOptimizer`` with ``shard_optimizer_state`` keeps only this rank's
    slices, which a new world cannot rebuild from the survivors alone: its commits keep
    the whole state on every rank (``gather_state_dict``, a collective), and syncing
    after a reset splits the parameters over the new world and loads rank 0's copy of
    it (``reshard``). See docs/sharding.md.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        sharded = self._sharded()
        # A worker that joins a running job builds its state while the others sync: no
        # collective here unless a loaded state must be gathered (every rank then loaded it).
        if sharded is not None and not sharded.holds_state():
            self._saved_optimizer_state = sharded.empty_state_dict()
        else:
            self._saved_optimizer_state = self._current()

    def _sharded(self) -> Any:
        """The optimizer when it is sharded, else None."""
        optimizer = self.value
        return optimizer if isinstance(optimizer, WrappedOptimizer) and optimizer._shard_stage else None

    def _current(self) -> dict[str, Any]:
        sharded = self._sharded()
        if sharded is not None:
            return dict(sharded.gather_state_dict())  # fresh tensors: no copy needed
        return copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self._saved_optimizer_state = self._current()

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_optimizer_state)

    def reset(self) -> None:
        # The world changed: split the parameters over it now, from the last commit (every
        # survivor keeps the whole of it), also when no sync follows (hosts only removed).
        sharded = self._sharded()
        if sharded is not None:
            sharded.reshard(self._saved_optimizer_state)

    def sync(self) -> None:
        sharded = self._sharded()
        if sharded is None:
            broadcast_optimizer_state(self.value, root_rank=0)
            return
        saved = broadcast_object(self._saved_optimizer_state if rank() == 0 else None, root_rank=0)
        sharded.reshard(saved)
        self._saved_optimizer_state = saved


class SamplerStateHandler(StateHandler):
    """An ``ElasticSampler``: its ``state_dict()``; syncing takes rank 0's and re-splits."""

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self._saved_sampler_state = copy.deepcopy(sampler.state_dict())

    def save(self) -> None:
        self._saved_sampler_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_sampler_state)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))


_handler_registry: list[tuple[type, Callable[[Any], StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, Callable[[Any], StateHandler]]]:
    """The (type, handler class) pairs ``TorchState`` tries, in order.

    Returns:
        The registry list itself.
    """
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, Callable[[Any], StateHandler]]]) -> None:
    """Replaces the (type, handler class) pairs ``TorchState`` tries.

    Args:
        registry: the new pairs, in order.
    """
    global _handler_registry
    _handler_registry = registry


def _split_handlers(kwargs: dict[str, Any]) -> tuple[dict[str, StateHandler], dict[str, Any]]:
    handlers: dict[str, StateHandler] = {}
    plain: dict[str, Any] = {}
    for name, value in kwargs.items():
        for kind, handler_class in _handler_registry:
            if isinstance(value, kind):
                handlers[name] = handler_class(value)
                break
        else:
            plain[name] = value
    return handlers, plain


class TorchState(ObjectState):
    """The state of a PyTorch training process.

    Models, optimizers and ``ElasticSampler`` objects (under any keyword) are saved as
    deep copies of their ``state_dict()`` and synchronized from rank 0 with
    ``broadcast_parameters``, ``broadcast_optimizer_state`` and ``broadcast_object``;
    other keywords are plain objects, as in ``ObjectState``. Every keyword becomes an
    attribute; assigning a new model, optimizer or sampler to one saves it at once.

    Args:
        model: a ``torch.nn.Module``, or None.
        optimizer: a ``torch.optim.Optimizer`` (a ``DistributedOptimizer`` too), or None.
        **kwargs: more objects to track, by attribute name.
    """

    def __init__(
        self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any
    ) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        self._handlers, plain = _split_handlers(kwargs)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=_broadcast, get_rank=rank, **plain)

    def save(self) -> None:
        """Saves every tracked object (a collective when a sampler is tracked)."""
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        """Puts back the last saved state of every tracked object."""
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def reset(self) -> None:
        """Lets every tracked object adjust to the new world (a sharded optimizer is split over it)."""
        for handler in self._handlers.values():
            handler.reset()
        super().reset()

    def sync(self) -> None:
        """Makes every rank's objects rank 0's (collectives).

        Raises:
            HoraInternalError: a broadcast failed.
        """
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self, name) and name in self.__dict__.get("_handlers", {}):
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)


def _broadcast(obj: Any) -> Any:
    return broadcast_object(obj, root_rank=0)

