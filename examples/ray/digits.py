"""Data-parallel training of a small MLP on scikit-learn's digits, with hora.torch on Ray.

The training function is a single-process PyTorch loop plus the Horovod lines (marked
"hora:"); ``RayExecutor`` runs it on 2 Ray actors, one rank each, and returns every
rank's result. Each rank trains on its own shard of the training set,
DistributedOptimizer averages the gradients, rank 0's initial weights are broadcast,
and the test accuracy is summed over the ranks' shards of the test set.

    python examples/ray/digits.py                      # starts a local Ray instance
    python examples/ray/digits.py --address auto       # joins a running Ray cluster
"""

from __future__ import annotations

import argparse
from typing import Any


def train(epochs: int = 15, batch_size: int = 32, lr: float = 0.05) -> dict[str, Any]:
    """One rank's training; returns its rank, the job's size and the final test accuracy."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import hora.torch as hvd

    hvd.init()  # hora: the executor gave this actor its rank and the job's rendezvous
    torch.set_num_threads(1)  # hora: one core per rank

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    # hora: each rank keeps every size()-th example, of the training and of the test set.
    x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    x_test_shard, y_test_shard = x_test[hvd.rank() :: hvd.size()], y_test[hvd.rank() :: hvd.size()]

    torch.manual_seed(hvd.rank())  # deliberately different initial weights on each rank...
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)  # hora: lr * size()
    # hora: average gradients over the ranks; ...start from rank 0's weights and optimizer state.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    steps = len(x_train) // hvd.size() // batch_size  # the same number of steps on every rank
    accuracy = 0.0
    for epoch in range(1, epochs + 1):
        model.train()
        order = torch.randperm(len(x_shard), generator=torch.Generator().manual_seed(1000 * epoch + hvd.rank()))
        for step in range(steps):
            batch = order[step * batch_size : (step + 1) * batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(x_shard[batch]), y_shard[batch]).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            correct = (model(x_test_shard).argmax(1) == y_test_shard).sum()
        # hora: sum the test counts over the ranks.
        counts = hvd.allreduce(torch.stack([correct, torch.tensor(len(y_test_shard))]), op=hvd.Sum, name="counts")
        accuracy = counts[0].item() / counts[1].item()
        if hvd.rank() == 0 and (epoch % 5 == 0 or epoch == epochs):
            print(f"epoch {epoch:2d}  test accuracy {accuracy:.3f}", flush=True)
    result = {"rank": hvd.rank(), "size": hvd.size(), "accuracy": accuracy}
    hvd.shutdown()
    return result


def run(num_workers: int = 2, epochs: int = 15, executor: Any = None) -> list[dict[str, Any]]:
    """Trains on ``num_workers`` Ray actors (Ray must be initialized); returns every rank's result.

    ``executor``: a started ``RayExecutor`` to train on instead (its size wins).
    """
    from hora.ray import RayExecutor

    if executor is not None:
        return executor.run(train, kwargs={"epochs": epochs})
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=num_workers)
    executor.start()
    try:
        return executor.run(train, kwargs={"epochs": epochs})
    finally:
        executor.shutdown()


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--address", default=None, help="a Ray cluster to join (default: start one here)")
    args = parser.parse_args()
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_workers, include_dashboard=False)
    try:
        results = run(args.num_workers, args.epochs)
    finally:
        ray.shutdown()
    print(f"final test accuracy {results[0]['accuracy']:.3f} on {results[0]['size']} ranks")


if __name__ == "__main__":
    main()
