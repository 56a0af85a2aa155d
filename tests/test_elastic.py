"""The worker side of elastic training: State, ObjectState, run_fn, hvd.elastic (NumPy and
PyTorch), TorchState and ElasticSampler.

Single-process tests fake the broadcast, the reset or the world (rank and size); the
multi-rank ones run real ranks, including a reset (``shutdown()`` then ``init()``) in the
same world, which is what a reset is outside horarun's elastic driver (its jobs are
tested in test_elastic_horarun.py and test_elastic_hosts.py).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

import hora.elastic as elastic
import hora.numpy as hvd
import hora.torch as thvd
import hora.torch.elastic as telastic
import hora.torch.elastic.sampler as tsampler
import hora.torch.elastic.state as tstate
from hora.errors import HoraInternalError, HorovodInternalError, HostsUpdatedInterrupt
from harness import run_ranks



class Log:
    """Records what run_fn did to a state, and fakes the broadcast (rank 0's view)."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def bcast(self, obj: Any) -> Any:
        self.events.append("bcast")
        return obj


class LoggedState(elastic.ObjectState):
    def __init__(self, log: Log, **kwargs: Any) -> None:
        self.log = log
        super().__init__(log.bcast, lambda: 0, **kwargs)

    def sync(self) -> None:
        self.log.events.append("sync")
        super().sync()

    def restore(self) -> None:
        self.log.events.append("restore")
        super().restore()

    def reset(self) -> None:
        self.log.events.append("state.reset")


# --- State, ObjectState, HostUpdateResult -------------------------------------------


def test_host_update_result_is_horovods() -> None:
    assert (elastic.HostUpdateResult.no_update, elastic.HostUpdateResult.removed) == (0, 1)
    assert (elastic.HostUpdateResult.added, elastic.HostUpdateResult.mixed) == (2, 3)
    assert elastic.HostUpdateResult.removed | elastic.HostUpdateResult.added == elastic.HostUpdateResult.mixed
    assert HorovodInternalError is HoraInternalError


def test_object_state_save_restore_keeps_references_as_horovod() -> None:
    log = Log()
    items = [1, 2]
    state = elastic.ObjectState(log.bcast, lambda: 0, epoch=0, items=items)
    assert state.items is items  # the object given, as in Horovod
    state.epoch = 3
    state.items = [7]
    state.restore()
    assert (state.epoch, state.items) == (0, [1, 2]) and state.items is items
    state.epoch = 5
    committed = state.items = [1, 2, 9]
    state.save()
    state.items = [10]  # after save: not committed
    state.epoch = 6
    state.restore()
    assert (state.epoch, state.items) == (5, [1, 2, 9]) and state.items is committed
    assert log.events == []  # save and restore are local


def test_object_state_sync_takes_rank0s_commit() -> None:
    rank0 = {"epoch": 7, "items": [4]}
    state = elastic.ObjectState(lambda obj: rank0, lambda: 1, epoch=0, items=[])
    state.epoch = 2  # not committed: sync replaces it with rank 0's committed value
    state.sync()
    assert (state.epoch, state.items) == (7, [4])
    state.epoch = 8
    state.restore()
    assert state.epoch == 7  # rank 0's values are this rank's commit now
    empty = elastic.ObjectState(lambda obj: pytest.fail("no broadcast without state"), lambda: 0)
    empty.sync()


def test_abstract_state_methods() -> None:
    state = elastic.State(lambda obj: obj, lambda: 0)
    for method in (state.save, state.restore, state.sync):
        with pytest.raises(NotImplementedError):
            method()
    state.reset()  # nothing by default


def test_check_host_updates_without_driver_never_raises() -> None:
    log = Log()
    state = elastic.ObjectState(log.bcast, lambda: 0, epoch=1)
    for _ in range(3):
        state.commit()
    assert log.events == ["bcast"] * 3  # one broadcast of rank 0's view per check


@pytest.mark.parametrize(
    "updates, skip_sync",
    [
        ([(1.0, elastic.HostUpdateResult.added)], False),
        ([(1.0, elastic.HostUpdateResult.removed)], True),
        ([(1.0, elastic.HostUpdateResult.removed), (2.0, elastic.HostUpdateResult.added)], False),
        ([(2.0, elastic.HostUpdateResult.removed), (1.0, elastic.HostUpdateResult.added)], True),  # older: ignored
        ([(1.0, elastic.HostUpdateResult.mixed)], False),
    ],
)
def test_check_host_updates_raises_for_newer_updates(updates, skip_sync) -> None:
    state = elastic.ObjectState(lambda obj: obj, lambda: 0, epoch=1)
    for timestamp, result in updates:
        state.on_hosts_updated(timestamp, result)
    state.epoch = 2
    with pytest.raises(HostsUpdatedInterrupt) as caught:
        state.commit()
    assert caught.value.skip_sync is skip_sync
    state.restore()
    assert state.epoch == 2  # commit saved before it checked
    state.check_host_updates()  # drained: nothing new
    state.on_hosts_updated(max(t for t, _ in updates), elastic.HostUpdateResult.added)
    state.check_host_updates()  # not newer than the last one seen


def test_check_host_updates_follows_rank0() -> None:
    """A rank that was told nothing raises when rank 0 was, and the reverse: rank 0 decides."""
    told_rank0 = elastic.ObjectState(lambda obj: (0, 5.0, elastic.HostUpdateResult.removed), lambda: 1)
    with pytest.raises(HostsUpdatedInterrupt) as caught:
        told_rank0.check_host_updates()
    assert caught.value.skip_sync
    told_only_me = elastic.ObjectState(lambda obj: (0, 0, elastic.HostUpdateResult.no_update), lambda: 1)
    told_only_me.on_hosts_updated(3.0, elastic.HostUpdateResult.added)
    told_only_me.check_host_updates()


def test_on_reset_drops_pending_updates_runs_reset_then_callbacks() -> None:
    log = Log()
    state = LoggedState(log, epoch=0)
    state.register_reset_callbacks([lambda: log.events.append("cb1")])
    state.register_reset_callbacks([lambda: log.events.append("cb2")])
    state.on_hosts_updated(1.0, elastic.HostUpdateResult.added)
    state.on_reset()
    assert log.events == ["state.reset", "cb1", "cb2"]
    state.check_host_updates()  # the pending update was dropped


# --- run_fn ------------------------------------------------------------------------


def test_run_fn_internal_error_restores_last_commit_syncs_and_retries() -> None:
    log = Log()
    state = LoggedState(log, step=0, seen=())
    state.register_reset_callbacks([lambda: log.events.append("callback")])
    calls = []

    def train(state, limit, failing_at=None):
        calls.append((state.step, list(state.seen)))
        while state.step < limit:
            state.step += 1
            state.seen = (*state.seen, state.step)  # a new object: a commit keeps references
            if state.step % 2 == 0:
                state.commit()
            if state.step == failing_at and len(calls) == 1:
                raise HoraInternalError("a rank was lost")
        return "done", state.step

    wrapped = elastic.run_fn(train, reset=lambda: log.events.append("reset"))
    assert wrapped.__name__ == "train"
    assert wrapped(state, 6, failing_at=3) == ("done", 6)
    # The second call starts from the last commit (step 2), not from step 3.
    assert calls == [(0, []), (2, [1, 2])]
    assert state.seen == (1, 2, 3, 4, 5, 6)
    retry = log.events.index("restore")
    assert log.events[retry:retry + 5] == ["restore", "reset", "state.reset", "callback", "sync"]
    assert log.events[0] == "sync"


@pytest.mark.parametrize("skip_sync", [False, True])
def test_run_fn_hosts_updated_resets_without_restoring(skip_sync) -> None:
    log = Log()
    state = LoggedState(log, step=0)
    state.register_reset_callbacks([lambda: log.events.append("callback")])
    attempts = []

    def train(state):
        attempts.append(state.step)
        state.step += 1
        if len(attempts) == 1:
            raise HostsUpdatedInterrupt(skip_sync)
        return state.step

    result = elastic.run_fn(train, reset=lambda: log.events.append("reset"))(state)
    # No restore: the uncommitted step survives a skipped sync; a sync puts back the
    # committed (saved) values, rank 0's.
    assert attempts == ([0, 1] if skip_sync else [0, 0]) and result == attempts[1] + 1
    after = ["reset", "state.reset", "callback"] + ([] if skip_sync else ["sync", "bcast"])
    assert log.events == ["sync", "bcast"] + after


def test_run_fn_syncs_again_after_internal_error_following_skip() -> None:
    """skip_sync lasts one round: an internal error after it syncs again, as Horovod."""
    log = Log()
    state = LoggedState(log, step=0)
    errors = [HostsUpdatedInterrupt(True), HoraInternalError("lost"), None]

    def train(state):
        error = errors.pop(0)
        if error is not None:
            raise error
        return "ok"

    assert elastic.run_fn(train, reset=lambda: log.events.append("reset"))(state) == "ok"
    assert [e for e in log.events if e in ("sync", "reset", "restore")] == [
        "sync", "reset", "restore", "reset", "sync"
    ]  # fmt: skip


def test_run_fn_passes_other_errors_through() -> None:
    state = LoggedState(Log(), step=0)

    def train(state):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        elastic.run_fn(train, reset=lambda: pytest.fail("no reset for other errors"))(state)


# --- hvd.elastic in one process (a real reset: shutdown() then init()) -------------


def test_numpy_binding_exposes_elastic(fresh) -> None:
    assert hvd.elastic is __import__("hora.numpy.elastic").numpy.elastic
    assert "elastic" in hvd.__all__ and thvd.elastic is telastic
    hvd.init()
    state = hvd.elastic.ObjectState(weights=np.zeros(3), epoch=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.is_initialized())])

    @hvd.elastic.run
    def train(state, epochs):
        while state.epoch < epochs:
            state.weights = hvd.allreduce(state.weights + 1, op=hvd.Sum)
            state.epoch += 1
            if state.epoch == 2 and not resets:
                raise HoraInternalError("injected")
            state.commit()
        return state.weights

    assert train(state, 4).tolist() == [4.0, 4.0, 4.0]
    assert resets == [True]  # hora was initialized again before the callbacks ran
    assert hvd.is_initialized()


