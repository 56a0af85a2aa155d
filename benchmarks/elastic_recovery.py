"""Elastic recovery: how fast hora and Horovod (gloo elastic) recover, side by side.

One elastic job per framework and run, on this machine, with the same training script
(this file with ``--worker hora|horovod``: a small torch MLP on a fixed synthetic batch
per rank, ``TorchState`` committed after every step, rank 0 logging each completed step
as ``time.time() step size``). The hosts are names of this machine that both launchers
treat as separate local hosts (``localhost``, ``127.0.0.1``, the host name, a local
address), listed by a discovery script that prints a file this benchmark rewrites:

1. the job starts with ``-np 3 --min-np 2 --max-np 3`` on hosts A, B, C (one slot each)
   and trains until ``--warmup`` seconds of steps at size 3 are logged;
2. the worker that holds rank 2 (``--kill-rank``; horarun and horovodrun order the hosts
   differently) is killed with SIGKILL at ``t_kill``; its host is blacklisted;
   **death -> first step** is the time from ``t_kill`` to the first step rank 0 logs at
   the smaller size;
3. after ``--settle`` seconds at size 2 the discovery script starts listing a fresh host
   D (the killed worker's host stays listed, blacklisted) at ``t_return``; **return ->
   full size** is the time from ``t_return`` to the first step logged at size 3 again.
   It includes up to a second of discovery polling (both launchers run the script once
   a second) and the new worker's start: Python, ``import torch``, building the model
   and optimizer (torch's optimizers import ``torch._dynamo``, seconds on this kind of
   machine), the same script in both frameworks;
4. after a few more steps a stop file makes every rank leave the training loop
   together (one small allreduce per step, in both frameworks) and the job ends.

Under each run a line breaks the times down from every rank's ``events.log`` (see
``worker``): when the survivors' reset callbacks ran, and when the new worker started,
imported, finished ``hvd.init()``, built its model and entered training. The table
also gives return -> full size less the new worker's own start-up (its process start
to its model built), which leaves what the launcher and the framework add.

A step counts as completed once ``state.commit()`` returned. hora runs under ``horarun``,
Horovod (when ``--horovod-python`` names a Python that has it) under ``horovodrun
--gloo --network-interface lo`` with the same flags. Runs alternate hora, Horovod, hora,
...; the table gives the medians and hora's time over Horovod's (below 1: hora recovers
faster; the project's goal is at most 0.5). Every process a run starts is stopped at
its end, also when it fails or passes ``--run-timeout``.

    python benchmarks/elastic_recovery.py --runs 3 --horovod-python ~/hvd-venv/bin/python
    python benchmarks/elastic_recovery.py --runs 1 --json elastic.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "HORA_ELASTIC_RECOVERY_RUN"  # every process a run starts inherits it: how cleanup finds them
NAMES = {"hora": "hora (horarun)", "horovod": "Horovod 0.28.1 (gloo elastic)"}


# ----- the training script, run by both frameworks -----


def worker(framework: str, args: argparse.Namespace) -> None:
    """One rank: trains until the stop file appears; rank 0 logs every completed step.

    Every rank also appends ``time host pid event`` lines to ``events.log``: ``start``
    (the process runs), ``imported`` (torch and the framework), ``init`` (``hvd.init()``
    returned), ``built`` (model, optimizer and state built: torch's optimizers import
    ``torch._dynamo`` on first use, seconds), ``reset`` (a reset callback ran: the rank
    is in a new world), ``synced`` (the training function starts, after the state's
    synchronization) and, for the first step of each start, ``backward``,
    ``optimizer-step`` (gradients averaged) and ``committed``.
    """
    started = time.time()
    run_dir = Path(args.run_dir)
    host = os.environ.get("HOROVOD_HOSTNAME", socket.gethostname())
    events = open(run_dir / "events.log", "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the process

    def event(name: str, when: float | None = None) -> None:
        events.write(f"{when or time.time():.6f} {host} {os.getpid()} {name}\n")

    event("start", started)
    import torch
    import torch.nn.functional as F

    if framework == "hora":
        import hora.torch as hvd
    else:
        import horovod.torch as hvd  # type: ignore[no-redef]

    event("imported")
    (run_dir / "pids").mkdir(exist_ok=True)
    (run_dir / "pids" / f"{host}.tmp").write_text(str(os.getpid()))
    os.replace(run_dir / "pids" / f"{host}.tmp", run_dir / "pids" / host)

    hvd.init()
    event(f"init rank={hvd.rank()} size={hvd.size()}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.features, args.hidden), torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, 10),
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    generator = torch.Generator().manual_seed(int(os.environ.get("HOROVOD_RANK", "0")))
    data = torch.randn(args.batch_size, args.features, generator=generator)
    target = torch.randint(0, 10, (args.batch_size,), generator=generator)
    stop_path = run_dir / "stop"
    log = open(run_dir / "steps.log", "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the process

    def on_reset() -> None:
        event(f"reset rank={hvd.rank()} size={hvd.size()}")
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, step=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        event("synced")  # the state was synchronized (or the sync skipped): training (re)starts
        first = True
        while True:
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            if first:
                event("backward")
            optimizer.step()
            if first:
                event("optimizer-step")
            stop = hvd.allreduce(torch.tensor([float(stop_path.exists())]), op=hvd.Sum, name="stop")
            state.step += 1
            state.commit()
            if first:
                event("committed")
                first = False
            if hvd.rank() == 0:
                log.write(f"{time.time():.6f} {state.step} {hvd.size()}\n")
            if stop.item() > 0:
                return

    event("built")  # the model, optimizer and state exist; train() synchronizes the state first
    train(state)
    log.close()
    hvd.shutdown()
    event("end")
    events.close()


# ----- one job -----


@dataclass
class Run:
    """What one job measured; times in seconds, None when the phase did not happen."""

    framework: str
    death_to_step: float | None = None
    return_to_full: float | None = None
    # return_to_full less the new worker's own start-up (its start to its model built: Python, torch, the script)
    return_less_startup: float | None = None
    step_time_full: float | None = None  # median time between logged steps at full size, before the kill
    steps_rolled_back: int | None = None  # last step finished at full size minus the step recovered at
    killed_host: str | None = None
    phases: dict[str, float] = field(default_factory=dict)  # events.log milestones, seconds after the kill/return
    exit_code: int | None = None
    error: str | None = None
    log_tail: list[str] = field(default_factory=list)


def local_hosts() -> list[str]:
    """Four names of this machine that horarun and horovodrun each take for a separate local host."""
    names = ["localhost", "127.0.0.1", socket.gethostname()]
    address = None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("192.0.2.123", 9))  # routes only; sends nothing
            address = sock.getsockname()[0]
    except OSError:
        pass
    if address and not address.startswith("127."):
        names.append(address)
    return list(dict.fromkeys(names))


def _steps(path: Path) -> list[tuple[float, int, int]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    steps = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3:
            try:
                steps.append((float(parts[0]), int(parts[1]), int(parts[2])))
            except ValueError:
                continue
    return steps


def _events(path: Path) -> list[tuple[float, str, str]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    found = []
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4:
            try:
                found.append((float(parts[0]), parts[1], parts[3]))
            except ValueError:
                continue
    return sorted(found)


def _phases(events: list[tuple[float, str, str]], t_kill: float, t_return: float | None, d: str) -> dict[str, float]:
    """Milestones of the recovery: when the survivors' resets ran and the new worker started."""
    phases: dict[str, float] = {}
    end = t_return or float("inf")
    resets = [t for t, _, name in events if t_kill < t < end and name.startswith("reset")]
    if resets:
        phases["kill->last survivor reset"] = max(resets) - t_kill
    if t_return is not None:
        for label in ("start", "imported", "init", "built", "synced"):
            times = [t for t, host, name in events if t > t_return and host == d and name.startswith(label)]
            if times:
                phases[f"return->new worker {label}"] = times[0] - t_return
        survivors = [(t, name) for t, host, name in events if t > t_return and host != d]
        resets = [t for t, name in survivors if name.startswith("reset") and name.endswith("size=3")]
        if resets:
            phases["return->last survivor reset"] = max(resets) - t_return
    return phases


