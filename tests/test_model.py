"""The scaling model (hora.bench.model): its algorithms' step and byte counts, its fit,
and its fit to numbers recorded on the emulated cluster (docs/scaling.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hora.bench import model
from hora.engine import algorithms


def test_counts_of_each_algorithm() -> None:
    assert model.ring_allreduce(4, 400) == (6, 600)
    assert model.ring_allreduce(1, 400) == (0, 0)
    assert model.doubling_allreduce(8, 10) == (3, 30)
    assert model.doubling_allreduce(6, 10) == (4, 40)  # fold, two doublings, unfold
    assert model.halving_allreduce(8, 800) == (6, 1400)  # the ring's bytes in 2 log2 n steps
    assert model.ring_allgather(4, 400) == (3, 300)
    assert model.direct_broadcast(4, 10) == (1, 30)
    assert model.scatter_allgather_broadcast(4, 400) == (4, 600)
    assert model.chain_broadcast(4, 64 << 20) == (3, (64 << 20) + 2 * (512 << 10))  # 512 KiB chunks
    assert model.chain_broadcast(2, 400) == model.direct_broadcast(2, 400)
    assert model.tree_broadcast(8, 10) == (3, 30)
    assert model.tree_broadcast(5, 10) == (3, 30)  # 4 -> 8 ranks take the same rounds
    assert model.tree_broadcast(4, 10) == (2, 20)


def test_hora_choice_follows_the_engine_switch_points() -> None:
    small, large = algorithms.DOUBLING_MAX_BYTES, algorithms.DOUBLING_MAX_BYTES + 4
    assert model.hora_allreduce_flat(8, small) == model.doubling_allreduce(8, small)
    assert model.hora_allreduce_flat(8, large) == model.ring_allreduce(8, large)
    big = algorithms.SCATTER_BROADCAST_MIN_BYTES
    assert model.hora_broadcast(16, big) == model.scatter_allgather_broadcast(16, big)  # 16 chunks of 16 KiB
    assert model.hora_broadcast(4, big) == model.chain_broadcast(4, big)
    assert model.hora_broadcast(3, big) == model.chain_broadcast(3, big)
    assert model.hora_broadcast(8, 64 << 20) == model.chain_broadcast(8, 64 << 20)
    assert model.hora_broadcast(2, big) == model.direct_broadcast(2, big)
    assert model.hora_broadcast(3, big - 4) == model.tree_broadcast(3, big - 4)
    tree = algorithms.TREE_BROADCAST_MIN_BYTES
    assert model.hora_broadcast(8, tree) == model.tree_broadcast(8, tree)
    assert model.hora_broadcast(8, tree - 4) == model.direct_broadcast(8, tree - 4)
    assert model.hora_broadcast(2, tree) == model.direct_broadcast(2, tree)


def test_fit_recovers_known_constants_from_noisy_times() -> None:
    truth = model.Link(alpha=80e-6, beta=8e-9, fixed=300e-6, per_rank=150e-6)
    rng = np.random.default_rng(0)
    samples = []
    for c in ("allreduce", "allgather", "broadcast"):
        for n in (2, 3, 4, 6, 8):
            for size in (4, 4096, 65536, 1 << 20, 64 << 20):
                exact = truth.time(model.hora_cost(c, n, size), ranks=n)
                samples.append(model.Sample(c, n, size, exact * (1 + rng.normal(0, 0.02)), "1gbit"))
    link = model.fit(samples)
    assert link.beta == pytest.approx(truth.beta, rel=0.05)
    assert link.alpha == pytest.approx(truth.alpha, rel=0.3)
    assert link.per_rank == pytest.approx(truth.per_rank, rel=0.3)
    assert np.median(np.abs(model.relative_errors(link, samples))) < 0.03


def test_fit_keeps_every_constant_non_negative() -> None:
    # Times that fall with the rank count would give a negative per-rank cost: it is dropped.
    samples = [model.Sample("allreduce", n, size, 0.01 - 0.0001 * n + size * 1e-9, "x")
               for n in (2, 4, 8) for size in (4, 1 << 20)]  # fmt: skip
    link = model.fit(samples)
    assert min(link.alpha, link.beta, link.fixed, link.per_rank) >= 0


def test_fit_to_the_recorded_emulated_cluster() -> None:
    """The numbers docs/scaling.md fits (tests/recorded/cluster-1gbit.json): 1 Gbit/s links,
    2-8 hosts. The fitted bandwidth is the link's rate less TCP/IP headers (tbf counts
    them: 0.955 of 1 Gbit/s carries payload), and large messages follow the model closely."""
    samples = model.load_samples([Path(__file__).parent / "recorded" / "cluster-1gbit.json"])
    assert len(samples) == 96
    link = model.fit(model.fitted_samples(samples))
    assert 1e-9 / link.beta == pytest.approx(0.125 * 0.955, rel=0.05)  # GB/s
    assert 10e-6 < link.alpha < 1e-3
    large = [s for s in samples if s.size >= 16 << 20]  # broadcast too: the chain follows the model
    assert max(abs(e) for e in model.relative_errors(link, large)) < 0.1
    assert np.median(np.abs(model.relative_errors(link, model.fitted_samples(samples)))) < 0.15


def test_predictions_name_the_cheapest_algorithm() -> None:
    link = model.Link(alpha=100e-6, beta=8e-9)
    rows = model.predictions(link, local_beta=4e-10)
    assert {row["ranks"] for row in rows} == set(model.PREDICT_RANKS)
    for row in rows:
        assert row["times"][row["best"]] == min(row["times"].values())
    small = next(r for r in rows if r["ranks"] == 1024 and r["size"] == 4)
    assert small["best"].endswith("doubling")  # latency-bound: fewest steps wins
    large = next(r for r in rows if r["ranks"] == 64 and r["size"] == 256 << 20)
    # Bandwidth-bound: the ring and halving carry the same bytes (halving's fewer steps
    # count for almost nothing); both far ahead of everything flat or doubling.
    times = large["times"]
    assert times["hierarchical halving"] == pytest.approx(times["hierarchical ring"], rel=0.01)
    others = (times["flat ring"], times["flat doubling"], times["hierarchical doubling"])
    assert max(times["hierarchical ring"], times["hierarchical halving"]) < min(others)
    middle = next(r for r in rows if r["ranks"] == 1024 and r["size"] == 1 << 20)
    assert middle["best"] == "hierarchical halving"  # the ring's bytes in log steps
    assert middle["hora"] == middle["times"]["hierarchical ring"]  # what hora runs instead
