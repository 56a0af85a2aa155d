"""Elastic data-parallel Keras training on scikit-learn's digits, with hora.tensorflow.keras.

The elastic version of keras_digits.py. ``model.fit`` runs under ``hvd.elastic.run``:
when a worker dies, the survivors put back the last commit, join the next, smaller
world and fit the remaining epochs; when hosts are added, the job grows at the next
commit. ``KerasState`` holds the model, its optimizer and the batch and epoch counters
that ``UpdateBatchStateCallback`` and ``UpdateEpochStateCallback`` keep current;
``CommitStateCallback`` commits it every few batches and at the end of every epoch. A
reset callback rescales the learning rate by the new number of ranks, and every (re)start
of ``fit`` takes this rank's shard of the training set in the current world. Rank 0
reports. Works with Keras 3 and, with TF_USE_LEGACY_KERAS=1, with Keras 2.

    printf 'localhost:2\\n127.0.0.1:2\\n' > hosts.txt
    printf '#!/bin/sh\\ncat hosts.txt\\n' > discover.sh && chmod +x discover.sh
    horarun -np 4 --min-np 2 --host-discovery-script ./discover.sh \\
        python examples/tensorflow/keras_elastic_digits.py

Kill a worker (``pkill -9 -f keras_elastic_digits.py -n``) and the job goes on with the
ranks left; edit hosts.txt and it follows the hosts listed.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hora.tensorflow.keras as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.002, help="per rank; scaled by the number of ranks")
    parser.add_argument("--batches-per-commit", type=int, default=5, help="commit the state every N batches")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvd.init()  # hora:
    # hora: one thread per worker: the "hosts" of an elastic job may share a machine.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras = tf.keras
    keras.utils.set_random_seed(args.seed + hvd.rank())  # ranks differ until the state is synchronized

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    # hora: scale the learning rate by the number of ranks, and average the gradients over them.
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(args.lr * hvd.size()))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

    # hora: what survives a failure; rank 0's weights reach every rank when train() starts.
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    def on_state_reset() -> None:
        # hora: in a new world, rescale the learning rate by the new size().
        model.optimizer.learning_rate.assign(args.lr * hvd.size())

    state.register_reset_callbacks([on_state_reset])
    callbacks = [
        hvd.callbacks.MetricAverageCallback(),  # hora: epoch metrics averaged over the ranks
        # hora: keep state.batch and state.epoch current, then commit every few batches and every epoch.
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit),
    ]

    @hvd.elastic.run  # hora: on a failure, restore the last commit, join the next world and fit again.
    def train(state: hvd.elastic.KerasState) -> None:
        # hora: equal shards of the current world, so every rank runs the same number of steps.
        per_rank = len(x_train) // hvd.size()
        shard = slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)
        if hvd.rank() == 0:
            print(f"training from epoch {state.epoch + 1} on {hvd.size()} ranks", flush=True)
        state.model.fit(
            x_train[shard],
            y_train[shard],
            batch_size=args.batch_size,
            epochs=args.epochs - state.epoch,  # hora: the epochs left
            callbacks=callbacks,
            verbose=2 if hvd.rank() == 0 else 0,
        )

    train(state)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.3f} on {hvd.size()} ranks", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
