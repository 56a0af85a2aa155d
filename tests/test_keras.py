"""hora.tensorflow.keras with Keras 3 and with Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1).

The central check: N ranks that each ``model.fit`` on their shard with
``DistributedOptimizer`` end with the same weights, and the same averaged metrics, as
one process training on the whole batch. Then the callbacks' effects (broadcast from
different initial weights, averaged metrics, learning-rate warmup and schedule
values), SyncBatchNormalization, backward_passes_per_step, load_model,
BestModelCheckpoint and XLA.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from data import make
from harness import run_ranks
from test_tensorflow_ops import SIZES, TF_ENV, Checks, start

pytestmark = pytest.mark.framework

BATCH = 4  # per rank
STEPS = 4  # batches per epoch


def _data(n: int, me: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The whole data set, and this rank's shard: global batch k of n*BATCH rows is the
    concatenation of every rank's batch k."""
    f32 = np.dtype(np.float32)
    x = make(f32, 99, (n * BATCH * STEPS, 6))
    y = (x @ make(f32, 98, (6, 1)) + 0.1 * make(f32, 97, (len(x), 1))).astype(np.float32)
    mine = np.concatenate([np.arange(k * n * BATCH + me * BATCH, k * n * BATCH + (me + 1) * BATCH) for k in range(STEPS)])
    return x, y, x[mine], y[mine]


def _build(keras: Any, seed: int, norm: Any = None) -> Any:
    init = keras.initializers.GlorotUniform
    layers = [keras.Input((6,)), keras.layers.Dense(8, activation="tanh", kernel_initializer=init(seed=seed))]
    if norm is not None:
        layers.append(norm())
    layers.append(keras.layers.Dense(1, kernel_initializer=init(seed=seed + 100)))
    return keras.Sequential(layers)


def _equivalence(
    c: Checks, tf: Any, hvd: Any, label: str, optimizer: Callable[[], Any], norm: Any = None, reference_norm: Any = None,
    passes: int = 1,
) -> None:
    """Trains on shards with N ranks and on the whole batch in one process; compares."""
    keras = tf.keras
    n, me = hvd.size(), hvd.rank()
    x, y, x_mine, y_mine = _data(n, me)
    model = _build(keras, seed=me, norm=norm)  # different on every rank until the broadcast
    opt = hvd.DistributedOptimizer(optimizer(), backward_passes_per_step=passes, average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss="mse", metrics=["mae"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    history = model.fit(x_mine, y_mine, batch_size=BATCH, epochs=2, shuffle=False, callbacks=callbacks, verbose=0)

    reference = _build(keras, seed=0, norm=reference_norm)  # rank 0's initial weights
    reference.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
    expected = reference.fit(x, y, batch_size=n * BATCH * passes, epochs=2, shuffle=False, verbose=0)
    for i, (got, want) in enumerate(zip(model.get_weights(), reference.get_weights())):
        c.close(f"{label}: weight {i}", got, want, tol=2e-4)
    for metric in ("loss", "mae"):
        c.close(f"{label}: averaged {metric}", history.history[metric], expected.history[metric], tol=2e-4)
    everyone = hvd_tf().allgather_object([w.tolist() for w in model.get_weights()])
    c.that(f"{label}: same weights on every rank", all(e == everyone[0] for e in everyone))


def hvd_tf() -> Any:
    import hora.tensorflow

    return hora.tensorflow


class _Recorder:
    """A callback (made with the Keras in use) that records the optimizer's values at each batch."""

    @staticmethod
    def make(keras: Any) -> Any:
        class Recorder(keras.callbacks.Callback):
            def __init__(self) -> None:
                super().__init__()
                self.lrs: list[float] = []
                self.momenta: list[float] = []

            def on_batch_begin(self, batch: int, logs: Any = None) -> None:
                self.lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))
                momentum = getattr(self.model.optimizer, "momentum", None)
                self.momenta.append(float(np.asarray(momentum)) if momentum is not None else 0.0)

        return Recorder()


