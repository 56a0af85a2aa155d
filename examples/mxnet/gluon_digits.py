"""Data-parallel training of a small Gluon CNN on scikit-learn's digits, with hora.mxnet.

A single-process Gluon script plus the Horovod lines (marked "hora:"): each rank trains
on its own shard of the training set, DistributedTrainer averages the gradients over
the ranks, rank 0's initial weights are broadcast, and the test accuracy is summed
over the ranks' shards of the test set. Rank 0 prints progress. MXNet 1.9.1 needs
NumPy < 2: run it with the Python of hora's MXNet environment (``make test`` builds
``.venv-mxnet``; see docs/mxnet.md).

    horarun -np 2 .venv-mxnet/bin/python examples/mxnet/gluon_digits.py
"""

from __future__ import annotations

import argparse

import hora.mxnet as hvd  # hora: first, so that mxnet imports under NumPy 1.24+

import mxnet as mx  # noqa: E402  (after hora.mxnet: see above)
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402


def build_net() -> gluon.nn.HybridSequential:
    """Two 3x3 convolutions on the 8x8 images, then two dense layers."""
    net = gluon.nn.HybridSequential()
    net.add(
        gluon.nn.Conv2D(16, 3, padding=1, activation="relu"),
        gluon.nn.Conv2D(32, 3, padding=1, activation="relu"),
        gluon.nn.MaxPool2D(2),
        gluon.nn.Dense(64, activation="relu"),
        gluon.nn.Dense(10),
    )
    return net


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by the number of ranks")
    args = parser.parse_args()

    hvd.init()  # hora:

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    y = digits.target.astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    # hora: each rank keeps every size()-th example, of the training and of the test set.
    x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    x_test_shard, y_test_shard = x_test[hvd.rank() :: hvd.size()], y_test[hvd.rank() :: hvd.size()]

    mx.random.seed(hvd.rank())  # deliberately different initial weights on each rank...
    net = build_net()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(mx.nd.array(x_shard[:1]))  # runs the deferred initialisation, so the shapes are known
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)  # hora: ...so start from rank 0's
    # hora: DistributedTrainer averages the gradients over the ranks; lr * size().
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": args.lr * hvd.size(), "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    # The same number of steps on every rank (shards differ by at most one example).
    steps = len(x_train) // hvd.size() // args.batch_size
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        order = np.random.default_rng(1000 * epoch + hvd.rank()).permutation(len(x_shard))
        total_loss = mx.nd.zeros((1,))
        for step in range(steps):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            data, label = mx.nd.array(x_shard[batch]), mx.nd.array(y_shard[batch])
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(len(batch))  # each rank's own batch size: the trainer averages over the ranks
            total_loss += loss.mean()
        predicted = net(mx.nd.array(x_test_shard)).argmax(axis=1).asnumpy()
        correct = float((predicted == y_test_shard).sum())
        # hora: average the loss and sum the test counts over the ranks.
        loss_avg = hvd.allreduce(total_loss / steps, name="loss").asscalar()
        counts = hvd.allreduce(mx.nd.array([correct, len(y_test_shard)]), op=hvd.Sum, name="counts").asnumpy()
        accuracy = counts[0] / counts[1]
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}  loss {loss_avg:.4f}  test accuracy {accuracy:.3f}", flush=True)
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.3f} on {hvd.size()} ranks")
    hvd.shutdown()


if __name__ == "__main__":
    main()