def _our_processes(marker: str) -> list[int]:
    """The processes (other than this one) whose environment holds ``MARKER=marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _stop_everything(launcher: subprocess.Popen[bytes], marker: str) -> None:
    """SIGTERM the launcher (it stops its workers), then SIGKILL whatever this run started."""
    if launcher.poll() is None:
        try:
            os.killpg(launcher.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            launcher.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    for _ in range(3):
        pids = _our_processes(marker)
        if launcher.poll() is None:
            pids.append(launcher.pid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    try:
        launcher.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _wait_for(predicate, timeout: float, what: str, launcher: subprocess.Popen[bytes]):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if launcher.poll() is not None:
            raise RuntimeError(f"the launcher exited ({launcher.returncode}) while waiting for {what}")
        time.sleep(0.02)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def run_job(framework: str, args: argparse.Namespace, hosts: list[str]) -> Run:
    """Starts one elastic job, kills a worker, brings a fresh host, stops the job."""
    result = Run(framework)
    a, b, c, d = hosts[:4]
    marker = os.urandom(8).hex()
    with tempfile.TemporaryDirectory(prefix=f"elastic-{framework}-") as tmp:
        run_dir = Path(tmp)
        hosts_file = run_dir / "hosts.txt"

        def list_hosts(names: list[str]) -> None:
            (run_dir / "hosts.tmp").write_text("".join(f"{name}:1\n" for name in names))
            os.replace(run_dir / "hosts.tmp", hosts_file)

        list_hosts([a, b, c])
        script = run_dir / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {shlex.quote(str(hosts_file))}\n")
        script.chmod(0o755)
        steps_log = run_dir / "steps.log"
        worker_args = [
            "--run-dir", str(run_dir), "--features", str(args.features), "--hidden", str(args.hidden),
            "--batch-size", str(args.batch_size),
        ]  # fmt: skip
        elastic = ["-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{MARKER: marker})
        for name in [n for n in env if n.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMI_"))]:
            del env[name]
        env[MARKER] = marker
        if framework == "hora":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
            command = [sys.executable, "-m", "hora.runner", *elastic, sys.executable, __file__, "--worker", "hora"]
        else:
            horovodrun = str(Path(args.horovod_python).with_name("horovodrun"))
            command = [
                horovodrun, *elastic, "--gloo", "--network-interface", "lo",
                args.horovod_python, __file__, "--worker", "horovod",
            ]  # fmt: skip
            env["HOROVOD_GLOO_IFACE"] = "lo"
            env.update(item.split("=", 1) for item in args.horovod_env)
        command += worker_args
        output = open(run_dir / "launcher.out", "wb")  # noqa: SIM115 - closed below
        launcher = subprocess.Popen(
            command, env=env, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, cwd=run_dir,
        )  # fmt: skip
        started = time.monotonic()
        try:

            def remaining(limit: float) -> float:
                return max(1.0, min(limit, args.run_timeout - (time.monotonic() - started)))

            # 1. warm up at full size
            def warm() -> bool:
                full = [s for s in _steps(steps_log) if s[2] == 3]
                return len(full) >= 5 and full[-1][0] - full[0][0] >= args.warmup

            _wait_for(warm, remaining(args.run_timeout), "the job to train at size 3", launcher)
            # the worker that holds rank --kill-rank (the launchers order the hosts differently)
            inits = [(host, name) for _, host, name in _events(run_dir / "events.log") if name.startswith("init")]
            victim_host = next((host for host, name in inits if name == f"init rank={args.kill_rank} size=3"), None)
            if victim_host is None:
                raise RuntimeError(f"no worker logged rank {args.kill_rank} at size 3: {inits}")
            victim = int((run_dir / "pids" / victim_host).read_text())
            result.killed_host = victim_host
            before = _steps(steps_log)
            # 2. kill it
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            full = [s for s in before if s[2] == 3][-50:]
            if len(full) > 1:
                result.step_time_full = statistics.median(y[0] - x[0] for x, y in zip(full, full[1:]))

            def recovered() -> tuple[float, int, int] | None:
                return next((s for s in _steps(steps_log) if s[0] > t_kill and s[2] == 2), None)

            first = _wait_for(recovered, remaining(120), "the first step after the kill", launcher)
            result.phases = _phases(_events(run_dir / "events.log"), t_kill, None, d)
            result.death_to_step = first[0] - t_kill
            # The last step finished at size 3 (one may still finish after the kill: the victim
            # had already sent its share) against the step the survivors resumed from.
            last_full = [s for s in _steps(steps_log) if s[2] == 3 and s[0] < first[0]]
            result.steps_rolled_back = last_full[-1][1] - (first[1] - 1)
            # 3. after a while at size 2, a fresh host D appears
            _wait_for(lambda: time.time() - first[0] >= args.settle, remaining(120), "steps at size 2", launcher)
            t_return = time.time()
            list_hosts([a, b, c, d])

            def regrown() -> tuple[float, int, int] | None:
                return next((s for s in _steps(steps_log) if s[0] > t_return and s[2] == 3), None)

            full_again = _wait_for(regrown, remaining(120), "the first step at size 3 after the return", launcher)
            result.return_to_full = full_again[0] - t_return
            result.phases = _phases(_events(run_dir / "events.log"), t_kill, t_return, d)
            start, built = result.phases.get("return->new worker start"), result.phases.get("return->new worker built")
            if start is not None and built is not None:
                result.return_less_startup = result.return_to_full - (built - start)
            # 4. a few more steps, then stop together
            _wait_for(lambda: time.time() - full_again[0] >= 1.0, remaining(30), "steps after the return", launcher)
            (run_dir / "stop").touch()
            result.exit_code = launcher.wait(timeout=remaining(30))
            if result.exit_code != 0:
                result.error = f"the launcher exited {result.exit_code} after the stop"
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            result.error = str(exc)
        finally:
            _stop_everything(launcher, marker)
            output.close()
            if result.exit_code is None:
                result.exit_code = launcher.returncode
            if result.error or args.verbose:
                text = (run_dir / "launcher.out").read_bytes().decode("utf-8", "replace")
                result.log_tail = text.splitlines()[-args.tail :]
            if args.keep_logs:
                keep = Path(args.keep_logs) / f"{framework}-{datetime.datetime.now():%H%M%S}"
                keep.mkdir(parents=True, exist_ok=True)
                for name in ("launcher.out", "steps.log", "events.log", "hosts.txt"):
                    if (run_dir / name).exists():
                        (keep / name).write_bytes((run_dir / name).read_bytes())
    return result


# ----- the comparison -----


def _horovod_problem(python: str | None) -> str | None:
    if not python:
        return "no --horovod-python given"
    if not Path(python).with_name("horovodrun").exists():
        return f"no horovodrun next to {python}"
    probe = subprocess.run(
        [python, "-c", "import horovod.torch as hvd, horovod; print(horovod.__version__, hvd.gloo_built())"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if probe.returncode:
        return f"{python} cannot import horovod.torch: {probe.stderr.strip().splitlines()[-1:]}"
    version, gloo = probe.stdout.split()
    if gloo != "True":
        return f"Horovod {version} at {python} was built without gloo"
    return None


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _seconds(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="jobs per framework, alternating")
    parser.add_argument("--horovod-python", help="a Python with Horovod (gloo) installed, to run it too")
    parser.add_argument("--horovod-env", metavar="NAME=VALUE", action="append", default=[],
                        help="an extra variable for Horovod's job, e.g. HOROVOD_GLOO_TIMEOUT_SECONDS=5 (default 30)")
    parser.add_argument("--hosts", help="four comma-separated local host names A,B,C,D (default: found)")
    parser.add_argument("--kill-rank", type=int, default=2, choices=[0, 1, 2], help="the rank whose worker is killed")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of steps at size 3 before the kill")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds at size 2 before the fresh host")
    parser.add_argument("--run-timeout", type=float, default=240.0, help="seconds one job may take in all")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--json", metavar="FILE", help="also write the runs and medians as JSON")
    parser.add_argument("--keep-logs", metavar="DIR", help="keep each job's launcher output and step log here")
    parser.add_argument("--verbose", action="store_true", help="print the end of each launcher's output")
    parser.add_argument("--tail", type=int, default=40, help="lines of launcher output shown for a failed job")
    parser.add_argument("--worker", choices=["hora", "horovod"], help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        return

    sys.path.insert(0, str(ROOT / "src"))
    from hora.bench.report import machine

    hosts = args.hosts.split(",") if args.hosts else local_hosts()
    if len(hosts) < 4:
        raise SystemExit(f"need four names of this machine for hosts A-D, found {hosts}: pass --hosts")
    facts = machine()
    print("# machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    print(f"# hosts: {hosts[0]}, {hosts[1]}, {hosts[2]} at the start, one slot each; the worker of rank "
          f"{args.kill_rank} is killed; {hosts[3]} is the fresh host that comes")  # fmt: skip
    if args.horovod_env:
        print(f"# Horovod's job also gets {' '.join(args.horovod_env)}")
    frameworks = ["hora"]
    problem = _horovod_problem(args.horovod_python)
    if problem:
        print(f"# Horovod skipped: {problem}")
    else:
        frameworks.append("horovod")
    print(f"# MLP {args.features}-{args.hidden}-{args.hidden}-10, batch {args.batch_size} per rank, commit every "
          f"step; -np 3 --min-np 2 --max-np 3; {args.runs} run(s) each, alternating", flush=True)  # fmt: skip
    runs: dict[str, list[Run]] = {f: [] for f in frameworks}
    for number in range(args.runs):
        for framework in frameworks:
            run = run_job(framework, args, hosts)
            runs[framework].append(run)
            step_ms = None if run.step_time_full is None else run.step_time_full * 1e3
            line = (
                f"run {number + 1}: {framework:8s} death->step {_seconds(run.death_to_step)} s, "
                f"return->full {_seconds(run.return_to_full)} s, step {_seconds(step_ms, 1)} ms, "
                f"rolled back {run.steps_rolled_back if run.steps_rolled_back is not None else '-'} step(s), "
                f"killed rank {args.kill_rank} on {run.killed_host or '-'}, exit {run.exit_code}"
            )  # fmt: skip
            print(line + (f"; FAILED: {run.error}" if run.error else ""), flush=True)
            if run.phases:
                print("    " + ", ".join(f"{k} {v:.2f} s" for k, v in run.phases.items()), flush=True)
            if run.log_tail:
                print("\n".join(f"    | {text}" for text in run.log_tail), flush=True)

    keys = ("death_to_step", "return_to_full", "return_less_startup", "step_time_full")
    medians = {f: {key: _median([getattr(r, key) for r in rs]) for key in keys} for f, rs in runs.items()}
    print()
    print(f"median of {args.runs} run(s); seconds (wall clock, time.time() in every process). The third column is")
    print("the second less the new worker's own start-up (process start to model built: Python, torch, the script).")
    print("| framework | death -> first step (s) | return -> full size (s) | same, less new worker start-up (s) "
          "| step at size 3 (ms) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for f in frameworks:
        m = medians[f]
        step_ms = None if m["step_time_full"] is None else m["step_time_full"] * 1e3
        print(f"| {NAMES[f]} | {_seconds(m['death_to_step'])} | {_seconds(m['return_to_full'])} "
              f"| {_seconds(m['return_less_startup'])} | {_seconds(step_ms, 1)} |")  # fmt: skip
    ratios: dict[str, float | None] = {}
    if "horovod" in medians:
        for key in keys:
            h, o = medians["hora"][key], medians["horovod"][key]
            ratios[key] = None if h is None or not o else h / o
        print(f"| hora / Horovod | {_seconds(ratios['death_to_step'])} | {_seconds(ratios['return_to_full'])} "
              f"| {_seconds(ratios['return_less_startup'])} | {_seconds(ratios['step_time_full'])} |")  # fmt: skip
        verdict = [r for r in (ratios["death_to_step"], ratios["return_to_full"]) if r is not None]
        if verdict:
            print(f"goal (hora at most half Horovod's time, first two columns): "
                  f"{'met' if max(verdict) <= 0.5 else 'not met'} (worst ratio {max(verdict):.2f})")  # fmt: skip
    if args.json:
        document = {
            "schema": "hora-elastic-recovery/1",
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": [sys.executable, *sys.argv],
            "machine": facts,
            "hosts": hosts[:4],
            "runs": {f: [asdict(r) for r in rs] for f, rs in runs.items()},
            "medians": medians,
            "ratios": ratios,
            "skipped": {"horovod": problem} if problem else {},
        }
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.json}")
    if any(r.error for rs in runs.values() for r in rs):
        sys.exit(1)


if __name__ == "__main__":
    main()