def _schedules(c: Checks, tf: Any, hvd: Any, optimizer: Callable[[float], Any], momentum_variable: bool) -> None:
    keras = tf.keras
    n, me = hvd.size(), hvd.rank()
    _, _, x_mine, y_mine = _data(n, me)
    model = _build(keras, seed=0)
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer(0.1)), loss="mse")
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2)
    recorder = _Recorder.make(keras)
    history = model.fit(x_mine, y_mine, batch_size=BATCH, epochs=3, shuffle=False, callbacks=[warmup, recorder], verbose=0)
    want = []
    for epoch in range(3):
        for batch in range(STEPS):
            e = min(epoch + batch / STEPS, 2 - 1 / STEPS) + 1 / STEPS  # no change after the warmup
            want.append(0.1 / n * (e * (n - 1) / 2 + 1))
    c.close("warmup learning rates", recorder.lrs, want, tol=1e-6)
    c.close("warmup logs lr", history.history["lr"], [want[STEPS - 1], want[2 * STEPS - 1], want[-1]], tol=1e-6)
    if momentum_variable:
        # momentum correction: momentum * new_lr / old_lr during the batch that changes the rate
        ratios = [want[i] / (want[i - 1] if i else 0.1) for i in range(len(want))]
        c.close("momentum correction", recorder.momenta[1 : 2 * STEPS], [0.5 * r for r in ratios[1 : 2 * STEPS]], tol=1e-6)

    model = _build(keras, seed=0)
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer(0.2)), loss="mse")
    schedule = hvd.callbacks.LearningRateScheduleCallback(0.2, multiplier=lambda epoch: 0.5**epoch, start_epoch=1, end_epoch=3)
    recorder = _Recorder.make(keras)
    model.fit(x_mine, y_mine, batch_size=BATCH, epochs=4, shuffle=False, callbacks=[schedule, recorder], verbose=0)
    want = [0.2] * STEPS + [0.1] * STEPS + [0.05] * 2 * STEPS
    c.close("schedule learning rates", recorder.lrs, want, tol=1e-6)


def keras_job(legacy_keras: bool) -> list[str]:
    tf, _ = start()
    import hora.tensorflow.keras as hvd

    keras = tf.keras
    c = Checks()
    c.that("Keras version", keras.__name__.startswith("tf_keras") == legacy_keras, keras.__name__)
    n, me = hvd.size(), hvd.rank()

    def sgd() -> Any:
        return keras.optimizers.SGD(0.05, momentum=0.9)

    _equivalence(c, tf, hvd, "SGD", sgd)
    if n > 1:  # (at one rank these reduce nothing)
        if not legacy_keras:
            _equivalence(c, tf, hvd, "Adam", lambda: keras.optimizers.Adam(0.01))
        norms = (hvd_tf().SyncBatchNormalization, keras.layers.BatchNormalization)
        _equivalence(c, tf, hvd, "SyncBatchNormalization", sgd, *norms)
        _equivalence(c, tf, hvd, "backward_passes_per_step=2", sgd, passes=2)
    if legacy_keras:
        _equivalence(c, tf, hvd, "legacy SGD", lambda: keras.optimizers.legacy.SGD(0.05, momentum=0.9))
        _schedules(c, tf, hvd, lambda lr: keras.optimizers.legacy.SGD(lr, momentum=0.5), momentum_variable=True)
    else:
        _schedules(c, tf, hvd, lambda lr: keras.optimizers.SGD(lr, momentum=0.5), momentum_variable=False)

    # load_model: the optimizer comes back distributed, with its state
    _, _, x_mine, y_mine = _data(n, me)
    folder = hvd_tf().broadcast_object(__import__("tempfile").mkdtemp(prefix="hora-keras-") if me == 0 else None)
    model = _build(keras, seed=0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(x_mine, y_mine, batch_size=BATCH, epochs=1, verbose=0)
    path = os.path.join(folder, "model.keras")
    if me == 0:
        model.save(path)
    hvd_tf().barrier()
    loaded = hvd.load_model(path)
    c.that("load_model: distributed", getattr(loaded.optimizer, "_hora_reducer", None) is not None)
    c.close("load_model: iterations kept", np.asarray(loaded.optimizer.iterations), STEPS)
    loaded.fit(x_mine, y_mine, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    everyone = hvd_tf().allgather_object([w.tolist() for w in loaded.get_weights()])
    c.that("load_model: ranks stay equal", all(e == everyone[0] for e in everyone))

    # BestModelCheckpoint writes on rank 0 only
    best = os.path.join(folder, f"best_r{me}.keras")
    checkpoint = hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=best)
    model.fit(x_mine, y_mine, batch_size=BATCH, epochs=2, verbose=0, validation_data=(x_mine, y_mine),
              callbacks=[hvd.callbacks.MetricAverageCallback(), checkpoint])  # fmt: skip
    c.that("BestModelCheckpoint on rank 0 only", os.path.exists(best) == (me == 0), f"rank {me}: {os.path.exists(best)}")
    hvd_tf().barrier()
    if me == 0:
        __import__("shutil").rmtree(folder)

    # XLA: turned off by BroadcastGlobalVariablesCallback, an error with the fix otherwise
    model = _build(keras, seed=0)
    model.compile(optimizer=hvd.DistributedOptimizer(sgd()), loss="mse", jit_compile=True)
    if n > 1:  # (one rank reduces nothing, so XLA has nothing to refuse)
        c.raises("XLA error", lambda: model.fit(x_mine, y_mine, batch_size=BATCH, verbose=0), RuntimeError, "jit_compile=False")
    model = _build(keras, seed=0)
    model.compile(optimizer=hvd.DistributedOptimizer(sgd()), loss="mse", jit_compile=True)
    model.fit(x_mine, y_mine, batch_size=BATCH, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    c.that("XLA turned off", model.jit_compile is False)
    c.raises("wrapped twice", lambda: hvd.DistributedOptimizer(model.optimizer), ValueError, "already")

    # A model without an Input is built by its first step (Keras 2 raises for its variables
    # before): the callback broadcasts it after that step, as Horovod's does.
    init = keras.initializers.GlorotUniform
    unbuilt = keras.Sequential([keras.layers.Dense(8, kernel_initializer=init(seed=me)),
                                keras.layers.Dense(1, kernel_initializer=init(seed=me + 100))])  # fmt: skip
    unbuilt.compile(optimizer=hvd.DistributedOptimizer(sgd()), loss="mse")
    unbuilt.fit(x_mine, y_mine, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])  # fmt: skip
    everyone = hvd_tf().allgather_object([w.tolist() for w in unbuilt.get_weights()])
    c.that("a model built by its first step: ranks equal", all(e == everyone[0] for e in everyone))
    hvd.shutdown()
    return c.problems


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("legacy_keras", [False, True], ids=["keras3", "keras2"])
@pytest.mark.timeout(400)
def test_keras(legacy_keras: bool, size: int) -> None:
    env = dict(TF_ENV, TF_USE_LEGACY_KERAS="1" if legacy_keras else "0")
    results = run_ranks(size, keras_job, legacy_keras, timeout=380, env=env)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:30])


