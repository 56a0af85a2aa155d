"""Kill, freeze and interrupt ranks at random points and measure how the survivors end.

Ranks start the way torchrun or a Kubernetes operator starts them (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and a
job secret): no horarun, so nobody cleans up after a failure, and a survivor that waits
for ever shows as a hang. Each trial picks a workload (a collective, a size, a
transport), starts the ranks, lets them warm up, then SIGKILLs one rank (with
``--freeze``, SIGSTOPs it; with ``--interrupt``, sends it SIGINT, as Ctrl-C in its
terminal would) at a random moment, which for large collectives usually lands in the
data phase.

Reported per trial: whether every survivor raised ``HoraInternalError``, how long after
the kill the last survivor raised, and what the error said; an interrupted rank must
itself end with ``KeyboardInterrupt``. Summary: hangs (a survivor, or an interrupted
rank, still running ``--hang-after`` seconds after the signal) and the median and maximum
time from the signal to the last survivor's error.

Examples::

    python benchmarks/chaos.py --trials 50 --np 3
    python benchmarks/chaos.py --trials 10 --np 2 --freeze --stall-check 2 --stall-shutdown 4
    python benchmarks/chaos.py --trials 20 --np 3 --interrupt

Each survivor measures its own time of failure with ``time.monotonic`` (one clock for
every process of one machine) and prints it, so the times do not include the driver's
polling.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (operation, bytes per rank)
WORKLOADS = {
    "allreduce-64M": ("allreduce", 64 << 20),
    "allreduce-256K": ("allreduce", 256 << 10),
    "allreduce-4": ("allreduce", 4),
    "allgather-16M": ("allgather", 16 << 20),
    "broadcast-64M": ("broadcast", 64 << 20),
    "alltoall-16M": ("alltoall", 16 << 20),
    "reducescatter-16M": ("reducescatter", 16 << 20),
    "grouped-16x1M": ("grouped", 1 << 20),
    # 160 asynchronous calls in a row, then a synchronize of each: tensors submitted
    # while others are in flight wait for the engine thread's next pass (a burst).
    "burst-160x4": ("burst", 4),
}
TRANSPORTS = ("shm", "tcp")


def worker(operation: str, nbytes: int) -> int:
    """One rank: warm up, say ready, then run the collective until it fails."""
    import numpy as np

    import hora.numpy as hvd

    hvd.init()
    count = max(1, nbytes // 4)
    size = hvd.size()
    data = np.ones(count - count % size if operation in ("alltoall", "reducescatter") else count, np.float32)
    tensors = [np.ones(count, np.float32) for _ in range({"grouped": 16, "burst": 160}.get(operation, 0))]

    def step(i: int) -> None:
        name = f"step.{i % 4}"
        if operation == "allreduce":
            hvd.allreduce_(data, name=name)
        elif operation == "allgather":
            hvd.allgather(data, name=name)
        elif operation == "broadcast":
            hvd.broadcast_(data, root_rank=i % size, name=name)
        elif operation == "alltoall":
            hvd.alltoall(data, name=name)
        elif operation == "reducescatter":
            hvd.reducescatter(data, name=name)
        elif operation == "burst":
            handles = [hvd.allreduce_async_(tensor, name=f"{name}.{k}") for k, tensor in enumerate(tensors)]
            for handle in handles:
                hvd.synchronize(handle)
        else:
            hvd.grouped_allreduce_(tensors, name=name)

    for i in range(3):
        step(i)
    print("READY", flush=True)
    i = 0
    try:
        while True:
            step(i)
            i += 1
    except hvd.HoraInternalError as exc:
        print("FAILED " + json.dumps({"time": time.monotonic(), "error": str(exc), "kind": "HoraInternalError"}), flush=True)
        return 3
    except BaseException as exc:  # noqa: BLE001 - reported as a wrong kind of error (or, interrupted, the right one)
        print("FAILED " + json.dumps({"time": time.monotonic(), "error": repr(exc), "kind": type(exc).__name__}), flush=True)
        return 4


def names(error: str, rank: int) -> bool:
    """True when a hora error names ``rank``: ``rank 2 on host ...`` (lost), ``for rank(s) 2``
    (a data-phase stall) or ``Missing ranks:`` followed by ``2: [...]`` (a negotiation stall)."""
    return re.search(rf"\brank(?:\(s\))? {rank}\b|^{rank}: \[", error, re.MULTILINE) is not None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(np_: int, workload: str, transport: str, extra: dict[str, str]) -> list[subprocess.Popen[str]]:
    operation, nbytes = WORKLOADS[workload]
    port = _free_port()
    secret = os.urandom(32).hex()
    procs = []
    for rank in range(np_):
        env = dict(os.environ)
        for name in [n for n in env if n.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMI_", "SLURM_"))]:
            del env[name]
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(np_),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(np_),
            HORA_SECRET=secret,
            HORA_SHARED_MEMORY="1" if transport == "shm" else "0",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
            **extra,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", operation, str(nbytes)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def _wait_ready(procs: list[subprocess.Popen[str]], timeout: float) -> list[list[str]]:
    """Reads each rank's output up to its READY line."""
    lines: list[list[str]] = []
    deadline = time.monotonic() + timeout
    for rank, proc in enumerate(procs):
        seen: list[str] = []
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                for other in procs:  # the others' output says why (the first to fail)
                    if other.poll() is None:
                        os.killpg(other.pid, signal.SIGKILL)
                rest = [f"--- rank {r} (exit {p.wait()}):\n{p.communicate()[0][-3000:]}" for r, p in enumerate(procs) if r != rank]
                raise RuntimeError(f"rank {rank} exited (exit {proc.wait()}) before it was ready:\n" + "".join(seen) + "\n".join(rest))
            seen.append(line)
            if line.startswith("READY"):
                break
        lines.append(seen)
    return lines


