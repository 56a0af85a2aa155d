"""``horarun doctor -H host1,host2,...``: is this cluster ready for a hora job, and if not, why?

Horovod leaves diagnosing a cluster's network to its users; ``horarun doctor`` does it
for them, in the order a job would meet the problems:

1. **ssh**: every host is reached the way ``horarun`` reaches it (same options, no
   prompt) and runs ``hora.runner.remote --probe``: a host that is down, has no sshd,
   refuses the key or lacks the Python path is named with the fix.
2. **versions and clocks**: every host runs the same Python and hora as this machine;
   a clock more than ``CLOCK_SKEW`` seconds off this machine's is reported.
3. **addresses**: on every host an agent (``hora.runner.doctor_agent``) picks the
   interface and address that host's ranks would bind and advertise
   (``--network-interfaces``, else the route toward this machine) and listens there. A
   loopback address on a multi-host job, or a missing interface, is reported.
4. **every pair**: each agent connects to every other (with the HMAC handshake ranks
   use) and measures the median round trip of small messages; then, one pair at a
   time, the bandwidth of a bulk transfer. A connection that times out is reported as
   a port a firewall drops, one that is refused as a port a firewall rejects or that
   nothing listens on.

The report lists the hosts, the latency and bandwidth matrix, then every problem in
plain words; the exit status is 0 when there is none and 1 otherwise (2 for a bad flag).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import platform
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hora.runner import hosts as hostlib
from hora.runner.arguments import Parser, number
from hora.runner.remote import probe_info
from hora.runner.ssh import HostInfo, SshSettings, parse_probe, probe, remote_python_command
from hora.transport import auth, netif
from hora.version import __version__

CLOCK_SKEW = 1.0  # seconds
AGENT_MODULE = "hora.runner.doctor_agent"


@dataclasses.dataclass
class HostCheck:
    """What the doctor found about one host.

    Attributes:
        host: as the user named it.
        local: it is this machine.
        info: the probe's findings, or None when the host could not be probed.
        error: why the probe failed (one line), or None.
        address, interface, port: where its agent listens (what its ranks would use).
        setup_error: why the agent could not listen, or None.
        clock_offset: its clock minus this machine's, seconds (measured through its
            agent, the fastest of a few round trips), or None.
    """

    host: str
    local: bool
    info: HostInfo | None = None
    error: str | None = None
    address: str | None = None
    interface: str | None = None
    port: int | None = None
    setup_error: str | None = None
    clock_offset: float | None = None


@dataclasses.dataclass
class PairCheck:
    """One host connecting to another's agent."""

    source: str
    target: str
    ok: bool
    error: str | None = None
    latency_ms: float | None = None
    mb_per_s: float | None = None


class _AgentProcess:
    """An agent on one host, spoken to through its stdin and stdout (ssh's, for a remote host)."""

    def __init__(self, argv: list[str]) -> None:
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except (OSError, ValueError):
            return {"error": "the agent is gone"}
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return {"error": f"the agent did not answer within {timeout:g} s"}
            if line is None:
                stderr = self.process.stderr.read() if self.process.stderr is not None else ""
                last = stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
                return {"error": f"the agent exited: {last}"}
            try:
                reply = json.loads(line)
            except ValueError:
                continue
            if isinstance(reply, dict):
                return reply

    def close(self) -> None:
        try:
            if self.process.stdin is not None:
                self.process.stdin.write(json.dumps({"exit": True}) + "\n")
                self.process.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _local_info(host: str) -> HostInfo:
    started = time.time()
    data = probe_info()
    info = parse_probe(host, json.dumps(data), started, time.time())
    assert info is not None
    return info


