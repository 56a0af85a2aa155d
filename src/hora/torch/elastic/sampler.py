"""``ElasticSampler`` (``horovod.torch.elastic.sampler``): a sampler that re-splits what is left
of an epoch over the ranks of each new world."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
import torch.utils.data

from hora.core.api import rank, size


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
