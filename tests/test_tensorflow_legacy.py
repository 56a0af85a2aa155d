"""Horovod's TF1 training: ``hvd.DistributedOptimizer`` around a ``tf.compat.v1.train``
optimizer and ``hvd.BroadcastGlobalVariablesHook`` in a ``MonitoredTrainingSession``,
as Horovod's examples/tensorflow/tensorflow_mnist.py trains; also eagerly.

Each rank starts from its own weights and has its own gradient (``x_r``); the hook makes
every rank start from rank 0's weights, and every step applies the gradient averaged
over the ranks, so the weights after k steps are known exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from harness import run_ranks
from test_tensorflow_graphs import expect_no_problems
from test_tensorflow_ops import TF_ENV, Checks, start

pytestmark = pytest.mark.framework

LR = 0.1


def _graph(tf: Any, hvd: Any, optimizer: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """w (shared), b (local to each rank), the loss sum(w * x_r) + sum(b * x_r), and the train op."""
    me = hvd.rank()
    x = tf.constant([me + 1.0, 1.0])
    w = tf.compat.v1.get_variable("w", initializer=tf.constant([me + 1.0, 2.0 * (me + 1)]))
    b = tf.compat.v1.get_variable("b", initializer=tf.constant([0.0, 0.0]))
    opt = hvd.DistributedOptimizer(optimizer, **kwargs)
    opt.register_local_var(b)
    step = tf.compat.v1.train.get_or_create_global_step()
    train = opt.minimize(tf.reduce_sum(w * x) + tf.reduce_sum(b * x), global_step=step)
    return w, b, step, train


def legacy_job() -> list[str]:
    tf, hvd = start()
    c = Checks()
    me, n = hvd.rank(), hvd.size()
    x = np.array([me + 1.0, 1.0])
    g = np.array([(n + 1) / 2, 1.0])  # the averaged gradient of w
    w0 = np.array([1.0, 2.0])  # rank 0's
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=8)

    with tf.Graph().as_default():
        w, b, step, train = _graph(tf, hvd, tf.compat.v1.train.GradientDescentOptimizer(LR))
        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks, config=config) as session:
            c.close("after the hook", session.run(w), w0)
            for _ in range(3):
                session.run(train)
            c.close("w after 3 steps", session.run(w), w0 - 3 * LR * g)
            c.close("b: local, its gradient divided by the size", session.run(b), -3 * LR * x / n)
            c.that("global step", session.run(step) == 3, str(session.run(step)))

    # Every second run applies the two summed gradients; slots made under tf.cond.
    with tf.Graph().as_default():
        momentum = tf.compat.v1.train.MomentumOptimizer(LR, 0.9)
        w, _, step, train = _graph(tf, hvd, momentum, backward_passes_per_step=2)
        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks, config=config) as session:
            session.run(train)
            c.close("passes=2: nothing applied after one run", session.run(w), w0)
            session.run(train)
            c.close("passes=2: applied after two", session.run(w), w0 - LR * 2 * g)
            session.run([train])
            session.run([train])
            c.close("passes=2: momentum after four", session.run(w), w0 - LR * 2 * g - LR * 1.9 * 2 * g)
            c.that("passes=2: the global step counts every run", session.run(step) == 4, str(session.run(step)))

    # Eagerly, with a callable loss.
    w = tf.Variable([me + 1.0, 2.0 * (me + 1)])
    hvd.broadcast_variables([w], root_rank=0)
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR))
    opt.minimize(lambda: tf.reduce_sum(w * tf.constant(x, tf.float32)), var_list=[w])
    c.close("eager step", w, w0 - LR * g)
    sgd = tf.compat.v1.train.GradientDescentOptimizer(LR)
    passes = lambda: hvd.DistributedOptimizer(sgd, backward_passes_per_step=2)  # noqa: E731
    c.raises("eager passes", passes, ValueError, "eager execution")
    c.raises("Adasum", lambda: hvd.DistributedOptimizer(sgd, op=hvd.Adasum), NotImplementedError, "Adasum")
    hvd.shutdown()
    return c.problems


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.timeout(200)
def test_tf1_distributed_optimizer_and_broadcast_hook_train_as_horovods(size: int) -> None:
    expect_no_problems(run_ranks(size, legacy_job, timeout=180, env=TF_ENV))
