"""JAX data parallelism side by side: hora.jax, jax.distributed (CPU collectives) and mpi4jax.

Two measurements per engine, every rank on the CPU, one process per rank:

* ``allreduce``: the sum of a 64 MiB float32 ``jax.Array`` over the ranks, inside
  ``jax.jit`` (hora also eagerly), in milliseconds per call.
* ``step``: one training step of a Flax MLP (784-1024-1024-10, batch 64 per rank, Adam):
  gradients, their average over the ranks, the update; milliseconds per step.
* ``average``: what averaging the MLP's six gradients (7.4 MB) adds to a jitted program
  that makes them (from the parameters) and applies them: the program's time minus the
  same program's without the averaging, in milliseconds (the step's collective alone,
  without the backward pass's noise).

Engines: ``hora`` (``hvd.allreduce`` and ``hvd.DistributedOptimizer``, under ``horarun``;
``hora-bound`` the same under ``horarun --bind-to core``, as ``mpirun`` binds mpi4jax's ranks);
``jax.distributed`` (``jax.distributed.initialize`` with gloo CPU collectives, ``psum``/
``pmean`` over a mesh of every process's CPU device, in ``shard_map``); ``mpi4jax``
(``mpi4jax.allreduce`` inside ``jit``, under Open MPI's ``mpirun``; skipped when mpi4jax is
not installed). The engines alternate round by round so that machine noise hits all alike;
each cell is the median over rounds, and ratios are the other engine's time over hora's
(above 1: hora is faster). Every rank runs XLA on one thread unless
``--multi-threaded-xla`` (with as many ranks as cores, XLA's default pool oversubscribes).

    python benchmarks/jax_step.py --np 2 --rounds 3

mpi4jax is not among the project's requirements: ``pip install mpi4jax`` builds it from
source with ``mpicc`` (on a machine that has ``/usr/local/cuda`` without CUDA's headers its
setup.py tries a CUDA build and fails: build its sdist with ``get_cuda_path`` returning
None, ``nanobind`` and ``cython`` installed, and ``pip install --no-build-isolation``).

``--interleaved`` measures the step another way, for machines whose speed drifts by more
than the engines differ (the same step 17 ms in one run and 21 ms in the next): hora and
mpi4jax train side by side in the same two processes (one ``mpirun`` job, ranks bound to
cores), in blocks of ``--block`` steps that alternate between them, with a third step that
averages nothing (the floor: what both add is communication). Drift then hits both
engines in the same minutes::

    python benchmarks/jax_step.py --interleaved --np 2 --blocks 20 --block 20
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
MIB64 = 64 * 1024 * 1024 // 4  # float32 elements
# With as many ranks as cores, XLA's default pool (a thread per core in every rank)
# oversubscribes the machine: the MLP step of one rank went from 15 to 40 ms with it.
SINGLE_THREADED_XLA = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def _timed(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _averaging_ms(
    params: Any, average: Callable[[list[Any]], list[Any]], wrap: Callable[..., Any], iters: int
) -> float:
    """Milliseconds ``average`` adds to a jitted program (``wrap``) that makes gradient-like
    arrays from the parameters' leaves and applies them."""
    import jax

    def program(averaged: bool) -> Any:
        def run(leaves: list[Any]) -> list[Any]:
            grads = [p * 1.0001 for p in leaves]
            if averaged:
                grads = average(grads)
            return [p - 1e-6 * g for p, g in zip(leaves, grads)]

        return wrap(run)

    leaves = jax.tree_util.tree_leaves(params)
    held = {True: leaves, False: leaves}

    def call(averaged: bool, fn: Any) -> None:
        held[averaged] = fn(held[averaged])
        jax.block_until_ready(held[averaged])

    with_it, without = program(True), program(False)
    averaged_ms = _timed(lambda: call(True, with_it), 10, iters * 3)
    plain_ms = _timed(lambda: call(False, without), 10, iters * 3)
    return averaged_ms - plain_ms


