"""A custom TensorFlow training loop on scikit-learn's digits, with DistributedGradientTape.

Each rank trains on its own shard; ``hvd.DistributedGradientTape`` averages the
gradients across ranks inside the compiled ``tf.function`` step, and
``hvd.broadcast_variables`` starts every rank from rank 0's weights.

    horarun -np 2 python examples/tensorflow/gradient_tape_digits.py
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hora.tensorflow as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.002, help="per rank; scaled by the number of ranks")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    keras = tf.keras
    keras.utils.set_random_seed(args.seed + hvd.rank())  # ranks differ until the broadcast

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    per_rank = len(x_train) // hvd.size()  # equal shards: the same number of steps on every rank
    shard = slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)
    dataset = (
        tf.data.Dataset.from_tensor_slices((x_train[shard], y_train[shard]))
        .shuffle(per_rank, seed=hvd.rank(), reshuffle_each_iteration=True)
        .batch(args.batch_size, drop_remainder=True)
    )

    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    optimizer = keras.optimizers.Adam(args.lr * hvd.size())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)  # the line that makes it distributed
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    # Start every rank from rank 0's weights (and optimizer state).
    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables, root_rank=0)

    for epoch in range(1, args.epochs + 1):
        losses = [float(train_step(images, labels)) for images, labels in dataset]
        loss = hvd.allreduce(tf.constant(np.mean(losses)), name="loss")
        accuracy = float(np.mean(np.argmax(model(x_test), axis=1) == y_test))
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}  loss {float(loss):.4f}  test accuracy {accuracy:.3f}")
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.3f} on {hvd.size()} ranks")
    hvd.shutdown()


if __name__ == "__main__":
    main()