def trial(
    np_: int, workload: str, transport: str, how: signal.Signals, hang_after: float, rng: random.Random, extra: dict[str, str]
) -> dict[str, object]:
    """Runs one job, sends one rank in it ``how`` (SIGKILL, SIGSTOP or SIGINT), and
    reports how the others ended (and, for SIGINT, how the interrupted rank ended)."""
    procs = _start(np_, workload, transport, extra)
    victim = rng.randrange(np_)
    try:
        _wait_ready(procs, 60.0)
        time.sleep(rng.uniform(0.0, 0.3))
        killed_at = time.monotonic()
        os.kill(procs[victim].pid, how)
        outcomes: dict[int, dict[str, object]] = {}
        deadline = killed_at + hang_after
        for rank, proc in enumerate(procs):
            if rank == victim and how != signal.SIGINT:
                continue
            try:
                output, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                outcomes[rank] = {"hung": True}
                continue
            failed = [line for line in output.splitlines() if line.startswith("FAILED ")]
            if failed:
                record = json.loads(failed[-1][len("FAILED ") :])
                outcomes[rank] = {
                    "hung": False,
                    "seconds": record["time"] - killed_at,
                    "kind": record["kind"],
                    "error": record["error"],
                }
            else:
                outcomes[rank] = {"hung": False, "seconds": None, "kind": f"exit {proc.returncode}", "error": output[-2000:]}
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {"workload": workload, "transport": transport, "victim": victim, "np": np_, "outcomes": outcomes}


def _survivor_times(outcomes: dict[int, dict[str, object]], victim: int) -> list[float]:
    """Seconds from the signal to each survivor's error (the victim's own end left out)."""
    return [float(o["seconds"]) for r, o in outcomes.items() if r != victim and o.get("seconds") is not None]  # type: ignore[arg-type]


