"""Data-parallel softmax regression on scikit-learn's digits, with hora.numpy.

Each rank trains on its own shard of the training set; after every mini-batch the
ranks average their gradients with one allreduce, so all ranks hold the same weights.
Rank 0 prints the loss and the test accuracy after each epoch.

    horarun -np 2 python examples/numpy/train_digits.py
"""

from __future__ import annotations

import argparse

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hora.numpy as hvd


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()

    hvd.init()
    digits = load_digits()
    x = digits.data / 16.0
    y = digits.target
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    # Each rank keeps every size()-th example: its shard of the training set.
    x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    classes, features = 10, x.shape[1]

    rng = np.random.default_rng(hvd.rank())  # deliberately different on each rank...
    weights = rng.normal(scale=0.01, size=(features, classes))
    bias = np.zeros(classes)
    hvd.broadcast_(weights, root_rank=0, name="weights")  # ...until rank 0's values are broadcast
    hvd.broadcast_(bias, root_rank=0, name="bias")

    steps = len(x_shard) // args.batch_size
    for epoch in range(1, args.epochs + 1):
        order = np.random.default_rng(epoch * 1000 + hvd.rank()).permutation(len(x_shard))
        losses = []
        for step in range(steps):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            xb, yb = x_shard[batch], y_shard[batch]
            probs = softmax(xb @ weights + bias)
            losses.append(-np.log(probs[np.arange(len(yb)), yb] + 1e-12).mean())
            probs[np.arange(len(yb)), yb] -= 1.0
            grad_w = xb.T @ probs / len(yb)
            grad_b = probs.mean(axis=0)
            # The one line that makes it distributed: average gradients over ranks.
            grad_w, grad_b = hvd.grouped_allreduce([grad_w, grad_b], name="grads")
            weights -= args.lr * grad_w
            bias -= args.lr * grad_b
        loss = hvd.allreduce(np.array(np.mean(losses)), name="loss")
        accuracy = (np.argmax(x_test @ weights + bias, axis=1) == y_test).mean()
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}  loss {float(loss):.4f}  test accuracy {accuracy:.3f}")
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.3f} on {hvd.size()} ranks")
    hvd.shutdown()


if __name__ == "__main__":
    main()
