"""Horovod's TensorFlow 2 synthetic benchmark, on hora: training throughput on fixed random data.

The flags and output lines are those of Horovod's ``tensorflow2_synthetic_benchmark.py``.
``--model`` takes a ``keras.applications`` model name (224x224 images, as in Horovod),
or one of two built-in models on 32x32 images: ``cnn`` (a small convolutional net)
and ``mlp25m`` (a 25.6M-parameter MLP, whose 100 MB of gradients per step make the
run communication-bound). ``--image-size`` overrides the image size.

    horarun -np 2 python examples/tensorflow/tensorflow2_synthetic_benchmark.py --model cnn
"""

from __future__ import annotations

import argparse
import os
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import hora.tensorflow as hvd

BUILT_IN = ("cnn", "mlp25m")


def build_model(name: str, image_size: int | None) -> tuple[tf.keras.Model, int]:
    """Returns the model and the side of its square input images."""
    keras = tf.keras
    if name in BUILT_IN:
        side = image_size or 32
        inputs = keras.Input((side, side, 3))
        if name == "cnn":
            h = inputs
            for filters in (32, 64, 128):
                h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
                h = keras.layers.MaxPooling2D()(h)
            h = keras.layers.Dense(512, activation="relu")(keras.layers.Flatten()(h))
        else:
            h = keras.layers.Dense(4096, activation="relu")(keras.layers.Flatten()(inputs))
            h = keras.layers.Dense(2560, activation="relu")(h)
        return keras.Model(inputs, keras.layers.Dense(1000)(h)), side
    side = image_size or 224
    return getattr(keras.applications, name)(weights=None, input_shape=(side, side, 3)), side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce")
    parser.add_argument("--model", type=str, default="ResNet50", help="model to benchmark")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument("--num-warmup-batches", type=int, default=10, help="number of warm-up batches that don't count towards benchmark")
    parser.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    parser.add_argument("--eager", action="store_true", default=False, help="enables eager execution")
    parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction")
    parser.add_argument("--image-size", type=int, default=None, help="side of the input images (hora's addition)")
    args = parser.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    device = "GPU" if tf.config.list_physical_devices("GPU") and not args.no_cuda else "CPU"

    model, side = build_model(args.model, args.image_size)
    scale = 1 if args.use_adasum else hvd.size()  # Adasum needs no learning-rate scaling
    optimizer = tf.keras.optimizers.SGD(0.01 * scale)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    op = hvd.Adasum if args.use_adasum else hvd.Average
    rng = np.random.default_rng(hvd.rank())
    data = tf.constant(rng.random((args.batch_size, side, side, 3), dtype=np.float32))
    target = tf.constant(rng.integers(0, 1000, size=(args.batch_size,)))
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def benchmark_step() -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression, op=op)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))

    step = benchmark_step if args.eager else tf.function(benchmark_step)
    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables, root_rank=0)

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {device}s: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        elapsed = timeit.timeit(step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / elapsed
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per {device}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