# --- ElasticSampler with a fake world ---------------------------------------------


@pytest.fixture
def world(monkeypatch):
    """Sets the rank and size the sampler sees: world(rank, size)."""
    current = {"rank": 0, "size": 1}
    monkeypatch.setattr(tsampler, "rank", lambda: current["rank"])
    monkeypatch.setattr(tsampler, "size", lambda: current["size"])

    def set_world(rank: int, size: int) -> None:
        current.update(rank=rank, size=size)

    return set_world


def samplers(world, n: int, dataset, state: dict | None = None, **options) -> list[telastic.ElasticSampler]:
    """One sampler per rank of a world of ``n`` ranks (each built while the world says it is that rank)."""
    out = []
    for r in range(n):
        world(r, n)
        sampler = telastic.ElasticSampler(dataset, **options)
        if state is not None:
            sampler.load_state_dict(state)
        out.append(sampler)
    return out


def train_batches(ranks: list[telastic.ElasticSampler], batches: int, batch_size: int) -> set[int]:
    """Every rank iterates and processes ``batches`` batches, recording each; returns the indices processed."""
    iters = [list(iter(s)) for s in ranks]
    done: set[int] = set()
    for b in range(batches):
        for sampler, indices in zip(ranks, iters):
            done.update(indices[b * batch_size : (b + 1) * batch_size])
            sampler.record_batch(b, batch_size)
    return done


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("new_size", [3, 1, 2, 4])
def test_sampler_reshards_exactly_the_unprocessed_indices(world, shuffle, new_size) -> None:
    dataset = list(range(62))
    ranks = samplers(world, 2, dataset, shuffle=shuffle, seed=5)
    first = [list(s) for s in ranks]
    assert sorted(first[0] + first[1]) == list(range(62)) and len(ranks[0]) == 31
    done = train_batches(ranks, batches=5, batch_size=4)
    assert len(done) == 40
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()  # every rank recorded the same
    new = samplers(world, new_size, dataset, state=state, shuffle=shuffle, seed=5)
    shares = [list(s) for s in new]
    remaining = set(range(62)) - done
    union = [i for share in shares for i in share]
    assert set(union) == remaining  # none lost, none processed again
    padding = len(union) - len(remaining)
    assert padding == (-len(remaining)) % new_size  # only the padding repeats
    assert all(len(share) == len(new[0]) == -(-22 // new_size) for share in shares)
    # Keep going in the new world, then shrink again: still exact.
    done |= train_batches(new, batches=1, batch_size=2)
    again = samplers(world, 1, dataset, state=new[0].state_dict(), shuffle=shuffle, seed=5)
    assert set(again[0]) == set(range(62)) - done and len(again[0]) == 62 - len(done)


def test_sampler_shuffle_is_deterministic_per_seed_and_epoch(world) -> None:
    dataset = list(range(50))
    a = samplers(world, 2, dataset, seed=1)
    b = samplers(world, 2, dataset, seed=1)
    assert [list(s) for s in a] == [list(s) for s in b]
    assert [list(s) for s in a] != [list(s) for s in samplers(world, 2, dataset, seed=2)]
    plain = samplers(world, 2, dataset, shuffle=False)
    assert list(plain[0]) == list(range(0, 50, 2)) and list(plain[1]) == list(range(1, 50, 2))
    epoch0 = list(a[0])
    for r, s in enumerate(a):
        world(r, 2)  # reset() reads the rank and size
        s.set_epoch(1)
    assert list(a[0]) != epoch0 and sorted(list(a[0]) + list(a[1])) == list(range(50))
    order = list(range(50))
    random.Random(1 + 1).shuffle(order)  # Horovod's order: seed + epoch
    assert list(a[0]) == order[0::2]


def test_sampler_set_epoch_clears_and_state_dict_round_trips(world) -> None:
    dataset = list(range(20))
    (sampler,) = samplers(world, 1, dataset, shuffle=False)
    train_batches([sampler], batches=2, batch_size=3)
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 6}
    assert len(list(sampler)) == 20  # recording takes effect at the next reset, as in Horovod
    sampler.reset()
    assert list(sampler) == list(range(6, 20)) and len(sampler) == 14
    other = telastic.ElasticSampler(dataset, shuffle=False)
    other.load_state_dict({"epoch": 0, "processed_num": 6})
    assert list(other) == list(range(6, 20))
    sampler.set_epoch(1)
    assert sampler.state_dict() == {"epoch": 1, "processed_num": 0}
    assert len(sampler) == 20


def test_sampler_uneven_tail_pads_like_horovod(world) -> None:
    ranks = samplers(world, 3, list(range(10)), shuffle=False)
    assert [list(s) for s in ranks] == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]


