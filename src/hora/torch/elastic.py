"""Elastic training with PyTorch (``horovod.torch.elastic``): ``run``, ``TorchState``,
``ElasticSampler``.

    import hora.torch as hvd

    hvd.init()
    sampler = hvd.elastic.ElasticSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch_idx, (x, y) in enumerate(loader):
                ...
                state.sampler.record_batch(batch_idx, 32)
                if batch_idx % 10 == 0:
                    state.commit()
            state.sampler.set_epoch(state.epoch + 1)
            state.commit()

    train(state)

A reset re-initializes hora (``shutdown()`` then ``init()``); hora has no elastic driver
yet, so today that is the same world again.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

import torch
import torch.utils.data

from hora.core.api import rank, size
from hora.elastic import ObjectState, run
from hora.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from hora.torch.wrapper import WrappedOptimizer


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Splits a dataset between the ranks, and again over the new ranks after a reset,
    leaving out what this epoch already processed (Horovod's ``ElasticSampler``).

    Like ``DistributedSampler``, each rank takes every ``size()``-th index of the epoch's
    order (padded with the order's first indices so every rank has as many). Every rank
    calls ``record_batch`` after each batch, counting the samples the job processed;
    when a ``TorchState`` holds the sampler, a commit keeps that count and a reset
    hands the rest of the epoch's order to the ranks of the new world, so no sample is
    processed twice or skipped. Call ``set_epoch`` at the end of each epoch (not the
    start): it starts the count again.

    Args:
        dataset: the dataset (its length must not change).
        shuffle: shuffle the order, differently each epoch, the same on every rank.
        seed: the shuffle's seed; the same on every rank.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed

        self.epoch = 0
        self.processed_num = 0

        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0

        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch``: its own order when shuffling, and nothing processed.

        Args:
            epoch: the epoch number.
        """
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Records that every rank processed its next batch of ``batch_size`` samples
        (all ranks call it together, as they train in step). It takes effect at the
        next ``reset`` or ``load_state_dict``, as in Horovod.

        Args:
            batch_idx: the batch's number (unused, as in Horovod).
            batch_size: the samples per batch on each rank.
        """
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """Returns ``epoch`` and ``processed_num``: what a reset needs."""
        return dict(epoch=self.epoch, processed_num=self.processed_num)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Takes a ``state_dict()`` and re-splits what is left of the epoch."""
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Splits the epoch's order past the processed samples over the current
        ``size()`` ranks, taking this ``rank()``'s share."""
        self.num_replicas = size()
        self.rank = rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)  # the same order on every rank
        self.remaining_indices = order[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        padded = list(self.remaining_indices)
        while len(padded) < self.total_size:
            padded += self.remaining_indices[: self.total_size - len(padded)]
        self.indices = padded[self.rank : self.total_size : self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


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


__all__ = ["ElasticSampler", "TorchState", "run"]