def run_checks(
    host_names: Sequence[str],
    ssh: SshSettings,
    interfaces: Sequence[str],
    connect_timeout: float = 3.0,
    bandwidth_bytes: int = 8 << 20,
    is_local: Callable[[str], bool] = hostlib.is_local_host,
) -> tuple[list[HostCheck], list[PairCheck]]:
    """Runs every check on the hosts and returns what was found."""
    checks = [HostCheck(host, is_local(host)) for host in host_names]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(checks)))) as pool:
        found = list(pool.map(lambda c: _local_info(c.host) if c.local else probe(c.host, ssh), checks))
    for check, result in zip(checks, found):
        if isinstance(result, str):
            check.error = result
        else:
            check.info = result
    reachable = [check for check in checks if check.info is not None]
    remote_addresses = [
        c.info.launcher_address for c in reachable if not c.local and c.info and c.info.launcher_address
    ]
    secret = auth.new_secret().hex()
    agents: dict[str, _AgentProcess] = {}
    pairs: list[PairCheck] = []
    try:
        for check in reachable:
            argv = [sys.executable, "-m", AGENT_MODULE]
            if not check.local:
                argv = ssh.command(check.host, remote_python_command([], module=AGENT_MODULE))
            agents[check.host] = _AgentProcess(argv)
        for check in reachable:
            check.clock_offset = 0.0 if check.local else _clock_offset(agents[check.host])
        for check in reachable:
            assert check.info is not None
            if not check.local:
                toward = check.info.launcher_address or ""
            elif remote_addresses:
                toward = remote_addresses[0]  # this machine's ranks use the address the others reach it at
            else:
                toward = "127.0.0.1"  # only this machine: ranks would use loopback, and that is right
            reply = agents[check.host].ask(
                {"setup": {"secret": secret, "interfaces": list(interfaces), "toward": toward}}, 30.0
            )
            if "error" in reply:
                check.setup_error = str(reply["error"])
            else:
                check.address, check.port = str(reply["address"]), int(reply["port"])
                check.interface = None if reply.get("interface") is None else str(reply["interface"])
        ready = [c for c in reachable if c.address is not None]
        pairs = _connect_all(ready, agents, connect_timeout)
        if bandwidth_bytes > 0:
            for pair in pairs:
                if pair.ok:
                    target = next(c for c in ready if c.host == pair.target)
                    reply = agents[pair.source].ask(
                        {"bandwidth": [target.host, target.address, target.port], "bytes": bandwidth_bytes,
                         "timeout": max(10.0, connect_timeout)},  # fmt: skip
                        60.0,
                    )
                    if "mb_per_s" in reply:
                        pair.mb_per_s = float(reply["mb_per_s"])
    finally:
        for agent in agents.values():
            agent.close()
    return checks, pairs


def _clock_offset(agent: _AgentProcess, samples: int = 3) -> float | None:
    best: tuple[float, float] | None = None
    for _ in range(samples):
        before = time.time()
        reply = agent.ask({"clock": True}, 30.0)
        after = time.time()
        if "time" not in reply:
            return None
        sample = (after - before, float(reply["time"]) - (before + after) / 2)
        best = sample if best is None or sample[0] < best[0] else best
    return None if best is None else best[1]


def _connect_all(ready: list[HostCheck], agents: dict[str, _AgentProcess], timeout: float) -> list[PairCheck]:
    """Every agent connects to every other at once (connect and latency; bandwidth comes later)."""

    def from_one(source: HostCheck) -> list[PairCheck]:
        targets = [[c.host, c.address, c.port] for c in ready if c is not source]
        if not targets:
            return []
        reply = agents[source.host].ask(
            {"connect": targets, "timeout": timeout, "pings": 20}, timeout * len(targets) + 30.0
        )
        if "results" not in reply:
            return [PairCheck(source.host, str(t[0]), False, str(reply.get("error"))) for t in targets]
        return [
            PairCheck(source.host, str(r["host"]), bool(r.get("ok")), r.get("error"), r.get("latency_ms"))
            for r in reply["results"]
        ]

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(ready))) as pool:
        return [pair for pairs in pool.map(from_one, ready) for pair in pairs]


def find_problems(checks: Sequence[HostCheck], pairs: Sequence[PairCheck]) -> list[str]:
    """Every problem, in plain words, naming the host(s) and the fix."""
    problems: list[str] = []
    python = platform.python_version()
    multi = len(checks) > 1 and not all(check.local for check in checks)
    for check in checks:
        if check.error is not None:
            problems.append(check.error)
            continue
        info = check.info
        assert info is not None
        if info.hora != __version__ or info.python != python:
            problems.append(
                f"host {check.host}: runs Python {info.python} with hora {info.hora}, this machine Python {python} "
                f"with hora {__version__}: install the same versions on every host"
            )
        offset = check.clock_offset
        if offset is not None and abs(offset) > CLOCK_SKEW:
            ahead = "ahead of" if offset > 0 else "behind"
            problems.append(
                f"host {check.host}: its clock is {abs(offset):.1f} s {ahead} this machine's: run NTP "
                "(chrony or systemd-timesyncd) on every host, or logs and timelines will not line up"
            )
        if check.setup_error is not None:
            problems.append(f"host {check.host}: {check.setup_error} (fix --network-interfaces)")
        elif check.address is not None and multi and netif.is_loopback_address(check.address):
            problems.append(
                f"host {check.host}: its ranks would advertise the loopback address {check.address}, which no other "
                "host can reach: name the interface to use with --network-interfaces"
            )
    failed: dict[str, list[PairCheck]] = {}
    for pair in pairs:
        if not pair.ok:
            failed.setdefault(pair.target, []).append(pair)
    by_host = {check.host: check for check in checks}
    for target, bad in failed.items():
        check = by_host[target]
        sources = ", ".join(pair.source for pair in bad)
        errors = {pair.error or "failed" for pair in bad}
        where = f"{check.address}:{check.port}"
        if all("timed out" in error for error in errors):
            why = "the connections time out: a firewall on the host, or between the hosts, drops them"
        elif all("refused" in error for error in errors):
            why = "the connections are refused: a firewall rejects them"
        else:
            why = "; ".join(sorted(errors))
        problems.append(
            f"host {target}: cannot be reached on its rank port {where} from {sources}: {why}; open the TCP "
            "ports hora uses (any port above 1024 unless the ranks' range is fixed) between the hosts"
        )
    return problems


