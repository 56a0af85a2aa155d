"""hora.lightning: Lightning 2 training on hora, ``Trainer(strategy="hora")``, on real ranks.

Importing torch and Lightning costs seconds per rank, so one job per world size runs
every check and reports what it saw; the tests then read its report:

* N ranks, each on its shard of every global batch, end with the weights of one
  process training plain PyTorch on the whole batch (SGD with momentum; with
  ``accumulate_grad_batches``, including a short last window; with gradient clipping,
  which must see averaged gradients; with manual optimization; with
  ``sync_batchnorm=True`` against batch normalization over the whole batch);
* ``self.log(..., sync_dist=True)`` reduces over the ranks;
* ``all_gather``, ``broadcast``, ``barrier`` and ``reduce`` of the strategy;
* checkpoints are written by rank 0 only, load back, and resume training exactly;
* ``devices`` other than 1 is refused;
* teardown gives back the plain optimizer and removes the gradient hooks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning as L  # noqa: E402 - after the skip
import torch  # noqa: E402

from harness import run_ranks  # noqa: E402

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[1]
FEATURES = 6
CLASSES = 3


def _data(rows: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(rows, FEATURES, generator=g), torch.randn(rows, CLASSES, generator=g))


def _net(seed: int, batch_norm: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    norm = torch.nn.BatchNorm1d(8) if batch_norm else torch.nn.Identity()
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), norm, torch.nn.Tanh(), torch.nn.Linear(8, CLASSES))


class Regression(L.LightningModule):
    """A small MLP on MSE, SGD with momentum; logs its rank, reduced over the ranks."""

    def __init__(self, seed: int = 0, manual: bool = False, clip: float = 0.0, batch_norm: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = _net(seed, batch_norm)
        self.automatic_optimization = not manual
        self.clip = clip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if self.clip:
            self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()
        return None

    def on_train_epoch_end(self) -> None:
        rank = torch.tensor(float(self.global_rank))
        self.log("rank_mean", rank, sync_dist=True)
        self.log("rank_max", rank, sync_dist=True, reduce_fx="max")
        self.log("rank_local", rank)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _reference(
    n: int, rows: int, per_rank: int, accumulate: int, epochs: int, clip: float, batch_norm: bool
) -> torch.nn.Module:
    """One process, plain PyTorch, on the whole global batch: what N ranks must match.

    Lightning always shuffles training data through the DistributedSampler it adds:
    in epoch e it permutes the rows with ``torch.randperm`` seeded ``e`` and rank r
    takes positions r, r + n, ... of the permutation, so global micro-batch i (every
    rank's i-th batch) is the block of positions [i * n * per_rank, (i + 1) * n * per_rank).
    Lightning divides each micro-batch's loss by ``accumulate`` and steps after
    ``accumulate`` of them, and after the last of the epoch.
    """
    net = _net(0, batch_norm)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(rows).tensors
    micro = n * per_rank
    batches = rows // micro
    for epoch in range(epochs):
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(epoch))
        opt.zero_grad()
        for i in range(batches):
            rows_i = order[i * micro : (i + 1) * micro]
            (torch.nn.functional.mse_loss(net(x[rows_i]), y[rows_i]) / accumulate).backward()
            if (i + 1) % accumulate == 0 or i + 1 == batches:
                if clip:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
                opt.step()
                opt.zero_grad()
    return net


def _trainer(strategy: Any, root: str, **kwargs: Any) -> L.Trainer:
    """A quiet Trainer: no progress bar, no model summary, no logger unless asked."""
    options: dict[str, Any] = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    options.update(kwargs)
    return L.Trainer(strategy=strategy, **options)


CASES = {
    # name: (rows, rows per rank per batch, accumulate_grad_batches, epochs, clip, manual, sync_batchnorm)
    "sgd": (32, 4, 1, 2, 0.0, False, False),
    "accumulate 2": (32, 2, 2, 2, 0.0, False, False),
    "accumulate 3, short last window": (40, 2, 3, 2, 0.0, False, False),
    "clip": (32, 4, 1, 2, 0.05, False, False),
    "manual, clip": (32, 4, 1, 2, 0.05, True, False),
    "sync_batchnorm": (32, 4, 1, 2, 0.0, False, True),
}


def lightning_job(root: str) -> dict[str, Any]:
    """Every check on this rank (see the module's docstring); returns what it saw."""
    import hora.torch as hvd
    from hora.lightning import HoraEnvironment, HoraStrategy
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins import TorchCheckpointIO

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    out: dict[str, Any] = {"errors": {}}

    for name, (rows, per_rank, accumulate, epochs, clip, manual, batch_norm) in CASES.items():
        # Different initial weights on every rank: the strategy must start them all from rank 0's.
        model = Regression(seed=me, manual=manual, clip=clip, batch_norm=batch_norm)
        strategy: Any = HoraStrategy() if name == "sgd" else "hora"  # both spellings
        trainer = _trainer(
            strategy, root, max_epochs=epochs, accumulate_grad_batches=accumulate,
            gradient_clip_val=None if manual or not clip else clip, sync_batchnorm=batch_norm,
        )  # fmt: skip
        loader = torch.utils.data.DataLoader(_data(rows), batch_size=per_rank, shuffle=False)
        trainer.fit(model, loader)
        reference = _reference(n, rows, per_rank, accumulate, epochs, clip, batch_norm)
        # Parameters and buffers (batch normalization's running statistics).
        mine, theirs = model.net.state_dict(), reference.state_dict()
        assert list(mine) == list(theirs)
        out["errors"][name] = max(float((mine[k].double() - theirs[k].double()).abs().max()) for k in mine)
        if batch_norm:  # converted to hora's SyncBatchNorm for training, back after it
            out["batch norm layer"] = type(model.net[1]).__name__
        if name == "sgd":
            out["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
            out["strategy"] = (
                type(trainer.strategy).__name__, type(trainer.strategy.cluster_environment).__name__,
                trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.is_global_zero,
            )  # fmt: skip
            # Teardown: the plain optimizer back, no gradient hooks left on the parameters.
            out["teardown"] = (
                type(trainer.optimizers[0]).__name__,
                sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()),
            )
            strategy_ = trainer.strategy
            out["all_gather"] = strategy_.all_gather(torch.tensor([me, 10 * me])).tolist()
            out["all_gather scalar"] = model.all_gather(torch.tensor(float(me))).tolist()
            out["broadcast"] = strategy_.broadcast({"from": me, "list": [me] * 3}, src=n - 1)
            strategy_.barrier("test")
            out["reduce"] = {
                op: strategy_.reduce(torch.tensor([float(me + 1), 2.0 * (me + 1)]), reduce_op=op).tolist()
                for op in ("mean", "sum", "max", "min")
            }
            out["reduce int mean"] = float(strategy_.reduce(torch.tensor(me + 1), reduce_op="mean"))
            out["reduce default"] = strategy_.reduce(torch.tensor(float(me)), reduce_op=None).item()
            out["reduce non-tensor"] = strategy_.reduce("unchanged")
            out["decision"] = (strategy_.reduce_boolean_decision(me == 0), strategy_.reduce_boolean_decision(me == 0, all=False))
            out["sampler"] = strategy_.distributed_sampler_kwargs
            out["detect"] = HoraEnvironment.detect()
            try:
                strategy_.reduce(torch.tensor(1.0), reduce_op="median")
                out["bad op"] = "no error"
            except ValueError as exc:
                out["bad op"] = str(exc)

    # Checkpoints: written by rank 0 alone (every rank counts its own writes), and loadable.
    class CountingIO(TorchCheckpointIO):
        writes = 0

        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            CountingIO.writes += 1
            super().save_checkpoint(checkpoint, path, storage_options)

    ckpt_dir = os.path.join(root, "ckpt")
    model = Regression(seed=me)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1)
    trainer = _trainer(
        "hora", root, max_epochs=2, enable_checkpointing=True, callbacks=[checkpoint], plugins=[CountingIO()]
    )
    trainer.fit(model, torch.utils.data.DataLoader(_data(32), batch_size=4))
    out["writes"] = CountingIO.writes
    trainer.strategy.barrier()
    out["files"] = sorted(os.listdir(ckpt_dir))
    loaded = Regression.load_from_checkpoint(os.path.join(ckpt_dir, "epoch=1.ckpt"))
    out["loaded error"] = max(float((a - b).abs().max()) for a, b in zip(loaded.parameters(), model.parameters()))
    state = torch.load(os.path.join(ckpt_dir, "epoch=1.ckpt"), weights_only=False)
    out["checkpoint optimizer"] = sorted(state["optimizer_states"][0])
    # Resuming after epoch 0 (weights, momentum, epoch) ends where the uninterrupted run did.
    resumed = Regression(seed=me + 10)
    trainer = _trainer("hora", root, max_epochs=2)
    trainer.fit(resumed, torch.utils.data.DataLoader(_data(32), batch_size=4), ckpt_path=os.path.join(ckpt_dir, "epoch=0.ckpt"))
    out["resumed error"] = max(float((a - b).abs().max()) for a, b in zip(resumed.parameters(), model.parameters()))
    # One device per process: devices=2 is refused before anything trains.
    try:
        _trainer("hora", root, max_epochs=1, devices=2).fit(Regression(), torch.utils.data.DataLoader(_data(8)))
        out["devices=2"] = "no error"
    except ValueError as exc:
        out["devices=2"] = str(exc)
    hvd.shutdown()
    return out


def _check_job(size: int) -> None:
    with tempfile.TemporaryDirectory(prefix="hora-lightning-") as root:
        reports = run_ranks(size, lightning_job, root, timeout=200, env={"OMP_NUM_THREADS": "1"})
    for rank, report in enumerate(reports):
        bad = {name: err for name, err in report["errors"].items() if not err <= 1e-5}
        assert not bad, f"rank {rank}: weights differ from one process on the whole batch: {bad}"
        assert set(report["errors"]) == set(CASES)
        assert report["strategy"] == ("HoraStrategy", "HoraEnvironment", size, rank, rank, rank == 0)
        assert report["teardown"] == ("SGD", 0)
        assert report["batch norm layer"] == "BatchNorm1d"
        # sync_dist: the mean and the max over the ranks; without it, the rank's own value.
        assert report["metrics"]["rank_mean"] == pytest.approx((size - 1) / 2)
        assert report["metrics"]["rank_max"] == size - 1
        assert report["metrics"]["rank_local"] == rank
        assert report["all_gather"] == [[r, 10 * r] for r in range(size)]
        assert report["all_gather scalar"] == [float(r) for r in range(size)]
        assert report["broadcast"] == {"from": size - 1, "list": [size - 1] * 3}
        ones = [float(r + 1) for r in range(size)]
        assert report["reduce"]["mean"] == pytest.approx([sum(ones) / size, 2 * sum(ones) / size])
        assert report["reduce"]["sum"] == pytest.approx([sum(ones), 2 * sum(ones)])
        assert report["reduce"]["max"] == [float(size), 2.0 * size]
        assert report["reduce"]["min"] == [1.0, 2.0]
        assert report["reduce int mean"] == pytest.approx(sum(ones) / size)
        assert report["reduce default"] == pytest.approx((size - 1) / 2)
        assert report["reduce non-tensor"] == "unchanged"
        assert report["decision"] == (size == 1, True)
        assert report["sampler"] == {"num_replicas": size, "rank": rank}
        assert report["detect"] is True
        assert "median" in report["bad op"]
        assert report["writes"] == (2 if rank == 0 else 0)
        assert report["files"] == ["epoch=0.ckpt", "epoch=1.ckpt"]
        assert report["loaded error"] == 0.0
        assert report["checkpoint optimizer"] == ["param_groups", "state"]
        assert report["resumed error"] == 0.0
        assert "devices=2" in report["devices=2"] and "horarun -np" in report["devices=2"]


@pytest.mark.timeout(240)
def test_two_ranks_train_like_one_process_and_share_metrics_collectives_and_checkpoints():
    _check_job(2)


@pytest.mark.timeout(240)
def test_one_rank_trains_like_one_process():
    _check_job(1)


@pytest.mark.timeout(300)
def test_digits_example_reaches_95_percent_on_two_ranks():
    proc = subprocess.run(
        [sys.executable, "-m", "hora.runner", "-np", "2", sys.executable, "examples/lightning/digits.py"],
        capture_output=True, text=True, timeout=290, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    final = re.search(r"\[0\]<stdout>:test accuracy ([0-9.]+) on (\d) ranks", proc.stdout)
    assert final, proc.stdout + proc.stderr
    assert float(final.group(1)) >= 0.95 and int(final.group(2)) == 2
    assert not any(line.startswith("[1]<stdout>") for line in proc.stdout.splitlines())
