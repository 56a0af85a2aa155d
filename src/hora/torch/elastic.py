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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Any

import torch
import torch.utils.data

from hora.core.api import rank, size
from hora.elastic import ObjectState, run
from hora.torch.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Splits a dataset between the ranks, and again over the new ranks after a reset,
    leaving out what this epoch already processed.

    Like ``DistributedSampler``, each rank takes every ``size()``-th index of the epoch's
    order (padded with the order's first indices so every rank has as many). After each
    batch, ``record_batch`` marks the batch as processed on every rank; when a
    ``TorchState`` holds the sampler, a commit keeps that record and a reset hands the
    indices not yet processed to the ranks of the new world, so none is processed twice
    or skipped.

    Use it so: keep it in the ``TorchState``; call ``record_batch`` after each batch (or
    ``record_indices`` with the indices processed); call ``set_epoch`` at the end of each
    epoch (not the start), which clears the record.

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
        self.processed_indices: set[int] = set()

        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0

        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch``: its own order when shuffling, and nothing processed.

        Call it at the end of an epoch, so that a reset in the middle of one does not
        process its samples again.

        Args:
            epoch: the epoch number.
        """
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Records that every rank processed its next batch of ``batch_size`` samples
        (all ranks call it together, as they train in step).

        Args:
            batch_idx: the batch's number in this pass over the sampler (used only once
                ``record_indices`` has been called this epoch).
            batch_size: the samples per batch on each rank.
        """
        if not self.processed_indices:
            # The ranks' batches so far are a prefix of the epoch's remaining order.
            self.processed_num += batch_size * self.num_replicas
            return
        padded = self._padded()
        start = batch_idx * batch_size * self.num_replicas
        end = min((batch_idx + 1) * batch_size, self.num_samples) * self.num_replicas
        self.processed_indices.update(padded[start:end])

    def record_indices(self, indices: Iterable[int]) -> None:
        """Records dataset indices that this rank processed. A ``TorchState`` commit
        gathers them from every rank.

        Args:
            indices: dataset indices.
        """
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's dataset indices in batch ``batch_idx`` of the current pass.

        Args:
            batch_idx: the batch's number in this pass over the sampler.
            batch_size: the samples per batch.

        Returns:
            The indices (fewer in a last, short batch).
        """
        start = batch_idx * batch_size
        return self.indices[start : min(start + batch_size, len(self.indices))]

    def state_dict(self) -> dict[str, Any]:
        """What a reset needs: the epoch and what of it was processed.

        Returns:
            ``epoch``, ``processed_num`` (as Horovod) and ``processed_indices``.
        """
        return dict(epoch=self.epoch, processed_num=self.processed_num, processed_indices=set(self.processed_indices))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Takes a ``state_dict()`` and re-splits what is left of the epoch.

        Args:
            state_dict: as returned by ``state_dict()`` (Horovod's, without
                ``processed_indices``, loads too).
        """
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.processed_indices = set(state_dict.get("processed_indices", ()))
        self.reset()

    def reset(self) -> None:
        """Splits the epoch's indices not yet processed over the current ``size()``
        ranks, taking this ``rank()``'s share."""
        self.num_replicas = size()
        self.rank = rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        processed = self.processed_indices
        self.remaining_indices = [i for i in order[self.processed_num :] if i not in processed]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.indices = self._padded()[self.rank : self.total_size : self.num_replicas]

    def _padded(self) -> list[int]:
        """The remaining order, padded with its first indices to ``total_size``."""
        padded = list(self.remaining_indices)
        while len(padded) < self.total_size:
            padded += self.remaining_indices[: self.total_size - len(padded)]
        return padded

    def __iter__(self) -> Iterator[int]:
        self.indices = self._padded()[self.rank : self.total_size : self.num_replicas]
        return iter(list(self.indices))

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
    ``broadcast_optimizer_state``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._saved_optimizer_state = copy.deepcopy(optimizer.state_dict())

    def save(self) -> None:
        self._saved_optimizer_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_optimizer_state)

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    """An ``ElasticSampler``: its ``state_dict()``; saving gathers every rank's recorded
    indices (a collective), syncing takes rank 0's state and re-splits."""

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self._saved_sampler_state = copy.deepcopy(sampler.state_dict())

    def save(self) -> None:
        state = copy.deepcopy(self.value.state_dict())
        state["processed_indices"] = set().union(*allgather_object(state["processed_indices"]))
        self._saved_sampler_state = state

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
