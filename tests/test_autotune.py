"""Autotune: the optimiser finds optima, the tuner scores and settles, every rank switches alike."""

from __future__ import annotations

import csv
import dataclasses
import secrets
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import run_ranks
from hora.collectives import shm_ops
from hora.collectives.reduce import DataType, reducer
from hora.config import Config
from hora.config.knobs import MIB
from hora.engine import autotune
from hora.engine.autotune import HEADER, Params, Tuner
from hora.engine.bayes import BayesianOptimizer
from hora.engine.messages import Response, ResponseType, decode_responses, encode_responses
from hora.engine.shm_group import ShmGroup
from hora.errors import ProtocolError
from hora.transport import shm

SCORE = HEADER.index("score")


def _maximise(f: Any, dims: int, budget: int, seed: int) -> np.ndarray:
    optimizer = BayesianOptimizer(dims, noise=0.01, seed=seed)
    for _ in range(budget):
        point = optimizer.suggest()
        optimizer.observe(point, f(point))
    best, _ = optimizer.best()
    return best


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_optimiser_finds_the_peak_of_a_1d_function(seed: int) -> None:
    best = _maximise(lambda x: -((x[0] - 0.3) ** 2), dims=1, budget=10, seed=seed)
    assert abs(best[0] - 0.3) < 0.05


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_optimiser_finds_the_peak_of_a_2d_function(seed: int) -> None:
    peak = np.array([0.7, 0.2])
    best = _maximise(lambda x: float(np.exp(-8 * ((x - peak) ** 2).sum())), dims=2, budget=20, seed=seed)
    assert np.linalg.norm(best - peak) < 0.1


@pytest.mark.unit
def test_the_optimiser_is_deterministic_for_a_seed() -> None:
    runs = [_maximise(lambda x: -abs(x[0] - 0.6), dims=1, budget=6, seed=5) for _ in range(2)]
    assert np.array_equal(runs[0], runs[1])


@pytest.mark.unit
def test_a_parameter_change_survives_the_wire() -> None:
    params = Params(3 * MIB + 65536, 1250, 4 * MIB)
    (decoded,) = decode_responses(encode_responses([params.response()]))
    assert decoded.type == ResponseType.PARAMS
    assert Params.from_response(decoded) == params


@pytest.mark.unit
@pytest.mark.parametrize(
    "sizes",
    [[], [autotune.PARAMS_FORMAT, 1], [autotune.PARAMS_FORMAT + 1, 1, 2, 0], [autotune.PARAMS_FORMAT, -1, 0, 0],
     [autotune.PARAMS_FORMAT, 1, 2, -1], [autotune.PARAMS_FORMAT, 1, 2, autotune.MAX_STAGING_BYTES + 1],
     [autotune.PARAMS_FORMAT, 1, 2], [autotune.PARAMS_FORMAT, 1, 2, 3, 4]],
)  # fmt: skip
def test_a_malformed_parameter_change_is_a_protocol_error(sizes: list[int]) -> None:
    with pytest.raises(ProtocolError):
        Params.from_response(Response(ResponseType.PARAMS, [autotune.PARAMS_NAME], 0, sizes=sizes))


def _tuner_config(log: Path | None, **overrides: Any) -> Config:
    return dataclasses.replace(
        Config(), autotune=True, autotune_log=None if log is None else str(log), autotune_warmup_samples=1,
        autotune_steps_per_sample=2, autotune_bayes_opt_max_samples=8, **overrides,
    )  # fmt: skip


def _run_steps(tuner: Tuner, seconds_per_step: Any, steps: int) -> list[Params]:
    """Drives ``tuner`` through training steps of two tensors (1 MiB each) on a fake clock
    where a step takes ``seconds_per_step(params)``; returns the changes it asked for."""
    clock = [0.0]
    tuner._clock = lambda: clock[0]
    changes = []
    for _ in range(steps):
        for name in ("a", "b"):
            change = tuner.observe([name], MIB)
            if change is not None:
                changes.append(change)
        clock[0] += seconds_per_step(tuner.current)
    return changes