def _model_and_data(rank: int) -> tuple[Any, Any, Any, Any]:
    import flax.linen as nn
    import jax
    import numpy as np

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            x = nn.relu(nn.Dense(1024)(x))
            x = nn.relu(nn.Dense(1024)(x))
            return nn.Dense(10)(x)

    rng = np.random.default_rng(rank)
    x = rng.normal(size=(64, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=64)
    model = MLP()
    params = model.init(jax.random.PRNGKey(0), x[:1])
    return model, params, x, y


def _loss(model: Any) -> Callable[..., Any]:
    import optax

    def loss(params: Any, x: Any, y: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    return loss


def _step(model: Any, tx: Any, average: Callable[[Any], Any]) -> Any:
    """A jitted training step: gradients, ``average`` of them, ``tx``'s update."""
    import jax
    import optax

    grad_fn = jax.grad(_loss(model))

    @jax.jit
    def step(params: Any, state: Any, xb: Any, yb: Any) -> Any:
        updates, state = tx.update(average(grad_fn(params, xb, yb)), state, params)
        return optax.apply_updates(params, updates), state

    return step


def _mpi4jax_mean(comm: Any) -> Callable[[Any], Any]:
    """The mean of an array over ``comm``'s ranks inside jit, with mpi4jax."""
    import mpi4jax
    from mpi4py import MPI

    def mean(g: Any) -> Any:
        return mpi4jax.allreduce(g, op=MPI.SUM, comm=comm) / comm.Get_size()  # 0.9: no token

    return mean


def worker(engine: str, args: argparse.Namespace) -> None:
    """One rank: measures, and on rank 0 prints one JSON line."""
    import jax

    if engine == "jax.distributed":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=os.environ["BENCH_COORDINATOR"],
            num_processes=int(os.environ["BENCH_SIZE"]),
            process_id=int(os.environ["BENCH_RANK"]),
        )
    import jax.numpy as jnp
    import numpy as np
    import optax

    result: dict[str, Any] = {"engine": engine}
    tx_inner = optax.adam(1e-3)
    if engine == "hora":
        import hora.jax as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        x = jnp.ones(MIB64, jnp.float32)
        allreduce = jax.jit(lambda x: hvd.allreduce(x, op=hvd.Sum))
        result["allreduce_ms"] = _timed(lambda: allreduce(x).block_until_ready(), 2, args.iters)
        result["allreduce_eager_ms"] = _timed(lambda: hvd.allreduce(x, op=hvd.Sum).block_until_ready(), 2, args.iters)
        tx = hvd.DistributedOptimizer(tx_inner)
        model, params, xb, yb = _model_and_data(rank)
        step = _step(model, tx, lambda grads: grads)

        average, wrap = (lambda grads: hvd.grouped_allreduce(grads)), jax.jit  # what DistributedOptimizer does
        average_params = params

    elif engine == "mpi4jax":
        import mpi4jax
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        x = jnp.ones(MIB64, jnp.float32)
        allreduce = jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm))  # 0.9: no token
        result["allreduce_ms"] = _timed(lambda: allreduce(x).block_until_ready(), 2, args.iters)
        tx = tx_inner
        model, params, xb, yb = _model_and_data(rank)
        mean = _mpi4jax_mean(comm)
        step = _step(model, tx, lambda grads: jax.tree_util.tree_map(mean, grads))
        average, wrap = (lambda grads: [mean(g) for g in grads]), jax.jit
        average_params = params

    else:  # jax.distributed
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        rank, size = jax.process_index(), jax.process_count()
        mesh = jax.make_mesh((size,), ("i",))
        rows = NamedSharding(mesh, P("i"))
        local = jax.local_devices()[0]

        def global_array(local_value: Any) -> Any:
            shape = (size * local_value.shape[0], *local_value.shape[1:])
            return jax.make_array_from_single_device_arrays(shape, rows, [jax.device_put(local_value, local)])

        x = global_array(np.ones((1, MIB64), np.float32))
        psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P("i")))
        result["allreduce_ms"] = _timed(lambda: psum(x).block_until_ready(), 2, args.iters)
        tx = tx_inner
        model, params, xb, yb = _model_and_data(rank)
        grad_fn = jax.grad(_loss(model))

        def local_step(params: Any, state: Any, xb: Any, yb: Any) -> Any:
            grads = jax.lax.pmean(grad_fn(params, xb, yb), "i")
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        replicated = NamedSharding(mesh, P())
        params = jax.device_put(params, replicated)
        step = jax.jit(
            jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("i"), P("i")), out_specs=(P(), P()))
        )
        xb, yb = global_array(xb), global_array(yb)

        def average(grads: list[Any]) -> list[Any]:
            return [jax.lax.pmean(g, "i") for g in grads]

        def wrap(fn: Any) -> Any:
            return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P()))

        average_params = params

    state = tx.init(params)
    holder = {"params": params, "state": state}

    def one_step() -> None:
        holder["params"], holder["state"] = step(holder["params"], holder["state"], xb, yb)
        jax.block_until_ready(holder["params"])

    result["step_ms"] = _timed(one_step, 3, args.iters * 2)
    result["average_ms"] = _averaging_ms(average_params, average, wrap, args.iters)
    result["size"] = size
    if rank == 0:
        print("BENCH " + json.dumps(result), flush=True)
    if engine == "hora":
        hvd.shutdown()


