"""Elastic training with TensorFlow and Keras: hora.tensorflow.elastic and
hora.tensorflow.keras.elastic, in real ranks (one job per world, TensorFlow imported once).

The job checks TensorFlowKerasState and TensorFlowState (eager, and a TF1 graph through a
session): a sync gives every rank rank 0's model, optimizer and objects, restore puts
back the last commit; ``hvd.elastic.run`` recovering from a HoraInternalError injected on
the last rank (the other rank's next collective, inside ``tf.function``, fails as a
``tf.errors.UnknownError`` that ``run`` maps), with a real ``shutdown()`` + ``init()``,
ending where a run without the failure ends; ``model.fit`` with the three elastic
callbacks (counters and commits counted); and Horovod's elastic Keras loop (``fit`` inside
``hvd.elastic.run``) recovering from a failure in the middle of an epoch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from data import make
from harness import run_ranks
from test_keras import _build
from test_tensorflow_ops import TF_ENV, Checks, start

pytestmark = pytest.mark.framework

BATCH = 4
STEPS = 4  # batches per epoch of the fit check


def _gathered(hvd: Any, weights: list[np.ndarray]) -> list[Any]:
    return hvd.allgather_object([np.asarray(w).tolist() for w in weights])


def _states(c: Checks, tf: Any, hvd: Any) -> None:
    """TensorFlowKerasState and TensorFlowState: sync, commit, restore."""
    keras = tf.keras
    me = hvd.rank()
    x = make(np.dtype(np.float32), me, (BATCH, 6))
    y = make(np.dtype(np.float32), me, (BATCH, 1), salt=1)

    model = _build(keras, seed=me)  # different weights on each rank until the sync
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    state = hvd.elastic.TensorFlowKerasState(model, epoch=10 + me, tag=f"rank{me}")
    c.that("optimizer from the model", state.optimizer is model.optimizer)
    state.sync()
    c.close("sync: rank 0's weights", np.concatenate([w.ravel() for w in model.get_weights()]),
            np.concatenate([w.ravel() for w in _build(keras, seed=0).get_weights()]))  # fmt: skip
    c.that("sync: rank 0's objects", (state.epoch, state.tag) == (10, "rank0"), f"{state.epoch} {state.tag}")
    opt_vars = hvd.elastic._variables(model.optimizer)
    c.that("sync: same optimizer variables everywhere", len(set(hvd.allgather_object(len(opt_vars)))) == 1)

    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)  # each rank its own data
    trained = [w.copy() for w in model.get_weights()]
    state.epoch = 11
    state.commit()
    committed_iterations = int(np.asarray(model.optimizer.iterations))
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    state.epoch = 12
    state.restore()
    for i, (got, want) in enumerate(zip(model.get_weights(), trained)):
        c.close(f"restore: weight {i}", got, want)
    c.close("restore: optimizer iterations", np.asarray(model.optimizer.iterations), committed_iterations)
    c.that("restore: objects", state.epoch == 11)
    state.sync()
    everyone = _gathered(hvd, model.get_weights())
    c.that("sync after training: same weights", all(e == everyone[0] for e in everyone))
    c.raises("unbuilt model", lambda: hvd.elastic.TensorFlowKerasState(keras.Sequential([keras.layers.Dense(1)])),
             ValueError, "built")  # fmt: skip

    # TensorFlowState, eager
    v = tf.Variable(np.full(3, float(me), np.float32))
    ts = hvd.elastic.TensorFlowState([v], step=me)
    ts.sync()
    c.close("TensorFlowState sync", v, np.zeros(3))
    c.that("TensorFlowState sync objects", ts.step == 0)
    v.assign(np.full(3, 5.0, np.float32))
    ts.commit()
    v.assign(np.full(3, 7.0, np.float32))
    ts.restore()
    c.close("TensorFlowState restore", v, np.full(3, 5.0))

    # TensorFlowState in a TF1 graph, through a session
    graph = tf.Graph()
    with graph.as_default():
        gv = tf.compat.v1.Variable(np.full(2, float(me + 1), np.float32), use_resource=True)
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2, intra_op_parallelism_threads=1)
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            session.run(gv.initializer)
            gs = hvd.elastic.TensorFlowState([gv], session=session, epoch=me)
            gs.sync()
            c.close("TF1 session sync", session.run(gv), np.ones(2))
            gv.load(np.full(2, 9.0, np.float32), session)
            gs.restore()
            c.close("TF1 session restore", session.run(gv), np.ones(2))
            c.that("TF1 session objects", gs.epoch == 0)
        c.raises("TF1 without a session", lambda: hvd.elastic.TensorFlowState([gv]), ValueError, "session")
        c.raises("TF1 Keras state", lambda: hvd.elastic.TensorFlowKerasState(model), NotImplementedError, "eager")


def _recovery(c: Checks, tf: Any, hvd: Any, HoraInternalError: type) -> dict[str, Any]:  # noqa: N803
    """hvd.elastic.run: the last rank raises at step 4; every rank resumes from the commit at 3."""
    keras = tf.keras
    n, me = hvd.size(), hvd.rank()
    xs = make(np.dtype(np.float32), me, (6, BATCH, 6))
    ys = make(np.dtype(np.float32), me, (6, BATCH, 1), salt=1)

    def trainer(model: Any, opt: Any) -> Any:
        @tf.function
        def train_step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return train_step

    model, opt = _build(keras, seed=me), keras.optimizers.SGD(0.05, momentum=0.9)
    train_step = trainer(model, opt)
    state = hvd.elastic.TensorFlowKerasState(model, opt, step=0)
    attempts: list[tuple[int, list[Any]]] = []
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state: Any, steps: int) -> list[Any]:
        attempts.append((state.step, [w.tolist() for w in state.model.get_weights()]))
        while state.step < steps:
            train_step(xs[state.step], ys[state.step])
            state.step += 1
            if state.step == 4 and len(attempts) == 1 and me == n - 1:
                raise HoraInternalError("injected")
            if state.step % 3 == 0:
                state.commit()
                committed.append([w.tolist() for w in state.model.get_weights()])
        return [w.tolist() for w in state.model.get_weights()]

    committed: list[Any] = []
    final = train(state, 6)
    c.that("one reset, same world", resets == [n], str(resets))
    c.that("retry from the commit at step 3", [a[0] for a in attempts] == [0, 3], str([a[0] for a in attempts]))
    c.that("retry from the committed weights", len(attempts) == 2 and attempts[1][1] == committed[0])

    # The same steps without a failure end in the same place (momentum restored too).
    ref_model, ref_opt = _build(keras, seed=0), keras.optimizers.SGD(0.05, momentum=0.9)
    ref_step = trainer(ref_model, ref_opt)
    for step in range(6):
        ref_step(xs[step], ys[step])
    for i, (got, want) in enumerate(zip(final, ref_model.get_weights())):
        c.close(f"recovered = uninterrupted: weight {i}", np.asarray(got, np.float32), want, tol=1e-5)

    # An UnknownError that names no hora op is the function's own: no reset.
    def other(state: Any) -> None:
        raise tf.errors.UnknownError(None, None, "something else")

    unknown = tf.errors.UnknownError
    c.raises("other UnknownError passes", lambda: hvd.elastic.run(other)(state), unknown, "something else")
    c.that("no reset for it", resets == [n])
    return {"final": final}


def _fit_callbacks(c: Checks, tf: Any, khvd: Any) -> None:
    """model.fit with UpdateBatchStateCallback, UpdateEpochStateCallback, CommitStateCallback."""
    keras = tf.keras
    me = khvd.rank()
    x = make(np.dtype(np.float32), me, (BATCH * STEPS, 6))
    y = make(np.dtype(np.float32), me, (BATCH * STEPS, 1), salt=1)
    model = _build(keras, seed=0)
    model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    state = khvd.elastic.KerasState(model, batch=0, epoch=0)
    commits: list[tuple[int, int]] = []
    real_commit = state.commit

    def counted() -> None:
        commits.append((state.epoch, state.batch))
        real_commit()

    state.commit = counted
    seen: list[tuple[int, int]] = []
    steps_seen: list[Any] = []

    class Recorder(keras.callbacks.Callback):  # type: ignore[misc, name-defined]
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            steps_seen.append(self.params.get("steps"))

        def on_batch_end(self, batch: int, logs: Any = None) -> None:
            seen.append((state.epoch, state.batch))

    callbacks = [khvd.elastic.UpdateBatchStateCallback(state), khvd.elastic.UpdateEpochStateCallback(state),
                 khvd.elastic.CommitStateCallback(state, batches_per_commit=3), Recorder()]  # fmt: skip
    model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False, callbacks=callbacks)
    c.that("batch and epoch during fit", seen == [(e, b) for e in range(3) for b in range(STEPS)], str(seen))
    c.that("after fit", (state.epoch, state.batch) == (3, 0), f"{state.epoch} {state.batch}")
    # every 3 batches (the count restarts only with training) and at each epoch's end
    want = [(0, 2), (1, 0), (1, 1), (2, 0), (2, 0), (2, 3), (3, 0)]
    c.that("commits", commits == want, str(commits))
    c.that("steps untouched", steps_seen == [STEPS] * 3, str(steps_seen))

    # Resuming in the middle of epoch 5: Horovod lowers params['steps'] by state.batch.
    state.epoch, state.batch = 5, 1
    seen.clear()
    steps_seen.clear()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    c.that("resumed steps", steps_seen == [STEPS - 1], str(steps_seen))
    c.that("resumed epoch", (state.epoch, state.batch) == (6, 0), f"{state.epoch} {state.batch}")


def _fit_recovery(c: Checks, tf: Any, hvd: Any, khvd: Any, HoraInternalError: type) -> None:  # noqa: N803
    """Horovod's elastic Keras loop: the last rank fails in epoch 1; every rank resumes there."""
    keras = tf.keras
    n, me = khvd.size(), khvd.rank()
    x = make(np.dtype(np.float32), me, (BATCH * STEPS, 6))
    y = make(np.dtype(np.float32), me, (BATCH * STEPS, 1), salt=1)
    model = _build(keras, seed=me)
    model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    state = khvd.elastic.KerasState(model, batch=0, epoch=0)
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(khvd.size())])
    starts: list[tuple[int, int]] = []

    class Injector(keras.callbacks.Callback):  # type: ignore[misc, name-defined]
        def on_batch_end(self, batch: int, logs: Any = None) -> None:
            if me == n - 1 and len(starts) == 1 and state.epoch == 1 and batch == 2:
                raise HoraInternalError("injected")

    callbacks = [khvd.elastic.UpdateBatchStateCallback(state), khvd.elastic.UpdateEpochStateCallback(state),
                 khvd.elastic.CommitStateCallback(state, batches_per_commit=2), Injector()]  # fmt: skip

    @khvd.elastic.run
    def train(state: Any) -> None:
        starts.append((state.epoch, state.batch))
        state.model.fit(x, y, batch_size=BATCH, epochs=3 - state.epoch, callbacks=callbacks, verbose=0, shuffle=False)

    train(state)
    c.that("fit: one reset", resets == [n], str(resets))
    c.that("fit: resumed at the commit in epoch 1", starts == [(0, 0), (1, 1)], str(starts))
    c.that("fit: finished", (state.epoch, state.batch) == (3, 0), f"{state.epoch} {state.batch}")
    everyone = _gathered(hvd, model.get_weights())
    c.that("fit: same weights everywhere", all(e == everyone[0] for e in everyone))


