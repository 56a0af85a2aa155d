"""Keras training on scikit-learn's digits whose input pipeline runs in TensorFlow's data service.

A compute job runs the tf.data service (dispatchers and workers) and the training job
sends its pipeline there with ``send_to_data_service`` (dispatchers on the compute side,
the default) or runs the dispatchers itself inside ``tf_data_service`` (a compute job
started with ``--dispatcher-side training``). Start the compute job first; the training
job waits for its config file, and its rank 0 shuts the compute job down at the end:

    horarun -np 2 python -m hora.tensorflow.data.compute_worker /tmp/compute.json &
    horarun -np 2 python examples/tensorflow/data_service_digits.py /tmp/compute.json
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hora.tensorflow as hvd_tf
import hora.tensorflow.keras as hvd
from hora.tensorflow.data.compute_service import TfDataServiceConfig, tf_data_service


def _train(dataset: tf.data.Dataset, x_test: np.ndarray, y_test: np.ndarray, args: argparse.Namespace) -> float:
    keras = tf.keras
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(args.lr * hvd.size())),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(
        dataset,
        steps_per_epoch=args.steps_per_epoch,
        epochs=args.epochs,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()],
        verbose=2 if hvd.rank() == 0 else 0,
    )
    hvd_tf.barrier()  # every rank is done reading before any dispatcher or the compute job stops
    return float(model.evaluate(x_test, y_test, verbose=0)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configfile", help="the compute job's config file")
    parser.add_argument("--reuse-dataset", action="store_true", help="one dispatcher: the ranks share one dataset")
    parser.add_argument("--round-robin", action="store_true", help="with --reuse-dataset: the ranks take turns")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps-per-epoch", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.002, help="per rank; scaled by the number of ranks")
    args = parser.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    tf.keras.utils.set_random_seed(hvd.rank())  # ranks differ until the broadcast
    config = TfDataServiceConfig.read(args.configfile, wait_for_file_creation=True)
    if config.dispatchers > 1 and config.dispatchers != hvd.size():
        sys.exit(f"{config.dispatchers} dispatchers serve {config.dispatchers} training ranks, not {hvd.size()}")

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=0)
    # What runs before the hand-over runs on the data service's workers.
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat().shuffle(1000).batch(args.batch_size)
    if config.dispatcher_side == "compute":
        dataset = dataset.send_to_data_service(
            config, hvd.rank(), hvd.size(), reuse_dataset=args.reuse_dataset, round_robin=args.round_robin
        )
        accuracy = _train(dataset.prefetch(tf.data.AUTOTUNE), x_test, y_test, args)
    else:
        with tf_data_service(config, hvd.rank()) as dispatcher_address:
            dataset = dataset.apply(
                tf.data.experimental.service.distribute(
                    processing_mode="distributed_epoch",
                    service=dispatcher_address,
                    job_name="job" if args.reuse_dataset else None,
                    consumer_index=hvd.rank() if args.round_robin else None,
                    num_consumers=hvd.size() if args.round_robin else None,
                )
            )
            accuracy = _train(dataset.prefetch(tf.data.AUTOTUNE), x_test, y_test, args)
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.3f} on {hvd.size()} ranks")
        config.compute_client().shutdown()  # the compute job ends
    hvd.shutdown()


if __name__ == "__main__":
    main()
