"""Data-parallel Keras training on scikit-learn's digits, with hora.tensorflow.keras.

Each rank fits the model on its own shard of the training set. The distributed
optimizer averages gradients across ranks at every step, the callbacks start every
rank from rank 0's weights, average the metrics and warm the learning rate up, and
rank 0 reports. Works with Keras 3 and, with TF_USE_LEGACY_KERAS=1, with Keras 2.

    horarun -np 2 python examples/tensorflow/keras_digits.py
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None, help="save the best model here (rank 0), e.g. best.keras")
    args = parser.parse_args()

    hvd.init()
    # Share the cores between the ranks of this host.
    tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    keras = tf.keras
    keras.utils.set_random_seed(args.seed + hvd.rank())  # ranks differ until the broadcast

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    # Equal shards, so every rank runs the same number of steps per epoch.
    per_rank = len(x_train) // hvd.size()
    shard = slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)
    x_shard, y_shard = x_train[shard], y_train[shard]

    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    # Scale the learning rate by the number of ranks; the averaged gradient is less noisy.
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(args.lr * hvd.size()))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # every rank starts from rank 0's weights
        hvd.callbacks.MetricAverageCallback(),  # epoch metrics averaged over the ranks
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=args.lr * hvd.size(), warmup_epochs=3),
    ]
    if args.checkpoint:
        callbacks.append(hvd.callbacks.BestModelCheckpoint(monitor="val_accuracy", mode="max", filepath=args.checkpoint))
    model.fit(
        x_shard,
        y_shard,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(x_test, y_test),
        callbacks=callbacks,
        verbose=2 if hvd.rank() == 0 else 0,
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.3f} on {hvd.size()} ranks")
    hvd.shutdown()


if __name__ == "__main__":
    main()