def elastic_job(legacy_keras: bool) -> list[str]:
    tf, hvd = start()
    import hora.keras
    import hora.tensorflow.elastic
    import hora.tensorflow.keras as khvd
    import hora.tensorflow.keras.elastic
    from hora.errors import HoraInternalError

    c = Checks()
    c.that("Keras version", tf.keras.__name__.startswith("tf_keras") == legacy_keras, tf.keras.__name__)
    c.that("hvd.elastic", hvd.elastic is hora.tensorflow.elastic and khvd.elastic is hora.tensorflow.keras.elastic)
    from hora.keras.elastic import CommitStateCallback, KerasState

    c.that("hora.keras", hora.keras.elastic.run is hvd.elastic.run and "elastic" in hora.keras.__all__)
    same = (KerasState, CommitStateCallback) == (khvd.elastic.KerasState, khvd.elastic.CommitStateCallback)
    c.that("hora.keras.elastic", same)
    c.that("__all__", "elastic" in hvd.__all__ and "elastic" in khvd.__all__)
    _states(c, tf, hvd)
    _recovery(c, tf, hvd, HoraInternalError)
    _fit_callbacks(c, tf, khvd)
    _fit_recovery(c, tf, hvd, khvd, HoraInternalError)
    hvd.shutdown()
    return c.problems


@pytest.mark.parametrize(
    "size, legacy_keras", [(1, False), (2, False), (2, True)], ids=["1-keras3", "2-keras3", "2-keras2"]
)
@pytest.mark.timeout(300)
def test_tensorflow_elastic(size: int, legacy_keras: bool) -> None:
    env = dict(TF_ENV, TF_USE_LEGACY_KERAS="1" if legacy_keras else "0")
    results = run_ranks(size, elastic_job, legacy_keras, timeout=280, env=env)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems[:30])