def test_sampler_in_a_dataloader(world) -> None:
    dataset = torch.arange(12.0)
    (sampler,) = samplers(world, 1, dataset, shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=5, sampler=sampler)
    batches = []
    for batch_idx, batch in enumerate(loader):
        batches.append(batch.tolist())
        sampler.record_batch(batch_idx, 5)
        if batch_idx == 0:
            break
    sampler.reset()
    assert [b.tolist() for b in loader] == [[5.0, 6.0, 7.0, 8.0, 9.0], [10.0, 11.0]]


# --- TorchState in one process ----------------------------------------------------


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    optimizer.zero_grad()
    model(torch.randn(4, 3, generator=g)).pow(2).sum().backward()
    optimizer.step()


def _weights(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_torch_state_commit_and_restore(fresh) -> None:
    thvd.init()
    model = _model(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    sampler = thvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    state = thvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    assert (state.model, state.optimizer, state.sampler, state.epoch) == (model, optimizer, sampler, 0)
    state.sync()  # one rank: nothing changes, but every handler runs
    _step(model, optimizer, 1)
    sampler.record_batch(0, 2)
    state.epoch = 1
    state.commit()
    committed = _weights(model)
    committed_exp_avg = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    _step(model, optimizer, 2)
    sampler.record_batch(1, 2)
    state.epoch = 2
    assert _weights(model) != committed
    state.restore()
    assert _weights(model) == committed and state.epoch == 1
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], committed_exp_avg)
    assert sampler.processed_num == 2 and list(sampler) == list(range(2, 10))


