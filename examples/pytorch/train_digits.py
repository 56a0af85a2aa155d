"""Data-parallel training of a small CNN on scikit-learn's digits, with hora.torch.

A single-process PyTorch script plus the Horovod lines (marked "hora:"): each rank
trains on its own shard of the training set, DistributedOptimizer averages the
gradients during backward, rank 0's initial weights are broadcast, and the test
accuracy is summed over the ranks' shards of the test set. Rank 0 prints progress.

    horarun -np 2 python examples/pytorch/train_digits.py
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hora.torch as hvd


class Net(torch.nn.Module):
    """Two 3x3 convolutions on the 8x8 images, then two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by the number of ranks")
    args = parser.parse_args()

    hvd.init()  # hora:
    # hora: share the machine's cores among the ranks on it.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))

    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    # hora: each rank keeps every size()-th example, of the training and of the test set.
    x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    x_test_shard, y_test_shard = x_test[hvd.rank() :: hvd.size()], y_test[hvd.rank() :: hvd.size()]

    torch.manual_seed(hvd.rank())  # deliberately different initial weights on each rank...
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)  # hora: lr * size()
    # hora: average gradients over the ranks, and start from rank 0's weights and optimizer state.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # The same number of steps on every rank (shards differ by at most one example).
    steps = len(x_train) // hvd.size() // args.batch_size
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(x_shard), generator=torch.Generator().manual_seed(1000 * epoch + hvd.rank()))
        total_loss = 0.0
        for step in range(steps):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_shard[batch]), y_shard[batch])
            loss.backward()
            optimizer.step()
            total_loss += loss.item()
        model.eval()
        with torch.no_grad():
            correct = (model(x_test_shard).argmax(1) == y_test_shard).sum()
        # hora: sum the loss and the test counts over the ranks.
        loss_avg = hvd.allreduce(torch.tensor(total_loss / steps), name="loss").item()
        counts = hvd.allreduce(torch.stack([correct, torch.tensor(len(y_test_shard))]), op=hvd.Sum, name="counts")
        accuracy = counts[0].item() / counts[1].item()
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}  loss {loss_avg:.4f}  test accuracy {accuracy:.3f}", flush=True)
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.3f} on {hvd.size()} ranks")
    hvd.shutdown()


if __name__ == "__main__":
    main()