def as_expected(rank: int, outcome: dict[str, object], victim: int) -> bool:
    """A survivor raised ``HoraInternalError`` naming the victim; an interrupted victim
    ended with ``KeyboardInterrupt``."""
    if rank == victim:
        return outcome.get("kind") == "KeyboardInterrupt"
    return outcome.get("kind") == "HoraInternalError" and names(str(outcome.get("error")), victim)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("OP", "BYTES"), help=argparse.SUPPRESS)
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--np", type=int, default=3, help="ranks per job (a random count in 2..NP with --vary-np)")
    parser.add_argument("--vary-np", action="store_true")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    signals = parser.add_mutually_exclusive_group()
    signals.add_argument("--freeze", action="store_true", help="SIGSTOP instead of SIGKILL")
    signals.add_argument("--interrupt", action="store_true", help="SIGINT instead of SIGKILL")
    parser.add_argument("--stall-check", type=float, help="HORA_STALL_CHECK_TIME_SECONDS for the ranks")
    parser.add_argument("--stall-shutdown", type=float, help="HORA_STALL_SHUTDOWN_TIME_SECONDS for the ranks")
    parser.add_argument("--hang-after", type=float, default=30.0, help="seconds after which a survivor counts as hung")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write every trial's record here")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]))
    rng = random.Random(args.seed)
    extra = {}
    if args.stall_check is not None:
        extra["HORA_STALL_CHECK_TIME_SECONDS"] = f"{args.stall_check:g}"
    if args.stall_shutdown is not None:
        extra["HORA_STALL_SHUTDOWN_TIME_SECONDS"] = f"{args.stall_shutdown:g}"
    how = signal.SIGSTOP if args.freeze else signal.SIGINT if args.interrupt else signal.SIGKILL
    workloads = args.workloads.split(",")
    transports = args.transports.split(",")
    records = []
    for number in range(args.trials):
        np_ = rng.randint(2, args.np) if args.vary_np else args.np
        record = trial(np_, rng.choice(workloads), rng.choice(transports), how, args.hang_after, rng, extra)
        records.append(record)
        outcomes = record["outcomes"]
        assert isinstance(outcomes, dict)
        victim = record["victim"]
        assert isinstance(victim, int)
        hung = [r for r, o in outcomes.items() if o["hung"]]
        times = _survivor_times(outcomes, victim)
        kinds = sorted({str(o.get("kind")) for o in outcomes.values() if not o["hung"]})
        unexpected = [r for r, o in outcomes.items() if not o["hung"] and not as_expected(r, o, victim)]
        last = f"{max(times) * 1e3:7.1f} ms" if times and not hung else "      -   "
        print(
            f"{number + 1:3d} np={np_} {record['workload']:18s} {record['transport']:3s} victim={victim} "
            f"last error after {last}  hung={hung or '-'}  {','.join(kinds)}"
            + (f"  unexpected outcome on {unexpected}" if unexpected else ""),
            flush=True,
        )
        if hung or unexpected:
            for rank, outcome in outcomes.items():
                print(f"      rank {rank}: {json.dumps(outcome)[:600]}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    lasts = []
    hangs = 0
    wrong = 0
    for record in records:
        outcomes = record["outcomes"]
        assert isinstance(outcomes, dict)
        if any(o["hung"] for o in outcomes.values()):
            hangs += 1
            continue
        victim = record["victim"]
        assert isinstance(victim, int)
        if not all(as_expected(rank, outcome, victim) for rank, outcome in outcomes.items()):
            wrong += 1
        times = _survivor_times(outcomes, victim)
        if times:
            lasts.append(max(times))
    print(
        f"\n{len(records)} trials: {hangs} with a hung rank, {wrong} with another outcome than a "
        "HoraInternalError naming the stopped rank (and KeyboardInterrupt on an interrupted one)"
    )
    if lasts:
        print(
            f"signal -> last survivor's error: median {statistics.median(lasts) * 1e3:.0f} ms, "
            f"max {max(lasts) * 1e3:.0f} ms (over {len(lasts)} trials without a hang)"
        )
    return 1 if hangs or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
