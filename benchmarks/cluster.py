"""hora across hosts on an emulated cluster: busbw per size against the link's bound, and beside its peers.

For each host count N of ``--hosts`` and each rate of ``--rate``, this brings up N
network-namespace hosts with a real sshd each (``scripts/netns_hosts.py``), each host's
link shaped to the rate in both directions with ``tc ... tbf`` (or left unshaped with
``none``), runs ``hora-bench -H host:slots,...`` on them (hora's ranks through horarun's
machinery over ssh, as ``tests/test_multihost.py`` starts its jobs; with ``--peers``,
torch-gloo, mpi4py and Horovod's ranks on the same hosts right after, each with its own
launcher, see src/hora/bench/peers.py), and takes the cluster down again. With peers,
each row also shows every peer's time and busbw, hora's time over the peer's (below 1:
hora is faster) and over the fastest peer's. It prints, per collective and size, hora's time, its bus
bandwidth (hora-bench's busbw, computed over ranks) and the ratio of the link bound's
time to hora's, with N counting hosts (with ``--slots 2`` the bound is what each host's
link must carry, whatever happens inside the host; with one rank per host the ratio is
busbw / B):

* ring allreduce: 2(N-1)/N x S / B;
* allgather, reducescatter: (N-1)/N x S / B (S the larger buffer, as hora-bench counts it);
* broadcast: S / B (a pipelined chain; a root that sends to every rank takes (N-1) x S / B).

B is the shaped rate (1 Gbit/s = 0.125 GB/s). tbf counts every frame's bytes, so TCP's
payload tops out at ~0.956 of B at the default MTU (66 bytes of Ethernet, IP and TCP
headers per 1,448 of payload): a ratio of 0.95 is the wire's ceiling, not a loss of hora's.
The hosts run TCP's cubic congestion control (Linux's default; reno where the kernel
does not allow cubic in a namespace: both loss-based, neither paces), whatever this
machine's default is; ``--congestion system`` keeps the machine's (BBR on some: its
pacing leaves a shaped link idle up to 8% of the time on a loaded 2-core machine, see
``scripts/netns_hosts.py``). The machine's facts come first (CPUs, model, memcpy GB/s of
64 MiB, load average), and under each run the filters' drops (tbf dropping packets would make TCP, not hora, the
bound). Unshaped (``--rate none``) the bound is what the machine's CPUs allow: the
``ratio`` column is then empty, and a shaped run's busbw over the unshaped one's at the
same N says how close the shaped run came to what the CPUs allow.

Every host is a namespace of this machine: N hosts share its cores and its memory, so
the kernel's work on each byte (veth, bridge, tbf, TCP on both ends) and every rank's
Python compete for the same CPUs. On a 2-core machine that, not the link, bounds the
unshaped runs and the 10 Gbit/s ones.

hora-bench's check of each size (one run on rank-dependent data, compared with the known
answer) is off unless ``--check``: on this project's 2-core machines, 4 hosts at 1 Gbit/s,
the timed 256 MiB allreduces after it took 3.50-4.17 s in 9 of 11 runs (3.38-3.40 s in
the other two), against 3.38 s in all 5 runs without it. The comparison is what does it (float64 copies of the result and the
answer and ``np.isclose`` over them, ~2 GB of short-lived arrays per rank): the check's
collective and its max over ranks without the comparison leave the timed loop at 3.38 s.
Why that churn slows the network afterwards is not known; hora's allreduce is the same in
both. tests/test_multihost_shaped.py checks the results on shaped links instead.

Needs root, ``ip`` and ``tc`` (iproute2) and OpenSSH (``scripts/setup-system.sh``
installs them). Examples::

    python benchmarks/cluster.py --hosts 2,3,4 --rate 1gbit --sizes 64M,256M --collective allreduce
    python benchmarks/cluster.py --hosts 4 --rate 10gbit,none --slots 2
    python benchmarks/cluster.py --hosts 2,3,4,6,8 --rate 1gbit --json cluster.json
    python benchmarks/cluster.py --hosts 2,4 --rate 1gbit --peers all --horovod-python PY --sizes 4,64K,1M,64M
    python benchmarks/cluster.py --hosts 2,4,8 --peers torch-gloo --plot peers   # peers-2x1-1gbit.png, ...
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hora.bench import plot

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from netns_hosts import Cluster, ensure_system, parse_rate, tbf_parameters  # noqa: E402

COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast")
DEFAULT_SIZES = "4,64K,1M,16M,64M"
# The link bound's time per collective; ``bound_ratio`` divides it by hora's.
BOUND = {
    "allreduce": "2(N-1)/N x S / B",
    "allgather": "(N-1)/N x S / B",
    "reducescatter": "(N-1)/N x S / B",
    "broadcast": "S / B",
}


def machine() -> dict[str, Any]:
    """CPUs, model, kernel, memory copy bandwidth and load: what bounds the numbers besides the link."""
    model = ""
    try:
        with open("/proc/cpuinfo") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    except OSError:
        pass
    source = np.ones(64 << 20, dtype=np.uint8)
    target = np.empty_like(source)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "memcpy_gbps": source.nbytes / min(times) / 1e9,
        "loadavg": os.getloadavg(),
    }


def _cpu_sample() -> tuple[int, int]:
    """(all CPUs' jiffies, idle jiffies) since boot."""
    with open("/proc/stat", encoding="ascii") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    return sum(values), values[3] + values[4]


def plot_path(prefix: str, hosts: int, slots: int, rate: str | None) -> str:
    """The image ``--plot PREFIX`` draws for one run: ``PREFIX-4x1-1gbit.png`` (hosts x slots)."""
    stem = prefix.removesuffix(".png")
    return f"{stem}-{hosts}x{slots}-{rate or 'none'}.png"


def run_one(hosts: int, rate: str | None, args: argparse.Namespace, directory: str) -> dict[str, Any]:
    """Brings up ``hosts`` shaped hosts, runs hora-bench on them, takes them down; returns hora-bench's JSON.

    hora-bench itself starts every backend's ranks on the hosts (``-H``): hora's through
    horarun's machinery, and with ``--peers`` each peer's with its own launcher, one after
    the other on the same links (see src/hora/bench/peers.py).

    Raises:
        RuntimeError: hora-bench failed (its output's end is in the message); a peer's
            failure alone is not one: the document says why it has no results.
    """
    congestion = None if args.congestion == "system" else args.congestion
    # own_hostname: torch's and Horovod's gloo pick their address from the host name, which
    # would resolve to loopback in every namespace (see scripts/netns_hosts.py).
    cluster = Cluster(hosts, rate=rate, congestion=congestion, own_hostname=True).up()
    try:
        out = os.path.join(directory, f"n{hosts}-{rate or 'none'}.json")
        spec = ",".join(f"{host.address}:{args.slots}" for host in cluster.hosts)
        command = [sys.executable, "-m", "hora.bench", "-np", str(hosts * args.slots), "-H", spec,
                   "--network-interfaces", "eth0", "--collective", args.collective, "--sizes", args.sizes,
                   "--latency", "0", "--wait-test", "0", "--max-time", str(args.max_time), "--runs", str(args.runs),
                   "-w", str(args.warmup), "-c", "1" if args.check else "0", "--timeout", str(args.timeout),
                   "--json", out]  # fmt: skip
        if args.iters:
            command += ["-n", str(args.iters)]
        if args.plot:
            command += ["--plot", plot_path(args.plot, hosts, args.slots, rate)]
        if args.peers:
            command += ["--peers", args.peers]
            if args.horovod_python:
                command += ["--horovod-python", args.horovod_python]
        env = dict(os.environ, HORA_SSH_OPTIONS=cluster.ssh_options(), OMP_NUM_THREADS="1")
        env.setdefault("HORA_START_TIMEOUT", "60")
        load = os.getloadavg()[0]
        started, cpu = time.monotonic(), _cpu_sample()
        runs = 1 + len(args.peers.split(",")) if args.peers else 1
        result = subprocess.run(command, capture_output=True, text=True, env=env,
                                timeout=args.timeout * runs * args.runs + 120)  # fmt: skip
        elapsed, cpu_after = time.monotonic() - started, _cpu_sample()
        if result.returncode != 0 and not os.path.exists(out):
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
            raise RuntimeError(f"hora-bench on {hosts} hosts failed ({result.returncode}):\n{tail}")
        with open(out, encoding="utf-8") as handle:
            document: dict[str, Any] = json.load(handle)
        if "hora" not in document["backends"]:
            raise RuntimeError(f"hora failed on {hosts} hosts: {document.get('skipped', {}).get('hora', '?')}")
        document["cluster"] = {
            "hosts": hosts,
            "slots": args.slots,
            "rate": rate,
            "tbf": tbf_parameters(rate) if rate else None,
            "congestion": cluster.congestion_used,
            "qdisc": cluster.qdisc_stats(),
            "loadavg_before": load,
            "loadavg_after": os.getloadavg()[0],
            "wall_s": elapsed,
            # every program's, ours included: near 1.0 means the CPUs, not the links, set the pace
            "cpu_busy_share": 1.0 - (cpu_after[1] - cpu[1]) / max(1, cpu_after[0] - cpu[0]),
        }
        return document
    finally:
        cluster.down()


def bound_ratio(row: dict[str, Any], hosts: int, link: float) -> float:
    """The link bound's time over hora's, N counting hosts (with several ranks per host,
    what each host's link must carry whatever happens inside the host)."""
    factor = {"allreduce": 2 * (hosts - 1) / hosts, "broadcast": 1.0}.get(row["collective"], (hosts - 1) / hosts)
    return float(row["algbw_gbps"]) * factor / link


def table(document: dict[str, Any]) -> list[str]:
    """hora's rows with busbw and the ratio to the link bound; with peers, each peer's time and
    busbw, hora's ratio to it, and hora's ratio to the fastest peer of each row."""
    info = document["cluster"]
    rate = info["rate"]
    link = parse_rate(rate) / 8e9 if rate else None  # GB/s
    hosts = info["hosts"]
    qdisc = info["qdisc"]
    backends = document["backends"]
    peers = [name for name in backends if name != "hora"]
    lines = [
        f"## {info['hosts']} hosts x {info['slots']} ranks, links {rate or 'unshaped'}"
        + (f" (B = {link:.3f} GB/s; tc {' '.join(info['tbf'])})" if link else "")
        + f"; TCP {info['congestion']}; load {info['loadavg_before']:.2f} -> {info['loadavg_after']:.2f}; "
        f"CPUs {100 * info['cpu_busy_share']:.0f}% busy over the run's {info['wall_s']:.0f} s"
    ]
    if rate:
        lines.append(f"# tbf: {qdisc['sent'] / 1e6:.0f} MB sent, {qdisc['dropped']} packets dropped, "
                     f"{qdisc['overlimits']} held back")  # fmt: skip
    for name, why in document.get("skipped", {}).items():
        lines.append(f"# {name}: {why.splitlines()[0]}")
    if peers:
        lines.append("# ratio = hora's time / that peer's (< 1: hora is faster); best = hora's time / the fastest "
                     "peer's; bound = the link bound's time / hora's")  # fmt: skip
    head = f"# {'collective':<13} {'size':>9} {'iters':>5} {'time':>10} {'busbw GB/s':>10} {'bound':>6}"
    head += "".join(f" | {name:>13} {'busbw':>6} {'ratio':>6}" for name in peers)
    lines.append(head + (f" | {'best':>6} {'(peer)':<14} #wrong" if peers else "  link bound  #wrong"))
    rows = {name: {(r["collective"], r["requested_bytes"]): r for r in backends[name]["results"]} for name in peers}
    for row in backends["hora"]["results"]:
        ratio = f"{bound_ratio(row, info['hosts'], link):6.3f}" if link else f"{'-':>6}"
        wrong = "-" if row["wrong"] is None else row["wrong"]
        line = (f"  {row['collective']:<13} {_size(row['bytes']):>9} {row['iters']:>5} {_time(row['time_s']):>10} "
                f"{row['busbw_gbps']:>10.3f} {ratio}")  # fmt: skip
        times = {}
        wrongs = [row["wrong"]]
        for name in peers:
            theirs = rows[name].get((row["collective"], row["requested_bytes"]))
            if theirs is None:
                line += f" | {'n/a':>13} {'-':>6} {'-':>6}"
                continue
            times[name] = theirs["time_s"]
            wrongs.append(theirs["wrong"])
            line += f" | {_time(theirs['time_s']):>13} {theirs['busbw_gbps']:>6.3f} {row['time_s'] / theirs['time_s']:>5.2f}x"
        if peers:
            best = min(times, key=lambda name: times[name]) if times else None
            line += f" | {row['time_s'] / times[best]:>5.2f}x {f'({best})':<14}" if best else f" | {'-':>6} {'':<14}"
            # the most wrong elements of any backend (- without the check)
            line += f" {'-' if wrongs[0] is None else max(w or 0 for w in wrongs)}"
        else:
            line += f"  {BOUND[row['collective']]} (N = {hosts})  {wrong}"
        lines.append(line)
    return lines


def ratios(document: dict[str, Any]) -> dict[str, dict[str, float]]:
    """hora's time over each peer's, per ``collective/bytes`` (what --json readers usually want)."""
    backends = document["backends"]
    hora = {(r["collective"], r["requested_bytes"]): r["time_s"] for r in backends["hora"]["results"]}
    found: dict[str, dict[str, float]] = {}
    for name, rep in backends.items():
        if name == "hora":
            continue
        for row in rep["results"]:
            key = (row["collective"], row["requested_bytes"])
            if key in hora:
                found.setdefault(f"{key[0]}/{key[1]}", {})[name] = hora[key] / row["time_s"]
    return found


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="2,3,4", help="host counts, comma-separated (default 2,3,4)")
    parser.add_argument("--rate", default="1gbit", help="link rates as tc takes them, or none; comma-separated")
    parser.add_argument("--congestion", default="cubic,reno",
                        help="TCP congestion control on the hosts: the first the kernel accepts (default cubic,reno); "
                        "system: the machine's own")  # fmt: skip
    parser.add_argument("--slots", type=int, choices=(1, 2), default=1, help="ranks per host (default 1)")
    parser.add_argument("--collective", default=",".join(COLLECTIVES), help=f"some of {','.join(COLLECTIVES)}")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"hora-bench's --sizes (default {DEFAULT_SIZES})")
    parser.add_argument("-n", "--iters", type=int, default=0, help="timed iterations per size (default: hora-bench's)")
    parser.add_argument("-w", "--warmup", type=int, default=2, help="untimed iterations per size (default 2)")
    parser.add_argument("--max-time", type=float, default=5.0, help="seconds of timed iterations per size (default 5)")
    parser.add_argument("--check", action="store_true",
                        help="run hora-bench's check of each size first (slows the timed 256 MiB runs here, see the "
                        "module docstring)")  # fmt: skip
    parser.add_argument("--peers", help="also run hora-bench's peers on the same hosts: all, or some of "
                        "torch-gloo,mpi4py,horovod-gloo,horovod-mpi (horovod = both)")  # fmt: skip
    parser.add_argument("--horovod-python", help="the interpreter that has Horovod (horovodrun next to it)")
    parser.add_argument("--runs", type=int, default=1,
                        help="run every backend this many times, alternating; per size the median (default 1)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one backend's run may take")
    parser.add_argument("--json", help="write every run's hora-bench document, with the cluster and the machine")
    parser.add_argument("--plot", metavar="PREFIX",
                        help="draw each run's time and busbw against size, every backend (hora-bench --plot): "
                             "PREFIX-<hosts>x<slots>-<rate>.png (needs matplotlib)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        counts = [int(word) for word in args.hosts.split(",")]
        rates = [None if word.strip().lower() == "none" else word.strip() for word in args.rate.split(",")]
        for rate in rates:
            if rate is not None:
                parse_rate(rate)
        unknown = set(args.collective.split(",")) - set(COLLECTIVES)
        if unknown or any(count < 2 for count in counts):
            raise ValueError(f"expected --hosts of at least 2 and --collective among {','.join(COLLECTIVES)}")
        if args.plot:
            plot.require()
    except (ValueError, plot.PlotUnavailable) as exc:
        print(f"cluster.py: {exc}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("cluster.py: network-namespace hosts need root", file=sys.stderr)
        return 2
    ensure_system()
    facts = machine()
    print(f"# machine: {facts['cpus']} CPUs ({facts['cpu_model']}), kernel {facts['kernel']}, "
          f"Python {facts['python']}, memcpy {facts['memcpy_gbps']:.1f} GB/s (64 MiB), "
          f"load {facts['loadavg'][0]:.2f}")  # fmt: skip
    documents = []
    with tempfile.TemporaryDirectory(prefix="hora-cluster-") as directory:
        for rate in rates:
            for count in counts:
                document = run_one(count, rate, args, directory)
                document["cluster"]["ratios"] = ratios(document)
                documents.append(document)
                print("\n".join(table(document)), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"created": datetime.datetime.now(datetime.timezone.utc).isoformat(), "machine": facts,
                       "command": sys.argv, "runs": documents}, handle, indent=1)  # fmt: skip
        print(f"# results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
