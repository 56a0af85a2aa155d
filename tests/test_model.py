"""The scaling model (hora.bench.model): its algorithms' step and byte counts, its fit,
and its fit to numbers recorded on the emulated cluster (docs/scaling.md)."""

from __future__ import annotations

import numpy as np
import pytest

from hora.bench import model
from hora.engine import algorithms


def test_counts_of_each_algorithm() -> None:
    assert model.ring_allreduce(4, 400) == (6, 600)
    assert model.ring_allreduce(1, 400) == (0, 0)
    assert model.doubling_allreduce(8, 10) == (3, 30)
    assert model.doubling_allreduce(6, 10) == (4, 40)  # fold, two doublings, unfold
    assert model.ring_allgather(4, 400) == (3, 300)
    assert model.direct_broadcast(4, 10) == (1, 30)
    assert model.scatter_allgather_broadcast(4, 400) == (4, 600)
    assert model.tree_broadcast(5, 10) == (3, 30)


def test_hora_choice_follows_the_engine_switch_points() -> None:
    small, large = algorithms.DOUBLING_MAX_BYTES, algorithms.DOUBLING_MAX_BYTES + 4
    assert model.hora_allreduce_flat(8, small) == model.doubling_allreduce(8, small)
    assert model.hora_allreduce_flat(8, large) == model.ring_allreduce(8, large)
    big = algorithms.SCATTER_BROADCAST_MIN_BYTES
    assert model.hora_broadcast(3, big) == model.scatter_allgather_broadcast(3, big)
    assert model.hora_broadcast(2, big) == model.direct_broadcast(2, big)
    assert model.hora_broadcast(3, big - 4) == model.direct_broadcast(3, big - 4)


def test_fit_recovers_known_constants_from_noisy_times() -> None:
    truth = model.Link(alpha=80e-6, beta=8e-9)
    rng = np.random.default_rng(0)
    samples = [
        model.Sample(c, n, size, truth.time(model.hora_cost(c, n, size)) * (1 + rng.normal(0, 0.02)), "1gbit")
        for c in ("allreduce", "allgather", "broadcast")
        for n in (2, 3, 4, 6, 8)
        for size in (4, 4096, 65536, 1 << 20, 64 << 20)
    ]
    link = model.fit(samples)
    assert link.alpha == pytest.approx(truth.alpha, rel=0.1)
    assert link.beta == pytest.approx(truth.beta, rel=0.05)
    assert np.median(np.abs(model.relative_errors(link, samples))) < 0.03


def test_fit_keeps_both_constants_non_negative() -> None:
    # Times that fall with the step count would give a negative alpha: it is dropped.
    samples = [model.Sample("allreduce", n, 1 << 20, 0.01 - 0.0001 * n, "x") for n in (2, 4, 8)]
    link = model.fit(samples)
    assert link.alpha >= 0 and link.beta >= 0


def test_predictions_name_the_cheapest_algorithm() -> None:
    link = model.Link(alpha=100e-6, beta=8e-9)
    rows = model.predictions(link, local_beta=4e-10)
    assert {row["ranks"] for row in rows} == set(model.PREDICT_RANKS)
    for row in rows:
        assert row["times"][row["best"]] == min(row["times"].values())
    small = next(r for r in rows if r["ranks"] == 1024 and r["size"] == 4)
    assert small["best"].endswith("doubling")  # latency-bound: fewest steps wins
    large = next(r for r in rows if r["ranks"] == 64 and r["size"] == 256 << 20)
    assert large["best"] == "hierarchical ring"