def interleaved_worker(args: argparse.Namespace) -> None:
    """One rank of ``--interleaved``: hora's and mpi4jax's steps (and one that averages
    nothing) in alternating blocks; rank 0 prints one JSON line of median milliseconds."""
    import jax
    import optax
    from mpi4py import MPI

    import hora.jax as hvd

    hvd.init()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    adam = optax.adam(1e-3)
    distributed = hvd.DistributedOptimizer(adam)
    model, params, xb, yb = _model_and_data(rank)
    mean = _mpi4jax_mean(comm)
    engines = {
        "hora": (_step(model, distributed, lambda g: g), distributed),
        "mpi4jax": (_step(model, adam, lambda g: jax.tree_util.tree_map(mean, g)), adam),
        "local": (_step(model, adam, lambda g: g), adam),
    }
    held = {name: [params, tx.init(params)] for name, (_, tx) in engines.items()}

    def one(name: str) -> None:
        held[name][0], held[name][1] = engines[name][0](held[name][0], held[name][1], xb, yb)
        jax.block_until_ready(held[name][0])

    for name in engines:
        for _ in range(5):
            one(name)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for block in range(args.blocks):
        order = list(engines) if block % 2 == 0 else list(engines)[::-1]
        for name in order:
            comm.Barrier()
            for _ in range(args.block):
                start = time.perf_counter()
                one(name)
                times[name].append((time.perf_counter() - start) * 1e3)
    if rank == 0:
        print("BENCH " + json.dumps({name: statistics.median(t) for name, t in times.items()}), flush=True)
    hvd.shutdown()


