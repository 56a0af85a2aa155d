"""Optimizer-state sharding: memory and speed of hora's stages 1 and 2 against unsharded
training and PyTorch's ZeroRedundancyOptimizer + DDP.

Every engine trains ``mlp25m`` from benchmarks/training.py (a 25.6M-parameter MLP, 102 MB
of float32 weights) with Adam on a fixed random batch per rank:

- ``hora``: ``hvd.DistributedOptimizer`` (gradient allreduce, the whole Adam state per rank);
- ``hora-s1`` / ``hora-s2``: the same with ``shard_optimizer_state=1`` / ``2``;
- ``zero-ddp``: ``torch.distributed.optim.ZeroRedundancyOptimizer`` over DDP, gloo backend,
  started with ``python -m torch.distributed.run``.

hora engines run under ``python -m hora.runner -np N``. Each rank reports its peak RSS (and
how much of it came during training, after imports, model and optimizer were built), its
optimizer-state bytes, the gradient bytes it holds when the optimizer steps, and its
steps/s; the engines alternate round by round, each cell is the median over rounds of the
largest value over ranks (steps/s: the slowest rank), and ratios are over unsharded hora.

    python benchmarks/sharding.py --np 2 4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "pytorch"))

ENGINES = ["hora", "hora-s1", "hora-s2", "zero-ddp"]
NAMES = {
    "hora": "hora, unsharded",
    "hora-s1": "hora, stage 1",
    "hora-s2": "hora, stage 2",
    "zero-ddp": "torch ZeroRedundancyOptimizer + DDP (gloo)",
}


def _tensor_bytes(state: object) -> int:
    import torch

    values = state.values() if isinstance(state, dict) else []
    return sum(v.nbytes for st in values for v in st.values() if isinstance(v, torch.Tensor))


def worker(engine: str, args: argparse.Namespace) -> None:
    """One rank: trains, then writes its measurements to ``args.out/rank.json``."""
    import torch
    import torch.nn.functional as F
    from synthetic_benchmark import build_model

    if engine.startswith("hora"):
        import hora.torch as hvd

        hvd.init()
        rank, size, local_size = hvd.rank(), hvd.size(), hvd.local_size()
    else:
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer

        dist.init_process_group("gloo")
        rank, size, local_size = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    torch.manual_seed(0)
    model, image = build_model("mlp25m")
    grads_at_step: list[int] = []
    if engine.startswith("hora"):
        stage = {"hora": 0, "hora-s1": 1, "hora-s2": 2}[engine]
        optimizer = hvd.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-4), named_parameters=model.named_parameters(),
            shard_optimizer_state=stage,
        )  # fmt: skip
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if stage:
            sharded = optimizer

            def state_bytes() -> int:
                return int(sharded.shard_bytes()["optimizer_state"])

            if sharded.shard_optimizer is not None:
                sharded.shard_optimizer.register_step_pre_hook(
                    lambda *_: grads_at_step.append(sharded.shard_bytes()["gradients"])
                )
        else:
            inner = optimizer.optimizer

            def state_bytes() -> int:
                return _tensor_bytes(inner.state)

            inner.register_step_pre_hook(
                lambda *_: grads_at_step.append(sum(p.grad.nbytes for p in model.parameters() if p.grad is not None))
            )
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
        zero = optimizer

        def state_bytes() -> int:
            return _tensor_bytes(zero.optim.state)

        zero.optim.register_step_pre_hook(
            lambda *_: grads_at_step.append(sum(p.grad.nbytes for p in model.parameters() if p.grad is not None))
        )
    data = torch.randn(args.batch_size, *image)
    target = torch.randint(0, 1000, (args.batch_size,))

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    built_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # imports, model, weights
    timeit.timeit(step, number=args.warmup)
    seconds = timeit.timeit(step, number=args.steps)
    result = {
        "rank": rank,
        "size": size,
        "steps_per_s": args.steps / seconds,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "training_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - built_rss,
        "optimizer_state": state_bytes(),
        "gradients": grads_at_step[-1] if grads_at_step else 0,
        "params": sum(p.numel() for p in model.parameters()),
    }
    Path(args.out, f"{rank}.json").write_text(json.dumps(result))
    if engine.startswith("hora"):
        hvd.shutdown()
    else:
        # Under torch.distributed.run these ranks hung at exit after destroy_process_group()
        # (torch 2.13, gloo; seen on this machine): leave once every rank has written.
        dist.barrier()
        sys.stdout.flush()
        os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(engine: str, np_: int, args: argparse.Namespace) -> list[dict[str, float]]:
    """Starts one job of ``np_`` ranks; returns every rank's measurements."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory(prefix="hora-sharding-bench-") as out:
        command = [
            __file__, "--worker", engine, "--out", out, "--batch-size", str(args.batch_size),
            "--warmup", str(args.warmup), "--steps", str(args.steps),
        ]  # fmt: skip
        if engine.startswith("hora"):
            launcher = [sys.executable, "-m", "hora.runner", "-np", str(np_), sys.executable]
        else:
            launcher = [
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(np_),
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
            ]  # fmt: skip
        proc = subprocess.run(launcher + command, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{engine} at {np_} ranks failed:\n{proc.stdout}{proc.stderr}")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(np_)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4], help="world sizes to measure")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each engine")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing")
    parser.add_argument("--steps", type=int, default=6, help="timed steps")
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    mib = 2**20
    for np_ in args.np:
        rows: dict[str, dict[str, list[float]]] = {e: {} for e in args.engines}
        params = 0
        for round_ in range(args.rounds):
            for engine in args.engines:
                ranks = run(engine, np_, args)
                params = int(ranks[0]["params"])
                cells = rows[engine]
                for key in ("peak_rss", "training_rss", "optimizer_state", "gradients"):
                    cells.setdefault(key, []).append(max(r[key] for r in ranks))
                cells.setdefault("steps_per_s", []).append(min(r["steps_per_s"] for r in ranks))
                print(
                    f"{np_} ranks, round {round_ + 1}: {engine:9s} {cells['steps_per_s'][-1]:.2f} steps/s, "
                    f"peak RSS {cells['peak_rss'][-1] / mib:.0f} MiB (+{cells['training_rss'][-1] / mib:.0f} in training), state {cells['optimizer_state'][-1] / mib:.1f} MiB, "
                    f"gradients {cells['gradients'][-1] / mib:.1f} MiB",
                    flush=True,
                )
        med = {e: {k: statistics.median(v) for k, v in cells.items()} for e, cells in rows.items()}
        base = med.get("hora") or next(iter(med.values()))
        print()
        print(
            f"mlp25m ({params / 1e6:.1f}M parameters, {params * 4 / mib:.0f} MiB float32), Adam, batch "
            f"{args.batch_size} per rank, {np_} ranks, {os.cpu_count()} CPUs; median of {args.rounds} rounds "
            "(per rank: the largest value over ranks; steps/s: the slowest rank)"
        )
        print("| engine | peak RSS MiB | RSS growth in training MiB | optimizer state MiB | gradients at step MiB | "
              "steps/s | state / unsharded | gradients / unsharded | steps/s / unsharded |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for engine, m in med.items():
            print(
                f"| {NAMES[engine]} | {m['peak_rss'] / mib:.0f} | {m['training_rss'] / mib:.0f} | "
                f"{m['optimizer_state'] / mib:.1f} | "
                f"{m['gradients'] / mib:.1f} | {m['steps_per_s']:.2f} | "
                f"{m['optimizer_state'] / max(base['optimizer_state'], 1):.3f} | "
                f"{m['gradients'] / max(base['gradients'], 1):.3f} | {m['steps_per_s'] / base['steps_per_s']:.2f} |"
            )
        print()


if __name__ == "__main__":
    main()
