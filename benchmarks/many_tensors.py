"""Many small tensors: what each tensor of a collective costs beyond its data, hora against Horovod.

A model with ~160 parameters hands its engine ~160 gradients a step; what bounds the
step then is each tensor's work (submit, negotiate, fuse, complete), not the bytes.
Two patterns, torch tensors, every rank on this machine:

* ``grouped``: one ``grouped_allreduce_`` of ``--count`` tensors (hora's
  ``DistributedOptimizer`` after backward on a saturated machine, JAX pytrees, Keras).
* ``separate``: ``--count`` ``allreduce_async_`` calls in a row, then a ``synchronize``
  of each (Horovod's gradient hooks when backward is fast, metric averaging).

Each engine runs ``--iters`` timed repetitions (after warm-up) and reports the median in
milliseconds; engines alternate round by round so that the machine's drift hits all alike,
and the table shows each cell's median over rounds and Horovod's time over hora's (above 1:
hora is faster)::

    python benchmarks/many_tensors.py --np 2 --rounds 3
    python benchmarks/many_tensors.py --np 2 --horovod-python /path/to/horovod-venv/bin/python

Horovod (``horovodrun --gloo`` and ``--mpi``) runs when ``--horovod-python`` names a Python
that has it (``../shared/reference/peers.md`` says how it builds against current torch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
PATTERNS = ("grouped", "separate")


def _median_ms(fn: Callable[[], None], barrier: Callable[[], None], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def worker(engine: str, count: int, nbytes: int, iters: int) -> None:
    """One rank: times both patterns and, on rank 0, prints ``RESULT {json}``."""
    import torch

    if engine == "hora":
        import hora.torch as hvd
    else:
        import horovod.torch as hvd  # type: ignore[no-redef]
    hvd.init()
    tensors = [torch.ones(max(1, nbytes // 4)) for _ in range(count)]

    def grouped() -> None:
        hvd.grouped_allreduce_(tensors, name="many")

    def separate() -> None:
        handles = [hvd.allreduce_async_(t, name=f"many.{i}") for i, t in enumerate(tensors)]
        for handle in handles:
            hvd.synchronize(handle)

    def barrier() -> None:
        hvd.allreduce(torch.zeros(1), name="many.barrier")  # Horovod 0.28's barrier needs MPI

    result = {name: _median_ms(fn, barrier, 5, iters) for name, fn in (("grouped", grouped), ("separate", separate))}
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    hvd.shutdown()


def run(engine: str, np_: int, forwarded: list[str], horovod_python: str | None) -> dict[str, float]:
    """One launch of ``engine`` on ``np_`` local ranks; returns rank 0's medians.

    Raises:
        SystemExit: the run failed or printed no result (with its output).
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    if engine == "hora":
        command = [sys.executable, "-m", "hora.runner", "-np", str(np_), sys.executable, __file__,
                   "--worker", "hora", *forwarded]  # fmt: skip
    else:
        assert horovod_python is not None
        horovodrun = str(Path(horovod_python).with_name("horovodrun"))
        env = dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        command = [horovodrun, "-np", str(np_), "-H", f"localhost:{np_}", "--" + engine.split("-", 1)[1],
                   horovod_python, __file__, "--worker", "horovod", *forwarded]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{engine} run failed:\n{proc.stdout}{proc.stderr}")
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            result, _ = json.JSONDecoder().raw_decode(line.split("RESULT ", 1)[1])
            return result  # type: ignore[no-any-return]
    raise SystemExit(f"{engine} run printed no result:\n{proc.stdout}{proc.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument("--count", type=int, default=160, help="tensors per collective call (default: %(default)s)")
    parser.add_argument("--bytes", type=int, default=4, help="bytes per tensor (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=30, help="timed repetitions per run (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    parser.add_argument("--horovod-python", help="a Python with Horovod: adds horovod-gloo and horovod-mpi")
    parser.add_argument("--worker", choices=("hora", "horovod"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    forwarded = ["--count", str(args.count), "--bytes", str(args.bytes), "--iters", str(args.iters)]
    if args.worker:
        worker(args.worker, args.count, args.bytes, args.iters)
        return
    engines = ["hora"] + (["horovod-gloo", "horovod-mpi"] if args.horovod_python else [])
    results: dict[str, list[dict[str, float]]] = {engine: [] for engine in engines}
    for _ in range(args.rounds):
        for engine in engines:
            results[engine].append(run(engine, args.np, forwarded, args.horovod_python))
    print(f"{args.np} ranks, {args.count} tensors of {args.bytes} B, median ms over {args.rounds} rounds")
    print(f"{'engine':14s}" + "".join(f"{p:>12s}" for p in PATTERNS) + "".join(f"{'x ' + p:>14s}" for p in PATTERNS))
    hora = {p: statistics.median(r[p] for r in results["hora"]) for p in PATTERNS}
    for engine in engines:
        cells = {p: statistics.median(r[p] for r in results[engine]) for p in PATTERNS}
        ratios = "".join(f"{cells[p] / hora[p]:14.2f}" for p in PATTERNS)
        print(f"{engine:14s}" + "".join(f"{cells[p]:12.2f}" for p in PATTERNS) + ratios)
        rounds = ", ".join(p + " " + "/".join(f"{r[p]:.2f}" for r in results[engine]) for p in PATTERNS)
        print(f"{'':14s}rounds: {rounds}")


if __name__ == "__main__":
    main()
