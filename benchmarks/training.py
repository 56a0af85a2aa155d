"""Training throughput: hora's DistributedOptimizer, PyTorch DDP (gloo) and Horovod, side by side.

Every engine trains the same model on the same fixed random batch per rank, with the
same optimizer (SGD, lr 0.01 * size) and the timing loop of Horovod's synthetic
benchmark (zero_grad, forward, cross entropy, backward, step). hora runs under
``horarun``; DDP runs the same number of processes with torchrun's environment
variables and the gloo backend; Horovod (when ``--horovod-python`` names a Python that
has it) runs under ``horovodrun --gloo`` and ``horovodrun --mpi``. The engines
alternate round by round so that machine noise hits all alike; each cell is the median
over the rounds of the total img/sec, and ratios are hora's over each other engine's.

Across hosts, one rank per host: ``--cluster N --rate 1gbit`` brings up N network-namespace
hosts on shaped links (``scripts/netns_hosts.py``, as ``benchmarks/cluster.py`` does; needs
root) and takes them down at the end; ``-H host:1,host:1,...`` uses hosts of one's own,
reached over ssh as horarun reaches them (``HORA_SSH_OPTIONS``, ``-p``, ``-i``). hora runs
under ``horarun -H``; DDP's ranks start over ssh with ``MASTER_ADDR`` the first host;
Horovod's ``horovodrun -H`` runs on the first host (see ``src/hora/bench/peers.py``). After
every run, whatever is left of it on the hosts is killed. All the hosts of ``--cluster``
share this machine's CPUs, so each rank gets ``cpus / ranks`` threads there (``--threads``).

    python benchmarks/training.py --np 2 --model cnn --rounds 3
    python benchmarks/training.py --np 2 --model mlp25m --horovod-python /path/to/horovod-venv/bin/python
    python benchmarks/training.py --cluster 4 --rate 1gbit --model mlp25m --horovod-python PY --engines hora,ddp,horovod-gloo
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import shlex
import statistics
import subprocess
import sys
import tempfile
import timeit
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "pytorch"))
ENGINES = ("hora", "ddp", "horovod-gloo", "horovod-mpi")
RUN_TIMEOUT = 1800.0  # seconds one engine's run may take before it is stopped


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="mlp25m", help="cnn, mlp25m, or a torchvision model")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per rank (default: CPUs / ranks on this machine)")  # fmt: skip
    parser.add_argument("--groups", type=int, default=0,
                        help="hora's and Horovod's DistributedOptimizer(groups=N): N grouped allreduces a step "
                             "(default: each gradient alone)")  # fmt: skip


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
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_size))
    torch.manual_seed(0)
    model, image = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size)
    if engine in ("hora", "horovod"):
        optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), groups=args.groups or None
        )
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
        # Leave together: gloo's teardown can abort a rank ("terminate called without an
        # active exception") whose peer destroyed the group first (seen across hosts in CI).
        dist.barrier()
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


def run(
    engine: str, np_: int, forwarded: list[str], horovod_python: str | None, hosts: Any = None
) -> dict[str, float]:
    """One run of ``engine`` on ``np_`` ranks (on ``hosts``, a ``hora.bench.peers.Hosts``, when given).

    Raises:
        SystemExit: the run failed or printed no result (with its output).
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    if hosts is not None:
        from hora.bench.peers import MARKER, sweep

        # every process of the run carries the marker, so that sweep finds what is left on the hosts
        marker = f"training-{engine}-{uuid.uuid4().hex[:8]}"
        env[MARKER] = marker
        try:
            return _run_across(engine, forwarded, horovod_python, hosts, env)
        finally:
            sweep(hosts, marker)
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