def render(checks: Sequence[HostCheck], pairs: Sequence[PairCheck], problems: Sequence[str]) -> list[str]:
    """The report's lines."""
    lines = [f"horarun doctor: {len(checks)} host{'s' if len(checks) != 1 else ''} (this machine: Python "
             f"{platform.python_version()}, hora {__version__})", "", "hosts:"]  # fmt: skip
    width = max(len(check.host) for check in checks) if checks else 4
    for check in checks:
        if check.info is None:
            lines.append(f"  {check.host:<{width}}  unreachable")
            continue
        info = check.info
        how = "this machine" if check.local else f"ssh ok ({info.round_trip:.1f} s)"
        clock = "clock ?" if check.clock_offset is None else f"clock {check.clock_offset:+.3f} s"
        uses = (
            f"uses {check.interface or '?'} {check.address}"
            if check.address
            else f"no address ({check.setup_error})"
        )
        lines.append(
            f"  {check.host:<{width}}  {how}, {info.hostname}, Python {info.python}, hora {info.hora}, "
            f"{clock}, {uses}"
        )
    ready = [check for check in checks if check.address is not None]
    if len(ready) > 1:
        lines += ["", "connections: latency ms / bandwidth MB/s (row connects to column):"]
        cell = max(14, width)
        lines.append("  " + " " * width + "".join(f"  {c.host:>{cell}}" for c in ready))
        found = {(pair.source, pair.target): pair for pair in pairs}
        for source in ready:
            row = []
            for target in ready:
                pair = found.get((source.host, target.host))
                if source is target:
                    text = "-"
                elif pair is None:
                    text = "?"
                elif not pair.ok:
                    text = "FAILED"
                else:
                    bandwidth = "-" if pair.mb_per_s is None else f"{pair.mb_per_s:.0f}"
                    text = f"{pair.latency_ms or 0:.2f} / {bandwidth}"
                row.append(f"  {text:>{cell}}")
            lines.append(f"  {source.host:<{width}}" + "".join(row))
    lines.append("")
    if problems:
        lines.append(f"{len(problems)} problem{'s' if len(problems) != 1 else ''}:")
        lines += [f"  - {problem}" for problem in problems]
    else:
        lines.append("no problems found: hora jobs can run on these hosts")
    return lines


def make_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="horarun doctor",
        description="Check that hora jobs can run on these hosts: ssh, versions, clocks, addresses, "
        "and a latency/bandwidth matrix of every pair.",
        allow_abbrev=False,
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("-H", "--hosts", metavar="HOSTS", help="hosts, e.g. host1,host2 (slots are ignored)")
    where.add_argument("-hostfile", "--hostfile", metavar="FILE", help="file with one 'host slots=N' per line")
    parser.add_argument("-p", "--ssh-port", metavar="PORT", type=number(int, 1, high=65535))
    parser.add_argument("-i", "--ssh-identity-file", metavar="FILE")
    parser.add_argument("--network-interfaces", "--network-interface", dest="network_interfaces", metavar="NICS")
    parser.add_argument(
        "--connect-timeout", metavar="SECONDS", type=number(float, 0, strict=True), default=3.0,
        help="seconds a connection between hosts may take (default 3)",
    )  # fmt: skip
    parser.add_argument(
        "--bandwidth-mb", metavar="MB", type=number(float, 0), default=8.0,
        help="MiB sent per pair to measure bandwidth (0: skip; default 8)",
    )  # fmt: skip
    return parser


def main(argv: Sequence[str]) -> int:
    """Runs ``horarun doctor``; returns 0 when no problem was found, 1 otherwise, 2 for bad flags."""
    parser = make_parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        specs = hostlib.parse_hosts(args.hosts) if args.hosts is not None else hostlib.parse_hostfile(args.hostfile)
        ssh = SshSettings.from_env(
            None if args.ssh_port is None else int(args.ssh_port), args.ssh_identity_file
        )
    except ValueError as exc:
        print(f"horarun doctor: error: {exc}", file=sys.stderr)
        return 2
    interfaces = netif.split_names(args.network_interfaces)
    checks, pairs = run_checks(
        [spec.name for spec in specs], ssh, interfaces, args.connect_timeout, int(args.bandwidth_mb * (1 << 20))
    )
    problems = find_problems(checks, pairs)
    print("\n".join(render(checks, pairs, problems)), flush=True)
    return 1 if problems else 0
