"""hora.mxnet's training side at 2 and 3 ranks, and the Gluon example through horarun.

DistributedTrainer and DistributedOptimizer must update every rank exactly as one
process training on all ranks' batches together; broadcast_parameters must give every
rank the root's Gluon parameters, deferred ones included. Like tests/test_mxnet.py,
these run in MXNet's environment (.venv-mxnet).
"""

from __future__ import annotations

import pytest

import mxnet_support  # noqa: F401  (first: imports hora.mxnet, then mxnet may be imported)

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import gluon  # noqa: E402

from harness import check_digits_example, run_ranks  # noqa: E402

pytestmark = pytest.mark.ranks
PER_RANK = 4  # examples per rank and step
STEPS = 3
HYPER = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}


def _net(prefix: str) -> gluon.nn.HybridSequential:
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Dense(5, activation="relu", in_units=6), gluon.nn.Dense(3, in_units=5))
    return net


def _values(net: gluon.Block) -> list[np.ndarray]:
    params = net.collect_params()
    return [params[key].data().asnumpy() for key in sorted(params.keys())]


def _pair(hvd: object, rank: int) -> tuple[gluon.Block, gluon.Block]:
    """A model on this rank (different initial weights on each, then rank 0's) and a copy for the reference."""
    mx.random.seed(rank)
    net = _net("dist_")
    net.initialize(mx.init.Xavier())
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)  # type: ignore[attr-defined]
    reference = _net("ref_")
    reference.initialize()
    for mine, theirs in zip(
        [net.collect_params()[k] for k in sorted(net.collect_params().keys())],
        [reference.collect_params()[k] for k in sorted(reference.collect_params().keys())],
    ):
        theirs.set_data(mine.data().copy())
    return net, reference


def _batch(step: int, size: int) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
    rng = np.random.default_rng(step)
    x = rng.normal(size=(PER_RANK * size, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=PER_RANK * size).astype(np.float32)
    return mx.nd.array(x), mx.nd.array(y)


def _backward(net: gluon.Block, x: mx.nd.NDArray, y: mx.nd.NDArray) -> None:
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    with mx.autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()


def _compare(case: str, net: gluon.Block, reference: gluon.Block, tol: float, problems: list[str]) -> None:
    for i, (got, want) in enumerate(zip(_values(net), _values(reference))):
        if not np.allclose(got, want, rtol=tol, atol=tol):
            problems.append(f"{case}: parameter {i} differs from one process on the whole batch by "
                            f"{np.abs(got - want).max():.2e}")  # fmt: skip


def equivalence_job() -> list[str]:
    import hora.mxnet as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    # DistributedTrainer, with each of its options.
    variants = {
        "plain": {},
        "gradient_predivide_factor=2": {"gradient_predivide_factor": 2.0},
        "num_groups=2": {"num_groups": 2},
        "prefix": {"prefix": "t2."},
        "fp16": {"compression": hvd.Compression.fp16},
    }
    for case, options in variants.items():
        net, reference = _pair(hvd, me)
        trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(HYPER), **options)
        single = gluon.Trainer(reference.collect_params(), "sgd", dict(HYPER), kvstore=None)
        for step in range(STEPS):
            x, y = _batch(step, n)
            _backward(net, x[me * PER_RANK : (me + 1) * PER_RANK], y[me * PER_RANK : (me + 1) * PER_RANK])
            trainer.step(PER_RANK)
            _backward(reference, x, y)
            single.step(PER_RANK * n)
        _compare(f"DistributedTrainer {case}", net, reference, 1e-2 if case == "fp16" else 1e-5, problems)
    # DistributedOptimizer inside a Gluon Trainer (aggregated updates: lists of indices) ...
    for case, options in {"plain": {}, "num_groups=2": {"num_groups": 2}, "predivide": {"gradient_predivide_factor": 4.0}}.items():
        net, reference = _pair(hvd, me)
        optimizer = hvd.DistributedOptimizer(mx.optimizer.SGD(**HYPER), **options)
        trainer = gluon.Trainer(net.collect_params(), optimizer, kvstore=None)
        single = gluon.Trainer(reference.collect_params(), mx.optimizer.SGD(**HYPER), kvstore=None)
        for step in range(STEPS):
            x, y = _batch(step, n)
            _backward(net, x[me * PER_RANK : (me + 1) * PER_RANK], y[me * PER_RANK : (me + 1) * PER_RANK])
            trainer.step(PER_RANK)
            _backward(reference, x, y)
            single.step(PER_RANK * n)
        _compare(f"DistributedOptimizer in a Trainer {case}", net, reference, 1e-5, problems)
    # ... and through an Updater one parameter at a time (the Module API's way).
    net, reference = _pair(hvd, me)
    updater = mx.optimizer.get_updater(hvd.DistributedOptimizer(mx.optimizer.SGD(rescale_grad=1.0 / PER_RANK, **HYPER)))
    single = mx.optimizer.get_updater(mx.optimizer.SGD(rescale_grad=1.0 / (PER_RANK * n), **HYPER))
    for step in range(STEPS):
        x, y = _batch(step, n)
        _backward(net, x[me * PER_RANK : (me + 1) * PER_RANK], y[me * PER_RANK : (me + 1) * PER_RANK])
        _backward(reference, x, y)
        params, ref_params = net.collect_params(), reference.collect_params()
        for i, (key, ref_key) in enumerate(zip(sorted(params.keys()), sorted(ref_params.keys()))):
            updater(i, params[key].grad(), params[key].data())
            single(i, ref_params[ref_key].grad(), ref_params[ref_key].data())
    _compare("DistributedOptimizer through an Updater", net, reference, 1e-5, problems)
    hvd.shutdown()
    return problems