def test_torch_state_assigning_a_model_saves_it(fresh) -> None:
    thvd.init()
    state = thvd.elastic.TorchState(model=_model(0), optimizer=None, epoch=0)
    assert state.optimizer is None
    replacement = _model(1)
    state.model = replacement
    assert state.model is replacement
    with torch.no_grad():
        replacement.weight.add_(1.0)
    state.restore()  # back to the replacement as assigned, not to the first model
    assert _weights(replacement) == _weights(_model(1))


def test_torch_state_uses_the_handler_registry() -> None:
    registry = tstate.get_handler_registry()
    assert [kind for kind, _ in registry] == [torch.nn.Module, torch.optim.Optimizer, telastic.ElasticSampler]
    tstate.set_handler_registry([])
    try:
        state = telastic.TorchState(model=None, lr=0.5)
        assert state._handlers == {} and state.lr == 0.5
    finally:
        tstate.set_handler_registry(registry)


# --- multi-rank --------------------------------------------------------------------


def object_state_job() -> list[Any]:
    import hora.numpy as hvd

    hvd.init()
    r = hvd.rank()
    state = hvd.elastic.ObjectState(epoch=10 * r, weights=np.full(3, float(r)), name=f"rank{r}")
    state.epoch += 1  # not committed
    state.sync()  # every rank takes rank 0's saved values
    synced = (state.epoch, state.weights.tolist(), state.name)
    state.epoch = 5 + r
    state.commit()
    state.epoch = 99
    state.restore()
    restored = state.epoch
    state.sync()
    return [synced, restored, state.epoch]