@pytest.mark.unit
def test_the_tuner_scores_samples_logs_them_and_settles_on_the_best(tmp_path: Path) -> None:
    log = tmp_path / "autotune.csv"
    tuner = Tuner(_tuner_config(log))

    def seconds(params: Params) -> float:  # fastest at 8 MiB and no cycle time
        return 1.0 + abs(np.log2(params.fusion_threshold / (8 * MIB))) + params.cycle_time_ms

    changes = _run_steps(tuner, seconds, steps=60)
    assert not tuner.active
    assert len(tuner.scored) == 8
    rows = list(csv.reader(log.open()))
    assert tuple(rows[0]) == HEADER
    assert len(rows) == 9
    best_row = max(rows[1:], key=lambda row: float(row[SCORE]))
    best, best_score = max(tuner.scored, key=lambda scored: scored[1])
    assert float(best_row[SCORE]) == best_score
    assert all(float(row[-1]) == 0 for row in rows[1:]), "no shared memory: no staging size"
    assert float(best_row[4]) == best.cycle_time_ms and float(best_row[5]) * MIB == best.fusion_threshold
    assert tuner.current == best == changes[-1]
    # Scores are bytes per second of the sample's steps: 2 MiB a step.
    first, first_score = tuner.scored[0]
    assert first == Params.of(Config())
    assert first_score == pytest.approx(2 * MIB / seconds(first))


@pytest.mark.unit
def test_the_tuner_leaves_parameters_set_by_hand() -> None:
    tuner = Tuner(_tuner_config(None, cycle_time_ms=2.0), fixed=[autotune.CYCLE])
    changes = _run_steps(tuner, lambda params: 1.0 + params.fusion_threshold / MIB / 128, steps=60)
    assert changes and all(change.cycle_time_us == 2000 for change in changes)
    assert not Tuner(_tuner_config(None), fixed=[autotune.CYCLE, autotune.FUSION]).active
    # The staging size is tuned only where rank 0 shares memory, and not when set by hand.
    assert Tuner(_tuner_config(None), fixed=[autotune.CYCLE, autotune.FUSION], staging_bytes=2 * MIB).active
    by_hand = Tuner(_tuner_config(None), fixed=[autotune.STAGING], staging_bytes=2 * MIB)
    changes = _run_steps(by_hand, lambda params: 1.0 + params.fusion_threshold / MIB / 128, steps=60)
    assert changes and all(change.staging_bytes == 2 * MIB for change in changes)


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_the_tuner_finds_the_best_staging_size(seed: int) -> None:
    tuner = Tuner(_tuner_config(None), fixed=[autotune.CYCLE, autotune.FUSION], seed=seed, staging_bytes=2 * MIB)
    assert tuner.current.staging_bytes == 2 * MIB

    def seconds(params: Params) -> float:  # fastest at 4 MiB
        return 1.0 + abs(np.log2(params.staging_bytes / (4 * MIB)))

    changes = _run_steps(tuner, seconds, steps=60)
    assert not tuner.active
    tried = {params.staging_bytes for params, _ in tuner.scored}
    assert tried <= {m * MIB for m in range(1, 17)}, "whole MiB from 1 to 16"
    assert changes[-1].staging_bytes == 4 * MIB


