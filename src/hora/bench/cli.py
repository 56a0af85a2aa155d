"""``hora-bench``: nccl-tests' ``all_reduce_perf`` for hora, and hora side by side with its peers.

``hora-bench -np 2`` starts two ranks through horarun's machinery and prints, per size,
the time of one collective, its algorithm bandwidth and its bus bandwidth; started under
a launcher instead (``horarun -np 2 hora-bench``, or ``mpirun``), it runs in the ranks it
was started as and rank 0 reports. ``--peers`` then runs torch.distributed (gloo), mpi4py
on Open MPI and Horovod (gloo and MPI) on the same sizes, each with its own launcher,
and prints each one's time and hora's ratio to it. ``-H host:slots,...`` runs every
backend's ranks on those hosts over ssh, as horarun does (see ``hora.bench.peers``).
See docs/benchmarking.md.

Exit codes: 0 when every backend ran; 1 when hora or a peer failed (the others still
report); 2 for a usage error; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from hora.bench import plot, report
from hora.bench.launch import BenchError, read_result, run_hora, run_processes
from hora.bench.load import ForeignLoad, busy_share, wait_idle
from hora.bench.peers import MARKER, PEERS, Hosts, Peer, detect, parse_peers, sweep
from hora.bench.plan import Plan, parse_collectives, parse_size, parse_sizes, size_range
from hora.bench.worker import COLLECTIVES, DTYPES, OPS
from hora.runner.arguments import USAGE_ERROR, Parser
from hora.runner.hosts import SlotInfo, parse_hosts
from hora.runner.hosts import plan as plan_slots
from hora.runner.ssh import SshSettings
from hora.version import __version__

DEFAULT_TIMEOUT = 3600.0
BUSY_WARNING = 0.15  # share of the CPUs other programs used just before a run that earns a warning


def make_parser() -> argparse.ArgumentParser:
    """Returns the ``hora-bench`` argument parser (nccl-tests' flag names where they exist)."""
    p = Parser(
        prog="hora-bench",
        description="Time hora's collectives per message size (like nccl-tests), optionally next to its peers.",
        allow_abbrev=False,
    )
    p.add_argument("-v", "--version", action="version", version=f"hora {__version__}")
    p.add_argument("-np", "--num-proc", dest="num_proc", type=int, metavar="N",
                   help="ranks to start (default 1, or every slot of -H)")  # fmt: skip
    p.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                   help="run hora's ranks and the peers' on these hosts, over ssh, as horarun -H does")  # fmt: skip
    p.add_argument("-p", "--ssh-port", dest="ssh_port", type=int, metavar="PORT", help="ssh port on the hosts")
    p.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file", metavar="FILE", help="ssh private key")
    p.add_argument("--network-interfaces", dest="network_interfaces", metavar="NICS",
                   help="the hosts' interfaces to use, comma-separated (hora's HORA_IFACE, torch's "
                   "GLOO_SOCKET_IFNAME, mpirun's btl_tcp_if_include, horovodrun's --network-interfaces)")  # fmt: skip
    p.add_argument(
        "--collective",
        default="allreduce",
        metavar="LIST",
        help=f"'all' or some of {','.join(COLLECTIVES)} (default allreduce)",
    )
    p.add_argument("-b", "--minbytes", default="4", metavar="SIZE", help="smallest size, e.g. 4, 8K (default 4)")
    p.add_argument("-e", "--maxbytes", default="256M", metavar="SIZE", help="largest size (default 256M)")
    p.add_argument("-f", "--stepfactor", type=float, default=4.0, metavar="F", help="size multiplier (default 4)")
    p.add_argument("--sizes", metavar="LIST", help="explicit sizes instead of -b/-e/-f, e.g. 4,4K,1M,256M")
    p.add_argument("-d", "--datatype", "--dtype", dest="dtype", default="float32", choices=DTYPES, metavar="TYPE",
                   help=f"one of {', '.join(DTYPES)} (default float32)")  # fmt: skip
    p.add_argument("-o", "--op", default="sum", choices=OPS, help="reduction of allreduce/reducescatter (default sum)")
    p.add_argument("-r", "--root", type=int, default=0, help="broadcast's root rank (default 0)")
    p.add_argument("-n", "--iters", type=int, default=0, help="timed iterations per size (default: 1000 down to 5 by size)")
    p.add_argument(
        "-w", "--warmup-iters", "--warmup", dest="warmup", type=int, default=5, help="untimed iterations (default 5)"
    )
    p.add_argument("--max-time", type=float, default=20.0, metavar="SECONDS",
                   help="stop a size's timed iterations early after this long (default 20; 0: never)")  # fmt: skip
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1, help="verify each size's result once (default 1)")
    p.add_argument(
        "--latency", type=int, default=1000, metavar="N", help="back-to-back 4-byte allreduces (default 1000; 0: skip)"
    )
    p.add_argument("--wait-test", dest="wait", type=float, default=5.0, metavar="SECONDS",
                   help="CPU-while-waiting test: the last rank arrives this late (default 5; 0: skip)")  # fmt: skip
    p.add_argument("--peers", nargs="?", const="all", metavar="LIST",
                   help=f"also run the peers: all (default) or some of {','.join(PEERS)},horovod")  # fmt: skip
    p.add_argument("--horovod-python", metavar="PYTHON", help="the interpreter that has Horovod (default: this one)")
    p.add_argument("--runs", type=int, default=1, help="repeat every backend, alternating; report the median (default 1)")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="before each backend, wait up to this long for other programs to leave the CPUs idle")  # fmt: skip
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help=f"stop a backend's run after this long (default {DEFAULT_TIMEOUT:g})")  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="write every result, the plan and the machine as JSON")
    p.add_argument("--plot", metavar="FILE", help="draw time and bus bandwidth against size (needs matplotlib)")
    return p