@pytest.mark.ranks
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2])
def test_object_state_sync_across_ranks(size) -> None:
    results = run_ranks(size, object_state_job, timeout=50)
    for r, (synced, restored, after) in enumerate(results):
        assert synced == (0, [0.0, 0.0, 0.0], "rank0")
        assert restored == 5 + r and after == 5


def recovery_job(failing_ranks: list[int]) -> dict[str, Any]:
    """Trains 6 steps; at step 4 of the first attempt the ranks in ``failing_ranks`` raise
    HoraInternalError (the others then meet a collective that fails)."""
    import hora.numpy as hvd

    hvd.init()
    r = hvd.rank()
    state = hvd.elastic.ObjectState(step=0, total=np.zeros(2) + r)  # rank 1 starts different
    attempts: list[tuple[int, list[float]]] = []
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state, steps):
        attempts.append((state.step, state.total.tolist()))
        while state.step < steps:
            state.total = state.total + hvd.allreduce(np.ones(2), op=hvd.Sum)
            state.step += 1
            if state.step == 4 and len(attempts) == 1 and r in failing_ranks:
                raise HoraInternalError("injected")
            if state.step % 3 == 0:
                state.commit()
        return state.total.tolist()

    total = train(state, 6)
    return {"total": total, "attempts": attempts, "resets": resets, "rank": hvd.rank(), "size": hvd.size()}


@pytest.mark.ranks
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "failing, launcher",
    [([0, 1], "hora"), ([1], "hora"), ([0], "hora"), ([1], "torchrun")],
    ids=["all", "rank1", "rank0", "rank1-torchrun"],  # torchrun: rank 0 runs the rendezvous
)
def test_elastic_run_recovers_from_internal_error(failing, launcher) -> None:
    """Raised on every rank, or on one while the other's next collective then fails."""
    for r, result in enumerate(run_ranks(2, recovery_job, failing, timeout=80, launcher=launcher)):
        assert result["rank"] == r and result["size"] == 2
        assert result["resets"] == [2]  # one reset, in the same world
        # First attempt from rank 0's synced state; the retry from the commit at step 3.
        assert result["attempts"] == [(0, [0.0, 0.0]), (3, [6.0, 6.0])]
        assert result["total"] == [12.0, 12.0]


