"""Starting the ranks of one backend's run and collecting rank 0's results.

hora's ranks start through horarun's own machinery (``hora.runner.job.Job``), each
running ``python -m hora.bench.worker``. Peers start through their own launchers (see
``hora.bench.peers``), as groups of processes this module watches: rank 0's stdout (its
live table) is forwarded with any ``[0]<stdout>:`` prefix removed, everything else goes
to a log file whose tail is shown when a run fails. When one process fails or the timeout
passes, every process of the run is stopped (SIGTERM to its process group, then SIGKILL).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from hora.runner.job import Job
from hora.runner.launch import prepare
from hora.runner.output import Sink
from hora.runner.settings import LaunchSettings
from hora.runner.summary import failure_lines

_PREFIX = re.compile(rb"^\[(\d+)(?:,(\d+))?\]<stdout>:")
_TAG = re.compile(rb"\[\d+(?:,\d+)?\]<stdout>:")
_POLL = 0.05
_SETTLE = 2.0  # seconds the other processes get to exit by themselves after one failed
_GRACE = 5.0  # seconds between SIGTERM and SIGKILL
TAIL = 20  # log lines shown when a run fails


class BenchError(RuntimeError):
    """A backend's run failed; the message says which, how, and the end of its output."""


class _RankZeroSink(Sink):
    """Forwards rank 0's stdout lines without their ``[0]<stdout>:`` prefix."""

    def write(self, data: bytes) -> None:
        super().write(re.sub(rb"(?m)^\[0\]<stdout>:", b"", data))