@pytest.mark.parametrize("size", [2, 3])
def test_trainer_and_optimizer_match_one_process_on_the_whole_batch(size: int) -> None:
    for rank, problems in enumerate(run_ranks(size, equivalence_job, timeout=180)):
        assert problems == [], f"rank {rank}: {problems}"


def broadcast_job() -> list[str]:
    import hora.mxnet as hvd

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems: list[str] = []
    root = n - 1
    mx.random.seed(100 + me)
    # Initialised parameters, from a root other than 0, with a prefix.
    net = _net("b_")
    net.initialize(mx.init.Xavier())
    hvd.broadcast_parameters(net.collect_params(), root_rank=root, prefix="first.")
    values = hvd.allgather_object(_values(net))
    if not all(np.array_equal(a, b) for a, b in zip(values[me], values[root])):
        problems.append("broadcast_parameters: this rank's parameters are not the root's")
    # Deferred initialisation: the shapes come with the first batch, then the broadcast happens.
    lazy = gluon.nn.HybridSequential(prefix="lazy_")
    with lazy.name_scope():
        lazy.add(gluon.nn.Dense(4, activation="relu"), gluon.nn.Dense(2))
    lazy.initialize(mx.init.Xavier())
    hvd.broadcast_parameters(lazy.collect_params(), root_rank=root, prefix="lazy.")
    lazy(mx.nd.ones((1, 7)))  # the deferred parameters are initialised here, and broadcast
    values = hvd.allgather_object(_values(lazy))
    if not all(np.array_equal(a, b) for a, b in zip(values[me], values[root])):
        problems.append("broadcast_parameters: deferred parameters are not the root's after initialisation")
    # A dict of NDArrays (the Module API's get_params()).
    arrays = {"w": mx.nd.full((2, 2), me), "b": mx.nd.full((2,), me)}
    hvd.broadcast_parameters(arrays, root_rank=root, prefix="arrays.")
    if not all((a.asnumpy() == root).all() for a in arrays.values()):
        problems.append("broadcast_parameters: a dict of NDArrays was not overwritten with the root's")
    try:
        hvd.broadcast_parameters([mx.nd.ones(2)], root_rank=0)
        problems.append("a list was accepted")
    except ValueError as exc:
        if "invalid params" not in str(exc):
            problems.append(f"a list: {exc}")
    hvd.shutdown()
    return problems


@pytest.mark.parametrize("size", [2, 3])
def test_broadcast_parameters_of_a_gluon_net(size: int) -> None:
    for rank, problems in enumerate(run_ranks(size, broadcast_job, timeout=120)):
        assert problems == [], f"rank {rank}: {problems}"


@pytest.mark.timeout(300)
def test_gluon_digits_example_reaches_95_percent_on_two_ranks() -> None:
    check_digits_example("examples/mxnet/gluon_digits.py", timeout=280)