def build_plan(args: argparse.Namespace) -> Plan:
    """The plan the flags describe; ValueError names a bad flag."""
    if args.sizes is not None:
        sizes = parse_sizes(args.sizes)
    else:
        sizes = size_range(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    return Plan(
        collectives=tuple(parse_collectives(args.collective)),
        sizes=tuple(sizes),
        dtype=args.dtype,
        op=args.op,
        root=args.root,
        iters=args.iters,
        warmup=args.warmup,
        check=bool(args.check),
        latency=args.latency,
        wait=args.wait,
        max_time=args.max_time,
    )


def _in_job() -> tuple[int, int] | None:
    """(rank, size) when started as a rank by a launcher hora recognises, else None."""
    from hora.config import Config

    config = Config.from_env()
    if config.launcher == "none":
        return None
    return config.topology.rank, config.topology.size


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``hora-bench``; returns the exit code (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    try:
        job = _in_job()
        default = sum(spec.slots for spec in parse_hosts(args.hosts)) if args.hosts else 1
        size = job[1] if job else (default if args.num_proc is None else args.num_proc)
        if job and args.num_proc not in (None, size):
            raise ValueError(f"-np {args.num_proc} was given, but hora-bench was started as one of {size} ranks")
        if size < 1:
            raise ValueError(f"-np {size} is not valid: expected an integer >= 1")
        if args.runs < 1:
            raise ValueError(f"--runs {args.runs} is not valid: expected an integer >= 1")
        if not args.wait_idle >= 0:
            raise ValueError(f"--wait-idle {args.wait_idle:g} is not valid: expected seconds >= 0")
        if not args.timeout > 0:
            raise ValueError(f"--timeout {args.timeout:g} is not valid: expected seconds > 0")
        plan = build_plan(args)
        plan.validate(size)
        slots = tuple(plan_slots(size, args.hosts)) if args.hosts else ()
        ssh = SshSettings.from_env(args.ssh_port, args.ssh_identity_file) if args.hosts else None
        chosen = parse_peers(args.peers) if args.peers else []
        if args.plot:
            plot.require()
    except (ValueError, plot.PlotUnavailable) as exc:
        print(f"hora-bench: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    try:
        with _signals_interrupt():
            return _bench(args, argv, plan, size, job, chosen, slots, ssh)
    except KeyboardInterrupt:
        print("hora-bench: interrupted", file=sys.stderr)
        return 130


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt, so every started process is stopped on the way out."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _bench(
    args: argparse.Namespace, argv: list[str], plan: Plan, size: int, job: tuple[int, int] | None, chosen: list[str],
    slots: tuple[SlotInfo, ...] = (), ssh: SshSettings | None = None,
) -> int:  # fmt: skip
    """Runs hora (here when we are its ranks, else through the launcher) and the peers; reports.

    With ``-H`` (``slots`` and ``ssh`` given), every backend's ranks run on those hosts.
    """
    runs: dict[str, list[dict[str, Any]]] = {"hora": []}
    failed: dict[str, str] = {}
    if job is not None:  # we are the ranks: run hora here, then rank 0 carries on alone
        from hora.bench import worker

        for _ in range(args.runs):
            rank, result = worker.run("hora", plan.to_json(), live=True)
            runs["hora"].append(result)
        if rank != 0:
            return 0
    peers, skipped = detect(chosen, args.horovod_python) if chosen else ([], {})
    for key, why in skipped.items():
        print(f"# {key} skipped: {why}", flush=True)
    directory = tempfile.mkdtemp(prefix="hora-bench-")
    hosts = None
    if slots and ssh is not None:
        hosts = Hosts(args.hosts, slots, ssh, args.network_interfaces, directory)
    try:
        plan_path = os.path.join(directory, "plan.json")
        with open(plan_path, "w", encoding="utf-8") as handle:
            json.dump(plan.to_json(), handle)
        for run in range(args.runs):
            if job is None:
                if not _run_one("hora", None, size, plan_path, directory, run, args, runs, failed, hosts):
                    return 1  # _run_one said why
            for peer in peers:
                if peer.key not in failed:
                    _run_one(peer.key, peer, size, plan_path, directory, run, args, runs, failed, hosts)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return _report(args, argv, plan, size, runs, {**skipped, **failed}, failed)


def _run_one(
    key: str, peer: Peer | None, size: int, plan_path: str, directory: str, run: int,
    args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]], failed: dict[str, str],
    hosts: Hosts | None = None,
) -> bool:  # fmt: skip
    """Runs one backend once; records its results or why it failed.

    With ``hosts``, its ranks run on them; afterwards every process of the run still
    alive on a host is killed (``sweep``), whether the run succeeded, failed or timed out.
    """
    out = os.path.join(directory, f"{key}.{run}.json")
    worker_args = ["--plan", plan_path, "--out", out, "--live"]
    tag = f" (run {run + 1} of {args.runs})" if args.runs > 1 else ""
    busy = wait_idle(args.wait_idle, BUSY_WARNING) if args.wait_idle > 0 else busy_share()
    print(f"## {key}, {size} ranks{tag}", flush=True)
    if busy is not None and busy > BUSY_WARNING:
        print(
            f"# warning: other programs kept {100 * busy:.0f}% of the CPUs busy just before this run: "
            "its numbers may be noisy",
            flush=True,
        )
    foreign = ForeignLoad()
    foreign.start()
    # Every process of this run carries the marker, so that sweep finds those left on a host.
    marker = f"{os.getpid()}-{key}-{run}-{uuid.uuid4().hex[:8]}"
    left = 0
    try:
        if peer is None:
            result = run_hora(
                size, worker_args, out, {"OMP_NUM_THREADS": "1", MARKER: marker}, args.timeout,
                hosts=args.hosts, ssh_port=args.ssh_port, ssh_identity_file=args.ssh_identity_file,
                network_interfaces=args.network_interfaces,
            )  # fmt: skip
        else:
            commands = peer.commands(size, worker_args, {**os.environ, MARKER: marker}, hosts)
            run_processes(key, commands, os.path.join(directory, f"{key}.log"), args.timeout)
            result = read_result(out, key)
    except BenchError as exc:
        failed[key] = f"failed: {exc}"
        print(f"hora-bench: {key} failed:\n{exc}", file=sys.stderr, flush=True)
        return False
    finally:  # also when interrupted: the hosts' processes are not ours to signal locally
        if hosts is not None:
            left = sweep(hosts, marker)
    if left:  # a launcher that exits before its ranks: say so, the numbers are still rank 0's
        print(f"# {key}: {left} process(es) of the run were still alive on the hosts after it; killed", flush=True)
    # With -H the ranks are children of the hosts' sshd, not of hora-bench: their CPU time
    # cannot be told from other programs', so the share during the run is not measured.
    during = foreign.stop() if hosts is None else None
    if during is not None and during > BUSY_WARNING:
        print(f"# warning: other programs used {100 * during:.0f}% of the CPUs during this run", flush=True)
    result["background_cpu_share"] = busy
    result["foreign_cpu_share"] = during
    runs.setdefault(key, []).append(result)
    return True


