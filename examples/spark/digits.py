"""Data-parallel training of a small MLP on scikit-learn's digits, with hora.torch, run by Spark.

The training function is a single-process PyTorch loop plus the Horovod lines (marked
"hora:"): each rank trains on its own shard of the training set, DistributedOptimizer
averages the gradients during backward, rank 0's initial weights are broadcast, and
the test accuracy is summed over the ranks' shards of the test set. ``hora.spark.run``
runs it on 2 ranks, one per Spark task, and returns each rank's final accuracy; rank 0
prints progress, which reaches this driver's stdout as ``[0]<stdout>:...`` lines.

    python examples/spark/digits.py                          # a local-cluster[2,1,1024]
    python examples/spark/digits.py --master local[2]        # or any master with 2 free task slots
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def train(epochs: int = 20, batch_size: int = 32, lr: float = 0.05) -> float:
    """Trains on this rank's shard and returns the test accuracy over every rank's shard.

    Runs on each rank (a process a Spark task started), so it imports what it needs here.
    """
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import hora.torch as hvd

    hvd.init()  # hora:
    # hora: share the machine's cores among the ranks on it.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))

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
    # hora: average gradients over the ranks, and start from rank 0's weights and optimizer state.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # The same number of steps on every rank (shards differ by at most one example).
    steps = len(x_train) // hvd.size() // batch_size
    accuracy = 0.0
    for epoch in range(1, epochs + 1):
        model.train()
        order = torch.randperm(len(x_shard), generator=torch.Generator().manual_seed(1000 * epoch + hvd.rank()))
        total_loss = 0.0
        for step in range(steps):
            batch = order[step * batch_size : (step + 1) * batch_size]
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
    hvd.shutdown()
    return accuracy


def run_on_spark(num_proc: int = 2, **train_kwargs: Any) -> list[float]:
    """Runs ``train`` on ``num_proc`` ranks of the active SparkSession; returns each rank's accuracy."""
    import hora.spark

    return hora.spark.run(train, kwargs=train_kwargs, num_proc=num_proc, env={"OMP_NUM_THREADS": "1"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", default="local-cluster[2,1,1024]", help="Spark master URL")
    parser.add_argument("--num-proc", type=int, default=2, help="ranks (one Spark task each)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by the number of ranks")
    args = parser.parse_args()

    # Spark's Python workers, and so the ranks they start, run this interpreter.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(args.master)
        .appName("hora-spark-digits")
        .config("spark.ui.enabled", "false")
        .config("spark.executor.memory", "512m")
        .getOrCreate()
    )
    try:
        accuracies = run_on_spark(args.num_proc, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr)
    finally:
        spark.stop()
    print(f"final test accuracy {accuracies[0]:.3f} on {len(accuracies)} ranks")


if __name__ == "__main__":
    main()