# The names Horovod's horovod.tensorflow.keras and horovod.keras import from horovod.tensorflow
# besides the Keras ones (its examples call hvd.nccl_built(), hvd.add_process_set(), ...).
HOROVOD_KERAS_BASICS = (
    "add_process_set remove_process_set global_process_set ProcessSet ccl_built cuda_built ddl_built gloo_built "
    "gloo_enabled mpi_built mpi_enabled mpi_threads_supported nccl_built rocm_built start_timeline stop_timeline "
    "init shutdown is_initialized size local_size cross_size rank local_rank cross_rank is_homogeneous"
).split()


@pytest.mark.timeout(120)
def test_the_keras_modules_have_horovods_names() -> None:
    import subprocess
    import sys

    code = (
        "import hora.keras, hora.keras.elastic, hora.tensorflow.keras as k\n"
        f"names = {HOROVOD_KERAS_BASICS!r}\n"
        "for m in (k, hora.keras):\n"
        "    missing = [n for n in names if not hasattr(m, n) or n not in m.__all__]\n"
        "    assert not missing, (m.__name__, missing)\n"
        "assert hora.keras.elastic.TensorFlowKerasState is k.elastic.TensorFlowKerasState\n"
        # horovod.keras's own order: num_groups right after op; no save_weights_only.
        "import tensorflow as tf\n"
        "hora.keras.init()\n"
        "opt = hora.keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), None, '', '', k.Compression.none, False,"
        " 1.0, k.Average, 2)\n"
        "assert opt._hora_reducer.groups == 2, vars(opt._hora_reducer)\n"
        "cb = hora.keras.callbacks.BestModelCheckpoint('val_acc', 0, 'max')\n"
        "assert cb.mode == 'max' and cb.save_weights_only is False\n"
        "assert k.callbacks.BestModelCheckpoint('val_acc', 0, True).save_weights_only is True\n"
        "import inspect, warnings\n"
        "assert inspect.signature(hora.keras.allreduce).parameters['average'].default is True\n"
        "assert inspect.signature(k.allreduce).parameters['average'].default is None\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    assert float(hora.keras.allreduce(3.0)) == 3.0\n"
        "assert any(issubclass(w.category, DeprecationWarning) for w in caught)\n"
        "try:\n"
        "    hora.keras.allreduce(3.0, op=k.Sum)\n"
        "    raise AssertionError('op with the default average=True did not raise')\n"
        "except ValueError as exc:\n"
        "    assert 'supersedes average' in str(exc)\n"
        "assert float(hora.keras.allreduce(3.0, average=None, op=k.Sum)) == 3.0\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110,
                            env=dict(os.environ, **TF_ENV))  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