def _report(
    args: argparse.Namespace, argv: list[str], plan: Plan, size: int,
    runs: dict[str, list[dict[str, Any]]], skipped: dict[str, str], failed: dict[str, str],
) -> int:  # fmt: skip
    """Prints the merged and comparison tables; writes --json and --plot."""
    merged = {key: report.merge_runs(results) for key, results in runs.items() if results}
    peers_ran = len(merged) > 1
    lines: list[str] = []
    if args.runs > 1:
        for rep in merged.values():
            lines += ["", *report.backend_table(rep)]
    if peers_ran:
        for collective in plan.collectives:
            lines += ["", *report.comparison(collective, merged, plan.to_json())]
        lines += ["", *report.latency_table(merged)]
    if peers_ran or args.runs > 1:
        lines += report.noise_lines(runs)
    for key, why in skipped.items():
        lines.append(f"# {key}: {'skipped: ' if key not in failed else ''}{why.splitlines()[0]}")
    if lines:
        print("\n".join(lines), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report.document(argv, plan.to_json(), size, merged, runs, skipped), handle, indent=1)
        print(f"# results written to {args.json}")
    if args.plot:
        info = report.machine()
        where = f" on {len(parse_hosts(args.hosts))} hosts" if args.hosts else ""
        title = f"hora-bench, {size} ranks{where}, {info['cpus']} CPUs ({info['hostname']})"
        plot.draw(args.plot, merged, plan.to_json(), title)
        print(f"# plot written to {args.plot}")
    return 1 if failed else 0
