"""Elastic data-parallel training of a small CNN on scikit-learn's digits, with hora.torch.

The elastic version of train_digits.py, with the Horovod lines marked "hora:". The
training function runs under ``hvd.elastic.run``: when a worker dies, the survivors
restore the last commit, join the next, smaller world and carry on; when hosts are
added, the job grows at the next commit. ``TorchState`` holds the model, the optimizer,
the ``ElasticSampler`` (which re-splits what is left of the epoch over the new ranks)
and the epoch; it is committed every few batches. A reset callback rescales the
learning rate by the new number of ranks. Rank 0 prints progress and the final test
accuracy.

    printf 'localhost:2\\n127.0.0.1:2\\n' > hosts.txt
    printf '#!/bin/sh\\ncat hosts.txt\\n' > discover.sh && chmod +x discover.sh
    horarun -np 4 --min-np 2 --host-discovery-script ./discover.sh \\
        python examples/pytorch/elastic_digits.py

Kill a worker (``pkill -9 -f elastic_digits.py -n``) and the job goes on with the
ranks left; edit hosts.txt and it follows the hosts listed.
"""

from __future__ import annotations

import argparse

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
    parser.add_argument("--batches-per-commit", type=int, default=5, help="commit the state every N batches")
    args = parser.parse_args()

    hvd.init()  # hora:
    # hora: one thread per worker: the "hosts" of an elastic job may share a machine.
    torch.set_num_threads(1)

    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    train_set = torch.utils.data.TensorDataset(x_train, y_train)
    # hora: the elastic sampler gives each rank its share of what is left of the epoch, again after a reset.
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(hvd.rank())  # deliberately different initial weights on each rank...
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)  # hora: lr * size()
    # hora: average gradients over the ranks.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def on_state_reset() -> None:
        # hora: in a new world, rescale the learning rate by the new size() and split what is
        # left of the epoch over the new ranks.
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        sampler.reset()

    # hora: what survives a failure; ...train() starts by giving every rank rank 0's state.
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    state.register_reset_callbacks([on_state_reset])

    def test_accuracy() -> float:
        # hora: each rank counts every size()-th test example; the counts are summed over the ranks.
        x_shard, y_shard = x_test[hvd.rank() :: hvd.size()], y_test[hvd.rank() :: hvd.size()]
        state.model.eval()
        with torch.no_grad():
            correct = (state.model(x_shard).argmax(1) == y_shard).sum()
        counts = hvd.allreduce(torch.stack([correct, torch.tensor(len(y_shard))]), op=hvd.Sum, name="counts")
        return counts[0].item() / counts[1].item()

    @hvd.elastic.run  # hora: on a failure, restore the last commit, join the next world and call again.
    def train(state: hvd.elastic.TorchState) -> float:
        while state.epoch < args.epochs:
            state.model.train()
            total_loss, batches = 0.0, 0
            for batch_idx, (data, target) in enumerate(loader):
                state.optimizer.zero_grad()
                loss = F.cross_entropy(state.model(data), target)
                loss.backward()
                state.optimizer.step()
                total_loss, batches = total_loss + loss.item(), batches + 1
                # hora: count the samples the job processed, and commit every few batches.
                state.sampler.record_batch(batch_idx, args.batch_size)
                if (batch_idx + 1) % args.batches_per_commit == 0:
                    state.commit()
            # hora: average the loss over the ranks (their batches since the epoch (re)started).
            loss_avg = hvd.allreduce(torch.tensor(total_loss / max(1, batches)), name="loss").item()
            accuracy = test_accuracy()
            if hvd.rank() == 0:
                print(
                    f"epoch {state.epoch + 1:2d}  loss {loss_avg:.4f}  test accuracy {accuracy:.3f}"
                    f"  ({hvd.size()} ranks)",
                    flush=True,
                )
            # hora: the epoch is done: the next one starts its own order, and the state is committed.
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return test_accuracy()

    accuracy = train(state)
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.3f} on {hvd.size()} ranks", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
