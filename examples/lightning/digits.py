"""Data-parallel Lightning training of an MLP on scikit-learn's digits, with hora.lightning.

A plain Lightning script plus the hora lines (marked "hora:"): the Trainer runs
``strategy="hora"``, one process per device, all started by ``horarun``. Lightning gives
each rank its shard of every epoch (a DistributedSampler), hora's DistributedOptimizer
averages the gradients during backward, rank 0's initial weights reach every rank, and
``sync_dist=True`` sums the test counts over the ranks. Rank 0 prints progress.

    horarun -np 2 python examples/lightning/digits.py
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import hora.lightning  # noqa: F401 - hora: registers Trainer(strategy="hora")
import hora.torch as hvd


class DigitsMLP(L.LightningModule):
    """Two hidden layers on the flattened 8x8 images; SGD with momentum."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
            torch.nn.Linear(64, 10),
        )  # fmt: skip
        self.epoch_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.epoch_losses.append(loss.item())
        return loss

    def on_train_epoch_end(self) -> None:
        # hora: average this rank's mean loss over the ranks (a collective: every rank calls it).
        loss = self.trainer.strategy.reduce(torch.tensor(sum(self.epoch_losses) / len(self.epoch_losses)))
        self.epoch_losses.clear()
        if self.trainer.is_global_zero:
            print(f"epoch {self.current_epoch + 1:2d}  loss {loss.item():.4f}", flush=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        correct = (self(x).argmax(1) == y).sum().float()
        # hora: sum the counts over the batches and over the ranks.
        self.log("correct", correct, reduce_fx="sum", sync_dist=True)
        self.log("seen", torch.tensor(float(len(y))), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    hvd.init()  # hora: (the strategy would start hora too; the thread count needs local_size first)
    # hora: share the machine's cores among the ranks on it.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    # Quiet Lightning: no device banner, and no advice that does not apply here (a DataLoader
    # without workers is right for data in memory; this is not a Slurm job; the test set of
    # 450 images splits evenly over 2 ranks, so the test sampler repeats none).
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    for advice in (
        "does not have many workers", "The `srun` command is available", "isinstance\\(treespec",
        "Using `DistributedSampler` with the dataloaders",
    ):  # fmt: skip
        warnings.filterwarnings("ignore", f".*{advice}.*")

    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    train = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size, shuffle=True)
    # Lightning shards the test set too: each rank evaluates its share of the 450 images.
    test = DataLoader(TensorDataset(x_test, y_test), batch_size=256)

    torch.manual_seed(hvd.rank())  # deliberately different initial weights: the strategy starts all from rank 0's
    model = DigitsMLP(lr=args.lr)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            strategy="hora",  # hora:
            accelerator="cpu",
            devices=1,  # hora: one device per process; horarun -np N starts N processes
            max_epochs=args.epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        trainer.fit(model, train)
        metrics = trainer.test(model, test, verbose=False)[0]
    accuracy = metrics["correct"] / metrics["seen"]
    if trainer.is_global_zero:
        print(f"test accuracy {accuracy:.3f} on {trainer.world_size} ranks", flush=True)


if __name__ == "__main__":
    main()