def interleaved(args: argparse.Namespace) -> None:
    """Runs ``--interleaved`` and prints its table."""
    try:
        import mpi4jax  # noqa: F401
    except ImportError:
        sys.exit("--interleaved needs mpi4jax (see the module's docstring)")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    if args.single_threaded_xla:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + SINGLE_THREADED_XLA).strip()
    command = ["mpirun", "--allow-run-as-root", "--bind-to", "core", "-np", str(args.np), sys.executable, __file__,
               "--worker", "interleaved", "--blocks", str(args.blocks), "--block", str(args.block)]  # fmt: skip
    out = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=args.timeout).stdout
    lines = [line.split("BENCH ", 1)[1] for line in out.splitlines() if "BENCH " in line]
    if not lines:
        sys.exit("interleaved run failed:\n" + out[-3000:])
    med = json.loads(lines[0])
    print(f"{args.np} ranks, {os.cpu_count()} CPUs, ranks bound to cores, {args.blocks} blocks of {args.block} steps "
          f"per engine, alternating; load average {os.getloadavg()[0]:.1f} at the end")  # fmt: skip
    print(f"{'step':10s} {'median ms':>10s} {'over local':>11s}")
    for name, ms in med.items():
        print(f"{name:10s} {ms:10.2f} {ms - med['local']:11.2f}")
    print(f"mpi4jax / hora: step {med['mpi4jax'] / med['hora']:.3f}x, "
          f"communication {(med['mpi4jax'] - med['local']) / (med['hora'] - med['local']):.3f}x")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(engine: str, args: argparse.Namespace) -> dict[str, Any] | None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    if args.single_threaded_xla:  # every engine alike: one XLA compute thread per rank
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + SINGLE_THREADED_XLA).strip()
    me = [sys.executable, __file__, "--worker", engine.split("-")[0], "--iters", str(args.iters)]
    if engine in ("hora", "hora-bound"):
        bind = ["--bind-to", "core"] if engine == "hora-bound" else []
        procs = [subprocess.Popen([sys.executable, "-m", "hora.runner", "-np", str(args.np), *bind, *me], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    elif engine == "mpi4jax":
        procs = [subprocess.Popen(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.np), *me],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    else:
        port = _free_port()
        procs = [
            subprocess.Popen(me, env=dict(env, BENCH_COORDINATOR=f"127.0.0.1:{port}", BENCH_SIZE=str(args.np),
                                          BENCH_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(args.np)
        ]  # fmt: skip
    outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    for line in "".join(outputs).splitlines():
        if "BENCH " in line:
            return dict(json.loads(line.split("BENCH ", 1)[1]))
    print(f"{engine} failed:\n" + "".join(outputs)[-3000:], file=sys.stderr)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--engines", default="hora,hora-bound,jax.distributed,mpi4jax")
    parser.add_argument(
        "--multi-threaded-xla",
        dest="single_threaded_xla",
        action="store_false",
        help="leave XLA's intra-op thread pool at its default (one thread per core in every rank)",
    )
    parser.add_argument("--interleaved", action="store_true",
                        help="hora's and mpi4jax's MLP steps in alternating blocks inside one mpirun job")
    parser.add_argument("--blocks", type=int, default=20, help="--interleaved: blocks per engine")
    parser.add_argument("--block", type=int, default=20, help="--interleaved: steps per block")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "interleaved":
        interleaved_worker(args)
        return
    if args.worker:
        worker(args.worker, args)
        return
    if args.interleaved:
        interleaved(args)
        return
    engines = args.engines.split(",")
    if "mpi4jax" in engines:
        try:
            import mpi4jax  # noqa: F401
        except ImportError:
            print("mpi4jax is not installed: skipped", file=sys.stderr)
            engines.remove("mpi4jax")
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    for _ in range(args.rounds):
        for engine in engines:
            got = _launch(engine, args)
            if got:
                runs[engine].append(got)
    cpus = os.cpu_count()
    load = os.getloadavg()[0]
    threads = "one XLA thread per rank" if args.single_threaded_xla else "XLA's default threads"
    print(f"{args.np} ranks, {cpus} CPUs, {threads}, load average {load:.1f} at the end; medians over {args.rounds} rounds (ms)")
    print(f"{'engine':18s} {'64 MiB allreduce':>17s} {'MLP step':>9s} {'average':>8s}")
    table = {}
    for engine, results in runs.items():
        if not results:
            continue
        med = {k: statistics.median(r[k] for r in results) for k in ("allreduce_ms", "step_ms", "average_ms")}
        table[engine] = med
        print(f"{engine:18s} {med['allreduce_ms']:17.1f} {med['step_ms']:9.2f} {med['average_ms']:8.2f}")
        if engine.startswith("hora"):
            eager = statistics.median(r["allreduce_eager_ms"] for r in results)
            print(f"{engine + ' (eager)':18s} {eager:17.1f}")
    for mine in (e for e in ("hora", "hora-bound") if e in table):
        for engine, med in table.items():
            if not engine.startswith("hora"):
                print(
                    f"{engine} / {mine}: allreduce {med['allreduce_ms'] / table[mine]['allreduce_ms']:.2f}x, "
                    f"step {med['step_ms'] / table[mine]['step_ms']:.2f}x, "
                    f"average {med['average_ms'] / table[mine]['average_ms']:.2f}x"
                )

if __name__ == "__main__":
    main()