@pytest.mark.unit
@pytest.mark.skipif(not shm.supported(), reason="shared memory needs an x86-64 Linux machine")
def test_shared_memory_collectives_switch_staging_sizes_between_collectives() -> None:
    """Three thread ranks, each with its own domain: every rank switches the staging size
    at the same point, allreduces stay right, and a round fills only what it is told."""
    n, reserve = 3, 64 * 1024
    key = shm.job_key(secrets.token_bytes(16))
    domains = [shm.Domain(key, 0, range(n), rank, reserve // 2, 8 * 1024 // 2) for rank in range(n)]
    for domain in domains:
        domain.attach()
    for domain in domains:
        domain.unlink()
    sizes = [16 * 1024, 64 * 1024, 4 * 1024, 1 * 1024]  # staging bytes, switched to in turn
    results: list[object] = [None] * n
    used: list[list[int]] = [[] for _ in range(n)]

    def rank_main(rank: int) -> None:
        try:
            group = ShmGroup(domains[rank], tuple(range(n)))
            sums = []
            for staging in sizes:
                domains[rank].use_staging(staging)
                used[rank].append(group.half_bytes)
                for count in (1, 5_000, 40_000):  # one round, several, many
                    data = np.arange(count, dtype=np.float32) * (rank + 1)
                    shm_ops.allreduce(group, data, reducer(1, DataType.FLOAT32))
                    sums.append(bool(np.array_equal(data, np.arange(count, dtype=np.float32) * 6)))
            results[rank] = sums
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[rank] = exc

    try:
        for rank in range(n):  # the area past what the rounds use stays as it was
            domains[rank].stage(rank, 0)[8 * 1024 :] = 0xEE
        domains[0].use_staging(2 * reserve)  # more than was mapped: all of it
        assert domains[0].round_bytes == reserve // 2
        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert all(result == [True] * 12 for result in results), results
        assert used == [[8 * 1024, 32 * 1024, 4096, 4096]] * n, "half the size, page aligned, at most the half"
    finally:
        for domain in domains:
            domain.close()


def autotune_job(steps: int) -> dict[str, Any]:
    import numpy as np

    import hora.numpy as hvd
    from hora.core.api import current

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    sizes = [3, 1000, 40_000, 250_000, 17, 70_000]
    problems = []
    for step in range(steps):
        handles = [
            hvd.allreduce_async(np.full(size, float(me + 1 + step), dtype=np.float32), name=f"g{i}", op=hvd.Sum)
            for i, size in enumerate(sizes)
        ]
        expected = float(sum(rank + 1 + step for rank in range(n)))
        for i, handle in enumerate(handles):
            got = hvd.synchronize(handle)
            if got.shape != (sizes[i],) or not np.all(got == expected):
                problems.append(f"step {step} g{i}: {got[:3]} != {expected}")
    hvd.barrier()  # every change sent before the barrier's response is applied now
    engine = current().engine
    tuner = engine.control.tuner
    result = {
        "applied": list(engine.stats().autotuned),
        "problems": problems,
        "cycle_time_ms": engine.control.cycle_time_ms,
        "tuner_active": None if tuner is None else tuner.active,
        "threshold": None if engine.control.coordinator is None else engine.control.coordinator.fusion_threshold,
        "staging": None if engine.control.domain is None else 2 * engine.control.domain.round_bytes,
        "tuned": None if tuner is None else list(tuner._free),
    }
    hvd.shutdown()
    return result


@pytest.mark.ranks
@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_switches_alike_and_ends_on_the_logged_best(size: int, tmp_path: Path) -> None:
    log = tmp_path / "autotune.csv"
    env = {
        "HORA_AUTOTUNE": "1",
        "HORA_AUTOTUNE_LOG": str(log),
        "HORA_AUTOTUNE_WARMUP_SAMPLES": "1",
        "HORA_AUTOTUNE_STEPS_PER_SAMPLE": "2",
        "HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "4",
    }
    results = run_ranks(size, autotune_job, 40, env=env, timeout=60)
    for rank, result in enumerate(results):
        assert result["problems"] == [], f"rank {rank}"
    applied = results[0]["applied"]
    assert applied, "the tuner changed nothing"
    for rank, result in enumerate(results):
        assert result["applied"] == applied, f"rank {rank} applied other changes than rank 0"
    assert results[0]["tuner_active"] is False, "the tuner did not settle within the steps"
    rows = list(csv.reader(log.open()))
    assert tuple(rows[0]) == HEADER
    assert len(rows) == 1 + 4
    best = max(rows[1:], key=lambda row: float(row[SCORE]))
    final_threshold, final_cycle, final_staging = applied[-1]
    logged = (float(best[5]) * MIB, float(best[4]), float(best[-1]) * MIB)
    assert logged == (final_threshold, final_cycle, final_staging)
    assert results[0]["threshold"] == final_threshold
    assert results[0]["tuned"] == [autotune.FUSION, autotune.CYCLE, autotune.STAGING]
    for result in results:
        assert result["cycle_time_ms"] == final_cycle
        assert result["staging"] == final_staging


def malformed_change_job() -> str:
    import numpy as np

    import hora.numpy as hvd
    from hora.core.api import current
    from hora.engine.autotune import PARAMS_NAME
    from hora.engine.messages import Response, ResponseType

    hvd.init()
    if hvd.rank() == 0:
        coordinator = current().engine.control.coordinator
        assert coordinator is not None

        def emit_to_all(response: Response) -> None:  # the workers get a change of an unknown layout
            coordinator._emit(response, (0,))
            malformed = Response(ResponseType.PARAMS, [PARAMS_NAME], 0, sizes=[99, 1, 2])
            coordinator._emit(malformed, tuple(range(1, hvd.size())))

        coordinator.emit_to_all = emit_to_all  # type: ignore[method-assign]
    try:
        for _ in range(100):
            for i, size in enumerate([10, 5000, 100_000]):
                hvd.allreduce(np.ones(size, dtype=np.float32), name=f"g{i}")
    except hvd.HorovodInternalError as exc:
        return str(exc)
    finally:
        hvd.shutdown()
    return "no error"


@pytest.mark.ranks
def test_a_malformed_change_fails_the_job_on_every_rank() -> None:
    env = {"HORA_AUTOTUNE": "1", "HORA_AUTOTUNE_WARMUP_SAMPLES": "0", "HORA_AUTOTUNE_STEPS_PER_SAMPLE": "1"}
    results = run_ranks(2, malformed_change_job, env=env, timeout=60)
    for rank, message in enumerate(results):
        assert "autotune parameter change of an unknown layout" in message, f"rank {rank}: {message}"