def torch_state_job() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    model = _model(r)  # different weights on each rank until the sync
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=model.named_parameters()
    )
    sampler = hvd.elastic.ElasticSampler(list(range(16)), shuffle=True, seed=4)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    seen: list[list[int]] = []
    log: dict[str, Any] = {}

    @hvd.elastic.run
    def train(state):
        seen.append(list(state.sampler))
        if "synced" not in log:
            log["synced"] = _weights(state.model)
        for batch_idx, start in enumerate(range(0, len(seen[-1]), 2)):
            _step(state.model, state.optimizer, 100 + state.sampler.processed_num + r)
            state.sampler.record_batch(batch_idx, 2)
            state.epoch += 1
            if state.epoch == 2:
                state.commit()
                log["committed"] = _weights(state.model)
            if state.epoch == 3 and len(seen) == 1:
                raise HoraInternalError("injected")
        return _weights(state.model)

    final = train(state)
    return {"synced": log["synced"], "committed": log["committed"], "seen": seen, "final": final,
            "epoch": state.epoch}  # fmt: skip


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_torch_state_recovers_weights_and_sampler() -> None:
    results = run_ranks(2, torch_state_job, timeout=110)
    rank0, rank1 = results
    assert rank0["synced"] == rank1["synced"] == _weights(_model(0))  # rank 0's model everywhere
    assert rank0["final"] == rank1["final"]
    for result in results:
        first, retry = result["seen"]
        assert len(first) == 8 and len(retry) == 4  # after the commit at 2 batches of 2 per rank
    assert sorted(rank0["seen"][0] + rank1["seen"][0]) == list(range(16))
    processed_first = set(rank0["seen"][0][:4] + rank1["seen"][0][:4])
    assert set(rank0["seen"][1] + rank1["seen"][1]) == set(range(16)) - processed_first
    assert rank0["epoch"] == rank1["epoch"] == 2 + 2  # the retry restored epoch 2, then 2 batches


def reinit_job(cycles: int) -> dict[str, Any]:
    """``cycles`` resets (shutdown() then init()) with a collective in each; what the process
    holds after the first and after the last."""
    import os
    import threading
    import time

    import hora.numpy as hvd

    def held() -> tuple[int, int]:
        return len(os.listdir("/proc/self/fd")), threading.active_count()

    seconds = []
    after_first: tuple[int, int] | None = None
    for cycle in range(cycles):
        start = time.monotonic()
        hvd.init()
        seconds.append(time.monotonic() - start)
        total = hvd.allreduce(np.ones(1 << 16, dtype=np.float32), op=hvd.Sum, name=f"cycle{cycle}")
        assert float(total[0]) == hvd.size()
        hvd.shutdown()
        if after_first is None:
            after_first = held()
    return {"first": after_first, "last": held(), "seconds": seconds}


@pytest.mark.ranks
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_a_reset_leaks_nothing(size) -> None:
    """A reset re-initialises in seconds and leaves no descriptor, thread or shared segment behind."""
    from hora.transport import auth, shm

    secret = auth.new_secret()
    results = run_ranks(size, reinit_job, 6, timeout=100, secret=secret)
    for result in results:
        assert result["last"] == result["first"], result  # (open fds, live threads) after each cycle
        assert max(result["seconds"]) < 30, result["seconds"]
    assert shm.stale_segments(shm.job_key(secret)) == []


def shrink_job(leaver: int) -> dict[str, Any]:
    """3 ranks; then rank ``leaver`` leaves and the others re-initialise as a job of 2,
    renumbered as a driver would renumber them (the ranks above the leaver move down)."""
    import os

    import hora.numpy as hvd

    hvd.init()
    before = float(hvd.allreduce(np.ones(1), op=hvd.Sum, name="before")[0])
    old = hvd.rank()
    hvd.shutdown()
    if old == leaver:
        return {"old": old, "left": True}
    new = old if old < leaver else old - 1
    os.environ.update(HORA_RANK=str(new), HORA_SIZE="2", HORA_LOCAL_RANK=str(new), HORA_LOCAL_SIZE="2")
    hvd.init()
    after = hvd.allreduce(np.full(1 << 16, hvd.rank() + 1, dtype=np.float32), op=hvd.Sum, name="after")
    result = {
        "old": old,
        "before": before,
        "topology": (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()),
        "after": float(after[0]),
        "old_ranks": hvd.allgather_object(old),
    }
    hvd.shutdown()
    return result


@pytest.mark.ranks
@pytest.mark.timeout(90)
@pytest.mark.parametrize("leaver", [0, 2])
def test_a_reset_joins_a_smaller_world(leaver) -> None:
    """shutdown() then init() in the same process against another world: new rank, size and
    local ranks, a new shared-memory domain; rank 0 may be the one that left."""
    results = run_ranks(3, shrink_job, leaver, timeout=80)
    survivors = [old for old in range(3) if old != leaver]
    for old, result in enumerate(results):
        if old == leaver:
            assert result == {"old": old, "left": True}
            continue
        new = survivors.index(old)
        assert result["before"] == 3.0
        assert result["topology"] == (new, 2, new, 2)
        assert result["after"] == 3.0  # 1 + 2
        assert result["old_ranks"] == survivors
