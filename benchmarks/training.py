"""Training throughput: hora's DistributedOptimizer, PyTorch DDP (gloo) and Horovod, side by side.

Every engine trains the same model on the same fixed random batch per rank, with the
same optimizer (SGD, lr 0.01 * size) and the timing loop of Horovod's synthetic
benchmark (zero_grad, forward, cross entropy, backward, step). hora runs under
``horarun``; DDP runs the same number of processes with torchrun's environment
variables and the gloo backend; Horovod (when ``--horovod-python`` names a Python that
has it) runs under ``horovodrun --gloo`` and ``horovodrun --mpi``. The engines
alternate round by round so that machine noise hits all alike; each cell is the median
over the rounds of the total img/sec, and ratios are hora's over each other engine's.

    python benchmarks/training.py --np 2 --model cnn --rounds 3
    python benchmarks/training.py --np 2 --model mlp25m --horovod-python /path/to/horovod-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "pytorch"))


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="mlp25m", help="cnn, mlp25m, or a torchvision model")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)


def worker(engine: str, args: argparse.Namespace) -> None:
    """One rank: trains with hora or DDP and, on rank 0, prints one JSON line of results."""
    import torch
    import torch.nn.functional as F
    from synthetic_benchmark import build_model

    if engine in ("hora", "horovod"):
        if engine == "hora":
            import hora.torch as hvd
        else:
            import horovod.torch as hvd  # type: ignore[no-redef]

        hvd.init()
        rank, size, local_size = hvd.rank(), hvd.size(), hvd.local_size()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size, local_size = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    torch.manual_seed(0)
    model, image = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size)
    if engine in ("hora", "horovod"):
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters
    data = torch.randn(args.batch_size, *image)
    target = torch.randint(0, 1000, (args.batch_size,))

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    timeit.timeit(step, number=args.num_warmup_batches)
    rates = []
    for _ in range(args.num_iters):
        seconds = timeit.timeit(step, number=args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print("RESULT " + json.dumps({"per_rank": statistics.mean(rates), "size": size, "params": params}), flush=True)
    if engine in ("hora", "horovod"):
        hvd.shutdown()
    else:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _result(output: str, engine: str) -> dict[str, float]:
    for line in output.splitlines():
        if "RESULT " in line:
            # raw_decode: a launcher may append another process's output to the same line
            result, _ = json.JSONDecoder().raw_decode(line.split("RESULT ", 1)[1])
            return result  # type: ignore[no-any-return]
    raise SystemExit(f"{engine} run printed no result:\n{output}")


def run(engine: str, np_: int, forwarded: list[str], horovod_python: str | None) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    if engine.startswith("horovod"):
        assert horovod_python is not None
        controller = "--" + engine.split("-", 1)[1]
        horovodrun = str(Path(horovod_python).with_name("horovodrun"))
        command = [horovod_python, __file__, "--worker", "horovod", *forwarded]
        env = dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # the models import hora
        proc = subprocess.run(
            [horovodrun, "-np", str(np_), "-H", f"localhost:{np_}", controller, *command],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode:
            raise SystemExit(f"{engine} run failed:\n{proc.stdout}{proc.stderr}")
        return _result(proc.stdout, engine)
    command = [sys.executable, __file__, "--worker", engine, *forwarded]
    if engine == "hora":
        proc = subprocess.run(
            [sys.executable, "-m", "hora.runner", "-np", str(np_), *command], env=env, capture_output=True, text=True
        )
        if proc.returncode:
            raise SystemExit(f"hora run failed:\n{proc.stdout}{proc.stderr}")
        return _result(proc.stdout, engine)
    port = _free_port()
    procs = []
    for rank in range(np_):
        rank_env = dict(
            env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(np_),
            LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(np_),
        )  # fmt: skip
        procs.append(subprocess.Popen(command, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("DDP run failed:\n" + "\n".join(outputs))
    return _result(outputs[0], engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _options(parser)
    parser.add_argument("--np", type=int, default=2, help="processes (ranks) per engine")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each engine")
    parser.add_argument("--horovod-python", help="a Python with Horovod installed, to run it too")
    parser.add_argument("--worker", choices=["hora", "ddp", "horovod"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    forwarded = [
        "--model", args.model, "--batch-size", str(args.batch_size), "--num-warmup-batches",
        str(args.num_warmup_batches), "--num-batches-per-iter", str(args.num_batches_per_iter),
        "--num-iters", str(args.num_iters),
    ]  # fmt: skip
    engines = ["hora", "ddp"] + (["horovod-gloo", "horovod-mpi"] if args.horovod_python else [])
    names = {
        "hora": "hora DistributedOptimizer",
        "ddp": "torch DDP (gloo)",
        "horovod-gloo": "Horovod 0.28.1 --gloo",
        "horovod-mpi": "Horovod 0.28.1 --mpi",
    }
    totals: dict[str, list[float]] = {engine: [] for engine in engines}
    params = 0
    for round_ in range(args.rounds):
        for engine in engines:
            result = run(engine, args.np, forwarded, args.horovod_python)
            total = result["per_rank"] * result["size"]
            totals[engine].append(total)
            params = int(result["params"])
            print(f"round {round_ + 1}: {engine:12s} {total:8.1f} img/sec total", flush=True)
    medians = {engine: statistics.median(values) for engine, values in totals.items()}
    print()
    print(f"model {args.model} ({params / 1e6:.1f}M parameters), batch {args.batch_size} per rank, {args.np} ranks, "
          f"{os.cpu_count()} CPUs; median of {args.rounds} rounds")  # fmt: skip
    print("| engine | total img/sec | per rank | hora / engine |")
    print("|---|---|---|---|")
    for engine in engines:
        ratio = medians["hora"] / medians[engine]
        print(f"| {names[engine]} | {medians[engine]:.1f} | {medians[engine] / args.np:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