def run_hora(
    num_proc: int, worker_args: Sequence[str], out_path: str, env: Mapping[str, str], timeout: float | None,
    hosts: str | None = None, ssh_port: int | None = None, ssh_identity_file: str | None = None,
    network_interfaces: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Runs ``python -m hora.bench.worker --backend hora ...`` on ``num_proc`` ranks.

    The ranks go where ``horarun -np num_proc -H hosts`` would put them (this machine
    without ``hosts``), started by the same machinery, over ssh as horarun reaches hosts.

    Args:
        num_proc: the number of ranks.
        worker_args: the worker's arguments after ``--backend hora`` (plan, out, live).
        out_path: where rank 0 writes its results.
        env: variables added to every rank's environment.
        timeout: seconds after which the job is stopped; None waits forever.
        hosts: horarun's ``-H/--hosts`` value, or None.
        ssh_port: horarun's ``-p/--ssh-port``, or None.
        ssh_identity_file: horarun's ``-i/--ssh-identity-file``, or None.
        network_interfaces: horarun's ``--network-interfaces``, or None.

    Returns:
        Rank 0's results.

    Raises:
        BenchError: a rank failed or the timeout passed (the summary names the rank first).
    """
    settings = LaunchSettings(
        command=(sys.executable, "-m", "hora.bench.worker", "--backend", "hora", *worker_args),
        num_proc=num_proc,
        hosts=hosts,
        env=env,
        ssh_port=ssh_port,
        ssh_identity_file=ssh_identity_file,
        network_interfaces=network_interfaces,
    )
    slots = prepare(settings)
    result = Job(settings, slots, _RankZeroSink(sys.stdout), Sink(sys.stderr), os.environ).run(
        timeout=timeout, handle_signals=threading.current_thread() is threading.main_thread()
    )
    if result.exit_code != 0:
        lines = [line.removeprefix("horarun: ") for line in failure_lines(result)]
        if result.timed_out:
            lines.insert(0, f"the run did not finish within {timeout:g} s (--timeout)")
        raise BenchError("hora's ranks failed:\n" + "\n".join(lines))
    return read_result(out_path, "hora")


def read_result(path: str, name: str) -> dict[str, Any]:
    """Reads rank 0's results of backend ``name``."""
    try:
        with open(path, encoding="utf-8") as handle:
            data: dict[str, Any] = json.load(handle)
            return data
    except (OSError, ValueError) as exc:
        raise BenchError(f"{name}: rank 0 exited 0 but wrote no readable results to {path}: {exc}") from None


def _forward(pipe: IO[bytes], log: IO[bytes], lock: threading.Lock) -> None:
    """Copies rank 0's stdout lines to our stdout (without launcher tags) and every line to the log."""
    for line in iter(pipe.readline, b""):
        match = _PREFIX.match(line)
        rank = 0 if match is None else int(match.group(2) or match.group(1))
        with lock:
            log.write(line)
            log.flush()
        if rank == 0:
            # mpirun --tag-output tags every write, so a tag may also sit inside a line.
            sys.stdout.buffer.write(_TAG.sub(b"", line))
            sys.stdout.flush()
    pipe.close()


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc (empty where /proc is missing)."""
    tree: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return tree
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def _tree(roots: Sequence[int]) -> list[int]:
    """``roots`` and all their descendants: a launcher such as horovodrun starts mpirun in a
    session of its own, so signalling the process groups we created can leave ranks behind."""
    children = _children()
    found: list[int] = []
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.append(pid)
            todo.extend(children.get(pid, []))
    return found


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] != b"Z"


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to every process we started and its descendants, SIGKILL after ``_GRACE`` seconds."""
    pids = _tree([p.pid for p in procs if p.poll() is None])
    for sig, wait in ((signal.SIGTERM, _GRACE), (signal.SIGKILL, 10.0)):
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and (any(p.poll() is None for p in procs) or any(map(_alive, pids))):
            time.sleep(_POLL)
        pids = [pid for pid in pids if _alive(pid)]
        if not pids and all(p.poll() is not None for p in procs):
            return


def run_processes(
    name: str,
    commands: Sequence[tuple[Sequence[str], Mapping[str, str]]],
    log_path: str,
    timeout: float | None,
) -> None:
    """Runs a peer's processes (each in its own session) until all exit 0.

    Args:
        name: the peer, for messages.
        commands: each process's argv and complete environment; the first one's
            stdout is forwarded (after prefix removal, rank 0's lines only).
        log_path: every process's stdout and stderr go here.
        timeout: seconds after which every process is stopped; None waits forever.

    Raises:
        BenchError: a process could not start, exited non-zero, or the timeout passed;
            the message ends with the log's last lines.
    """
    lock = threading.Lock()
    with open(log_path, "ab") as log:
        procs: list[subprocess.Popen[bytes]] = []
        programs = [os.path.basename(argv[0]) for argv, _ in commands]
        threads = []
        failure = None
        try:
            for argv, env in commands:
                proc = subprocess.Popen(
                    list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=log, start_new_session=True,
                )  # fmt: skip
                procs.append(proc)
                assert proc.stdout is not None  # stdout=PIPE
                thread = threading.Thread(target=_forward, args=(proc.stdout, log, lock), daemon=True)
                thread.start()
                threads.append(thread)
            deadline = None if timeout is None else time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed:
                    failure = _exited(name, failed[0], programs[failed[0]], procs[failed[0]].returncode)
                    settle = time.monotonic() + _SETTLE
                    while any(p.poll() is None for p in procs) and time.monotonic() < settle:
                        time.sleep(_POLL)
                    break
                if deadline is not None and time.monotonic() > deadline:
                    failure = f"{name}: did not finish within {timeout:g} s (--timeout); stopped"
                    break
                time.sleep(_POLL)
            if failure is None:
                bad = [i for i, p in enumerate(procs) if p.returncode != 0]
                if bad:
                    failure = _exited(name, bad[0], programs[bad[0]], procs[bad[0]].returncode)
        except OSError as exc:
            failure = f"{name}: could not start {exc.filename or ''}: {exc.strerror or exc}"
        finally:
            _stop(procs)
            for thread in threads:
                thread.join(2.0)
    if failure is not None:
        raise BenchError(f"{failure}\n{_tail(log_path)}")


def _exited(name: str, index: int, program: str, code: int | None) -> str:
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return f"{name}: process {index} ({program}) {how}"


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            lines = handle.read().decode("utf-8", errors="replace").splitlines()[-TAIL:]
    except OSError:
        return ""
    return f"last lines of {path}:\n" + "\n".join(f"  {line}" for line in lines)