def _run_across(
    engine: str, forwarded: list[str], horovod_python: str | None, hosts: Any, env: dict[str, str]
) -> dict[str, float]:
    """``run`` across hosts: horarun -H for hora, ssh per rank for DDP, horovodrun -H on the first host."""
    size = len(hosts.slots)
    if engine == "hora":
        command = [sys.executable, "-m", "hora.runner", "-np", str(size), "-H", hosts.spec,
                   sys.executable, __file__, "--worker", "hora", *forwarded]  # fmt: skip
        if hosts.interfaces:
            command[3:3] = ["--network-interfaces", hosts.interfaces]
        env.setdefault("HORA_START_TIMEOUT", "60")
        commands = [(command, env)]
    elif engine == "ddp":
        commands = hosts.torch_ranks([sys.executable, __file__, "--worker", "ddp", *forwarded], env)
    else:
        assert horovod_python is not None
        horovodrun = str(Path(horovod_python).with_name("horovodrun"))
        worker = [horovod_python, __file__, "--worker", "horovod", *forwarded]
        commands = hosts.horovodrun(horovodrun, "--" + engine.split("-", 1)[1], worker, env)
    procs = [
        subprocess.Popen(argv, env=proc_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for argv, proc_env in commands
    ]
    try:
        outputs = [p.communicate(timeout=RUN_TIMEOUT)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise SystemExit(f"{engine} run did not finish within {RUN_TIMEOUT:g} s") from None
    if any(p.returncode for p in procs):
        raise SystemExit(f"{engine} run failed:\n" + "\n".join(output[-3000:] for output in outputs))
    return _result("\n".join(outputs), engine)


def _hosts(args: argparse.Namespace, directory: str, spec: str, interfaces: str | None) -> Any:
    """The ``hora.bench.peers.Hosts`` of ``spec`` (one rank per slot), reached as horarun reaches hosts."""
    from hora.bench.peers import Hosts
    from hora.runner.hosts import parse_hosts, plan
    from hora.runner.ssh import SshSettings

    size = sum(host.slots for host in parse_hosts(spec))
    ssh = SshSettings.from_env(args.ssh_port, args.ssh_identity_file)
    return Hosts(spec, tuple(plan(size, spec)), ssh, interfaces, directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _options(parser)
    parser.add_argument("--np", type=int, default=2, help="processes (ranks) per engine on this machine")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each engine")
    parser.add_argument("--horovod-python", help="a Python with Horovod installed, to run it too")
    parser.add_argument("--engines", help=f"some of {','.join(ENGINES)} (default: hora,ddp and, with "
                        "--horovod-python, both Horovods)")  # fmt: skip
    parser.add_argument("-H", "--hosts", help="run on these hosts (host:slots,...) over ssh instead of --np here")
    parser.add_argument("-p", "--ssh-port", type=int, help="ssh port on the hosts (-H)")
    parser.add_argument("-i", "--ssh-identity-file", help="ssh private key for the hosts (-H)")
    parser.add_argument("--network-interfaces", help="the hosts' interfaces for every engine (-H); "
                        "--cluster uses eth0")  # fmt: skip
    parser.add_argument("--cluster", type=int, default=0, metavar="N",
                        help="bring up N network-namespace hosts (root) and run one rank on each")  # fmt: skip
    parser.add_argument("--rate", default="1gbit", help="--cluster's link rate as tc takes it, or none (default 1gbit)")
    parser.add_argument("--congestion", default="cubic,reno", help="--cluster's TCP congestion control (default cubic,reno)")
    parser.add_argument("--worker", choices=["hora", "ddp", "horovod"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    engines = args.engines.split(",") if args.engines else (
        ["hora", "ddp"] + (["horovod-gloo", "horovod-mpi"] if args.horovod_python else []))  # fmt: skip
    if set(engines) - set(ENGINES) or "hora" not in engines or (
            any(e.startswith("horovod") for e in engines) and not args.horovod_python):  # fmt: skip
        parser.error(f"--engines: expected hora and some of {','.join(ENGINES[1:])} (Horovod needs --horovod-python)")
    if args.cluster and args.hosts:
        parser.error("--cluster and -H exclude each other")
    cluster = None
    spec = args.hosts
    interfaces = args.network_interfaces
    if args.cluster:
        sys.path.insert(0, str(ROOT / "scripts"))
        from netns_hosts import Cluster, ensure_system

        ensure_system()
        rate = None if args.rate.lower() == "none" else args.rate
        # own_hostname: DDP's and Horovod's gloo take their address from the host name
        cluster = Cluster(args.cluster, rate=rate, congestion=args.congestion, own_hostname=True).up()
        os.environ["HORA_SSH_OPTIONS"] = cluster.ssh_options()
        spec = ",".join(f"{host.address}:1" for host in cluster.hosts)
        interfaces = interfaces or "eth0"
    threads = args.threads
    if spec and not threads:  # every rank of an emulated cluster shares this machine's CPUs
        from hora.runner.hosts import parse_hosts

        threads = max(1, (os.cpu_count() or 1) // sum(host.slots for host in parse_hosts(spec)))
    forwarded = [
        "--model", args.model, "--batch-size", str(args.batch_size), "--num-warmup-batches",
        str(args.num_warmup_batches), "--num-batches-per-iter", str(args.num_batches_per_iter),
        "--num-iters", str(args.num_iters), "--threads", str(threads), "--groups", str(args.groups),
    ]  # fmt: skip
    names = {
        "hora": "hora DistributedOptimizer",
        "ddp": "torch DDP (gloo)",
        "horovod-gloo": "Horovod 0.28.1 --gloo",
        "horovod-mpi": "Horovod 0.28.1 --mpi",
    }
    totals: dict[str, list[float]] = {engine: [] for engine in engines}
    params = 0
    with tempfile.TemporaryDirectory(prefix="hora-training-") as directory:
        try:
            hosts = _hosts(args, directory, spec, interfaces) if spec else None
            ranks = len(hosts.slots) if hosts is not None else args.np
            for round_ in range(args.rounds):
                for engine in engines:
                    result = run(engine, ranks, forwarded, args.horovod_python, hosts)
                    total = result["per_rank"] * result["size"]
                    totals[engine].append(total)
                    params = int(result["params"])
                    print(f"round {round_ + 1}: {engine:12s} {total:8.1f} img/sec total", flush=True)
        finally:
            if cluster is not None:
                cluster.down()
    medians = {engine: statistics.median(values) for engine, values in totals.items()}
    where = f"{ranks} ranks"
    if args.cluster:
        where += f" on {args.cluster} emulated hosts, links {args.rate}"
    elif spec:
        where += f" on {shlex.quote(spec)}"
    print()
    print(f"model {args.model} ({params / 1e6:.1f}M parameters), batch {args.batch_size} per rank, {where}, "
          f"{os.cpu_count()} CPUs; median of {args.rounds} rounds")  # fmt: skip
    print("| engine | total img/sec | per rank | hora / engine | rounds |")
    print("|---|---|---|---|---|")
    for engine in engines:
        ratio = medians["hora"] / medians[engine]
        each = ", ".join(f"{value:.1f}" for value in totals[engine])
        print(f"| {names[engine]} | {medians[engine]:.1f} | {medians[engine] / ranks:.1f} | {ratio:.2f} | {each} |")
    print("RESULTS " + json.dumps({"medians": medians, "rounds": totals, "ranks": ranks}), flush=True)


if __name__ == "__main__":
    main()
