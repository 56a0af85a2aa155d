"""TensorFlow graphs whose collectives every rank names alike, whatever order they run in.

In a TF1 graph under ``Session.run`` TensorFlow runs independent ops in any order, on
several threads, and the order differs between ranks; so hora names an unnamed
collective when its op is built, not when it runs. The jobs here build graphs of
collectives with no data dependencies between them, feed each through a local delay
that differs per rank and per run (so the ranks run them in different orders), and run
them many times: eagerly, inside ``tf.function`` and in a ``tf.compat.v1.Session``,
including grouped allreduce/allgather and their gradients. Every result is compared
with the same computation done eagerly, where collectives run in program order.

Also here: a check that fails on one rank only, inside a group or while a graph is
built, fails the collective on every rank (nothing of the group stays in flight), and
the job goes on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from harness import run_ranks
from test_tensorflow_ops import TF_ENV, Checks, start

pytestmark = pytest.mark.framework

# Session runs per job: with a fresh order of delays on every run, an order-dependent
# name fails within the first few runs (it failed on the first before names were drawn
# when ops are built).
SESSION_RUNS = 40
FUNCTION_RUNS = 10
INTER_OP_THREADS = 32  # each waiting collective holds one (docs/tensorflow.md)


def expect_no_problems(results: list[list[str]]) -> None:
    """Fails with the first problems of the first rank that found any."""
    for rank, problems in enumerate(results):
        assert not problems, f"rank {rank}: {problems[:8]}"


def _values(i: int, rank: int, n: int) -> np.ndarray:
    """Input ``i`` of ``rank``: its own shape per input, so a swapped name cannot pass."""
    rows = 2 * n if i == 7 else (n if i == 8 else i + 1)
    return (np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + 10 * i) * (rank + 1)


def _build(tf: Any, hvd: Any, inputs: list[Any]) -> list[Any]:
    """Nine independent collectives and the gradients of the grouped ones."""
    n = hvd.size()
    x = inputs
    outs = [
        hvd.allreduce(x[0]),
        hvd.allreduce(x[1], op=hvd.Sum),
        hvd.allgather(x[2]),
        hvd.broadcast(x[3], root_rank=n - 1),
    ]
    grouped_sum = hvd.grouped_allreduce([x[4], x[5]], op=hvd.Sum)
    gathered = hvd.grouped_allgather([x[5], x[6]])
    outs += grouped_sum + gathered
    outs.append(hvd.reducescatter(x[7], op=hvd.Sum))
    outs.append(hvd.alltoall(x[8]))
    return outs


def _grads(tf: Any, hvd: Any, inputs: list[Any], tape: Any = None) -> list[Any]:
    """Gradients through the grouped collectives: built in program order on every rank."""
    grouped_sum = hvd.grouped_allreduce([inputs[4], inputs[5]], op=hvd.Sum)
    gathered = hvd.grouped_allgather([inputs[5], inputs[6]])
    loss = sum(tf.reduce_sum(t * (i + 1.0)) for i, t in enumerate(grouped_sum + gathered))
    targets = [inputs[4], inputs[5], inputs[6]]
    return list(tape.gradient(loss, targets) if tape is not None else tf.gradients(loss, targets))


def _delayed(tf: Any, rng: np.random.Generator, a: np.ndarray) -> Any:
    """``a``, after a local sleep that differs per rank and per run (``rng`` is the rank's)."""
    import time

    def sleep(t: Any) -> Any:
        time.sleep(float(rng.uniform(0.0, 0.004)))
        return t

    out = tf.py_function(sleep, [tf.constant(a)], tf.float32)
    out.set_shape(a.shape)
    return out


def graphs_job() -> list[str]:
    tf, hvd = start()
    c = Checks()
    me, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(1000 + me)
    arrays = [_values(i, me, n) for i in range(9)]

    # The reference: eagerly, in program order.
    constants = [tf.constant(a) for a in arrays]
    want = [t.numpy() for t in _build(tf, hvd, constants)]
    with tf.GradientTape() as tape:
        tape.watch(constants)
        want_grads = [g.numpy() for g in _grads(tf, hvd, constants, tape)]
    c.close("reference allgather", want[2], np.concatenate([_values(2, r, n) for r in range(n)]))
    c.close("reference broadcast", want[3], _values(3, n - 1, n))

    def delayed(a: np.ndarray) -> Any:
        return _delayed(tf, rng, a)

    def check(mode: str, run: int, got: list[Any], grads: list[Any]) -> None:
        for i, (g, w) in enumerate(zip(got, want)):
            c.close(f"{mode} run {run} output {i}", g, w)
        for i, (g, w) in enumerate(zip(grads, want_grads)):
            c.close(f"{mode} run {run} gradient {i}", g, w)

    # Eagerly, several times (names numbered as called).
    for run in range(3):
        inputs = [delayed(a) for a in arrays]
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            grads = _grads(tf, hvd, inputs, tape)
        check("eager", run, _build(tf, hvd, inputs), grads)

    # Inside tf.function (traced once, run many times).
    @tf.function
    def step() -> tuple[list[Any], list[Any]]:
        inputs = [delayed(a) for a in arrays]
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            grads = _grads(tf, hvd, inputs, tape)
        return _build(tf, hvd, inputs), grads

    for run in range(FUNCTION_RUNS):
        got, grads = step()
        check("tf.function", run, got, grads)

    # A TF1 graph under Session.run, many threads: independent ops in any order.
    graph = tf.Graph()
    with graph.as_default():
        inputs = [delayed(a) for a in arrays]
        outs = _build(tf, hvd, inputs)
        grad_ops = _grads(tf, hvd, inputs)
        config = tf.compat.v1.ConfigProto(
            inter_op_parallelism_threads=INTER_OP_THREADS, intra_op_parallelism_threads=1
        )
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            for run in range(SESSION_RUNS):
                got, grads = session.run([outs, grad_ops])
                check("session", run, got, grads)
                if c.problems:
                    break
    hvd.shutdown()
    return c.problems


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.timeout(400)
def test_graph_collectives_agree_whatever_order_ranks_run_them(size: int) -> None:
    expect_no_problems(run_ranks(size, graphs_job, timeout=380, env=TF_ENV))


def bound_rank_default_session_job(keep_one_thread: bool) -> list[str]:
    """The graph's collectives in a Session with TensorFlow's default threads, in a rank
    bound to one CPU as mpirun binds it (TensorFlow's pool then has one thread)."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[int(os.environ["HORA_RANK"]) % len(cpus)]})
    if not keep_one_thread:
        del os.environ["TF_NUM_INTEROP_THREADS"]  # TF_ENV's; hora's default is what is checked
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    import hora.tensorflow as hvd

    hvd.init()
    c = Checks()
    me, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(2000 + me)
    arrays = [_values(i, me, n) for i in range(9)]
    want = [t.numpy() for t in _build(tf, hvd, [tf.constant(a) for a in arrays])]

    graph = tf.Graph()
    with graph.as_default():
        outs = _build(tf, hvd, [_delayed(tf, rng, a) for a in arrays])
        with tf.compat.v1.Session(graph=graph) as session:  # TensorFlow's default threads
            for run in range(SESSION_RUNS):
                for i, (got, w) in enumerate(zip(session.run(outs), want)):
                    c.close(f"session run {run} output {i}", got, w)
    hvd.shutdown()
    return c.problems


@pytest.mark.timeout(200)
def test_a_rank_bound_to_one_cpu_runs_a_sessions_independent_collectives() -> None:
    # Before hora asked TensorFlow for more inter-op threads, each rank's only thread could
    # hold a different collective and the ranks waited for each other for ever.
    expect_no_problems(run_ranks(2, bound_rank_default_session_job, False, timeout=180, env=TF_ENV))


def one_sided_job(culprit: int) -> dict[str, str]:
    tf, hvd = start()
    me, n = hvd.rank(), hvd.size()
    outcomes: dict[str, str] = {}

    def outcome(case: str, call: Any) -> None:
        try:
            call()
            outcomes[case] = "no error"
        except Exception as exc:  # noqa: BLE001 - the kind and the message are what the test checks
            outcomes[case] = f"{type(exc).__name__}: {exc}"

    # Eagerly: one member of a group has a dtype hora cannot move on the culprit alone.
    def bad_group() -> None:
        second = tf.constant(["a", "b"]) if me == culprit else tf.constant([1.0, 2.0])
        hvd.grouped_allreduce([tf.constant([1.0, 2.0]), second], name="g")

    outcome("eager group", bad_group)

    # While tracing: the culprit's trace fails, the others' op fails on its first run.
    @tf.function
    def traced() -> list[Any]:
        second = tf.constant(3.0) if me == culprit else tf.constant([3.0])
        return hvd.grouped_allgather([tf.constant([1.0]), second])

    outcome("traced group", traced)

    # The job goes on: nothing of either group is in flight.
    total = hvd.allreduce(tf.constant([float(me)]), op=hvd.Sum, name="after")
    outcomes["after"] = str(total.numpy().tolist())
    outcomes["expected after"] = str([float(sum(range(n)))])
    hvd.shutdown()
    return outcomes


@pytest.mark.parametrize("size, culprit", [(2, 1), (3, 0)], ids=["np2", "np3"])
@pytest.mark.timeout(200)
def test_a_check_one_rank_fails_ends_the_group_on_every_rank(size: int, culprit: int) -> None:
    results = run_ranks(size, one_sided_job, culprit, timeout=180, env=TF_ENV)
    for rank, got in enumerate(results):
        assert got["after"] == got["expected after"], (rank, got)
        for case in ("eager group", "traced group"):
            assert got[case] != "no error", (rank, case, got)
            if rank != culprit:
                assert f"refused by rank {culprit}" in got[case], (rank, case, got[case])
    assert "grouped_allreduce" in results[culprit]["eager group"], results[culprit]
    assert "scalar" in results[culprit]["traced group"], results[culprit]


def broadcast_gradient_only_job() -> list[str]:
    tf, hvd = start()
    c = Checks()
    me, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.full((3, 2), float(me + 1), np.float32))
        fetches = []
        for root in range(n):  # only the gradients are fetched: the broadcasts never run
            y = hvd.broadcast(x, root_rank=root)
            fetches.append(tf.gradients(y, x, tf.ones_like(y) * (me + 1.0))[0])
        with tf.compat.v1.Session(graph=graph) as session:
            for run in range(3):
                for root, grad in enumerate(session.run(fetches)):
                    # The averaged upstream gradients on the root, zeros elsewhere.
                    want = np.full((3, 2), sum(range(1, n + 1)) / n if me == root else 0.0, np.float32)
                    c.close(f"run {run} root {root}", grad, want)
    hvd.shutdown()
    return c.problems


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.timeout(200)
def test_a_session_that_fetches_only_a_broadcasts_gradient_runs_its_allreduce_on_every_rank(size: int) -> None:
    # Found with Horovod's own test_tensorflow.py: the other ranks' gradient was
    # zeros_like(allreduce), which TensorFlow folds to a constant, pruning the allreduce
    # there; the root waited for it for ever. Horovod's gradient is allreduce * 0.
    expect_no_problems(run_ranks(size, broadcast_gradient_only_job, timeout=180, env=TF_ENV))


def session_wait_job() -> list[str]:
    import logging
    import time

    tf, hvd = start()
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("hora.tensorflow").addHandler(Keep())
    graph = tf.Graph()
    with graph.as_default():
        total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
        with tf.compat.v1.Session(graph=graph) as session:
            if hvd.rank() == 1:
                time.sleep(3.0)  # rank 0's op waits past the 1 s warning time
            got = session.run(total)
    hvd.shutdown()
    return [str(got.tolist())] + [m for m in records if "in a TF1 Session" in m]


@pytest.mark.timeout(120)
def test_a_collective_waiting_in_a_session_says_it_holds_an_inter_op_thread() -> None:
    results = run_ranks(2, session_wait_job, timeout=100, env={**TF_ENV, "HORA_STALL_CHECK_TIME_SECONDS": "1"})
    assert results[0][0] == results[1][0] == "[2.0]"
    assert len(results[0]) == 2 and "inter_op_parallelism_threads=N" in results[0][1], results[0]
    assert len(results[1]) == 1, results[1]  # rank 1's op did not wait


def session_variables_job() -> list[str]:
    tf, hvd = start()
    c = Checks()
    me, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        a = tf.compat.v1.Variable(np.full((2, 2), float(me), np.float32))
        b = tf.compat.v1.Variable(np.full(3, float(me + 10), np.float64))
        sync = hvd.broadcast_global_variables(root_rank=n - 1)  # an op, as Horovod's
        (updated,) = hvd.broadcast_([a], root_rank=0)  # evaluating it runs the broadcast
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            c.close("before the op runs", session.run(a), np.full((2, 2), float(me)))
            session.run(sync)
            c.close("global variables a", session.run(a), np.full((2, 2), float(n - 1)))
            c.close("global variables b", session.run(b), np.full(3, float(n - 1 + 10)))
            session.run(b.assign(np.full(3, float(me), np.float64)))
            session.run(a.assign(np.full((2, 2), float(me + 5), np.float32)))
            c.close("broadcast_ result", session.run(updated), np.full((2, 2), 5.0))
            c.close("broadcast_ variable", session.run(a), np.full((2, 2), 5.0))
            c.close("b untouched", session.run(b), np.full(3, float(me)))
    hvd.shutdown()
    return c.problems


@pytest.mark.timeout(120)
def test_tf1_session_broadcasts_global_variables_and_in_place_through_ops() -> None:
    # Horovod's own test_horovod_broadcast_graph_mode and test_horovod_broadcast_inplace_cpu.
    expect_no_problems(run_ranks(2, session_variables_job, timeout=100, env=TF_ENV))


def stale_refusal_job() -> list[str]:
    import time

    tf, hvd = start()
    c = Checks()
    me = hvd.rank()
    with tf.Graph().as_default():
        # Rank 1's trace is refused (a scalar); rank 0 builds the op and never runs it.
        try:
            hvd.alltoall(tf.constant(1.0) if me == 1 else tf.constant([1.0, 2.0]))
            c.that("graph 1 on rank 1", me != 1, "the scalar was not refused")
        except ValueError as exc:
            c.that("graph 1 on rank 0", me == 1, str(exc))
    hvd.barrier()
    time.sleep(3.0)  # past the stall shutdown time: nobody waits for a refused op, so no stall
    hvd.barrier()
    with tf.Graph().as_default():  # the same key as graph 1's op: a new op, which every rank runs
        if me == 1:
            time.sleep(1.0)  # rank 0's request reaches the coordinator first
        out = hvd.alltoall(tf.constant([10.0 * me, 10.0 * me + 1.0]))
        with tf.compat.v1.Session() as session:
            try:
                c.close("graph 2", session.run(out), np.array([0.0, 10.0] if me == 0 else [1.0, 11.0]))
            except Exception as exc:  # noqa: BLE001 - the problem is the message
                c.problems.append(f"graph 2: {type(exc).__name__}: {exc}")
    total = hvd.allreduce(tf.constant([float(me)]), op=hvd.Sum, name="after")
    c.close("after", total, np.array([1.0]))
    hvd.shutdown()
    return c.problems


@pytest.mark.timeout(120)
def test_a_refusal_while_tracing_an_op_nobody_runs_does_not_meet_a_later_graphs_op_of_the_same_name() -> None:
    stall = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "2"}
    expect_no_problems(run_ranks(2, stale_refusal_job, timeout=60, env={**TF_ENV, **stall}))


def cond_branch_job() -> list[str]:
    tf, hvd = start()
    c = Checks()
    me, n = hvd.rank(), hvd.size()
    if me == 0:
        with tf.Graph().as_default():  # another graph: advances TensorFlow's process-wide uid on rank 0 only
            for _ in range(3):
                tf.cond(tf.constant(True), lambda: tf.constant(1.0), lambda: tf.constant(2.0))
    with tf.Graph().as_default():
        x = tf.constant([1.0 + me])
        y = tf.cond(tf.constant(True), lambda: hvd.allreduce(x, op=hvd.Sum), lambda: x)
        with tf.compat.v1.Session() as session:
            c.close("allreduce in a tf.cond branch", session.run(y), [float(sum(range(1, n + 1)))])
    hvd.shutdown()
    return c.problems


@pytest.mark.timeout(120)
def test_an_unnamed_collective_in_a_tf1_cond_branch_is_named_alike_on_every_rank() -> None:
    # The branch's graph is named cond_true_<uid>, a process-wide counter; its collective's
    # name came from it, so rank 0 (which had built more) waited for another name.
    expect_no_problems(run_ranks(2, cond_branch_job, timeout=100, env=TF_ENV))
