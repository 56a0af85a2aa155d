"""Runs a Python function on N fresh ranks, each a real process, for one test.

Every call starts its own rendezvous server and processes, so one test's failure
never affects the next. Ranks get the same environment ``horarun`` gives them. The
function is pickled by reference (test modules are importable in the ranks through
PYTHONPATH); its return value comes back through a file per rank.

With ``launcher="torchrun"`` the ranks get torchrun's variables instead (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) and
rank 0 runs the rendezvous, as under torchrun or a Kubernetes operator: nobody but the
test itself stops a rank, so a survivor that hangs shows as a timeout.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

from hora.transport.rendezvous_server import RendezvousServer
from hora.transport import auth

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int | None
    output: str
    value: Any = None
    error: str | None = None


class JobFailed(AssertionError):
    pass


def rank_env(rank: int, size: int, port: int, secret: bytes, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HORA_RANK=str(rank),
        HORA_SIZE=str(size),
        HORA_LOCAL_RANK=str(rank),
        HORA_LOCAL_SIZE=str(size),
        HORA_CROSS_RANK="0",
        HORA_CROSS_SIZE="1",
        HORA_RENDEZVOUS_ADDR="127.0.0.1",
        HORA_RENDEZVOUS_PORT=str(port),
        HORA_SECRET=secret.hex(),
        HORA_START_TIMEOUT="30",
        PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT / "src"), env.get("PYTHONPATH", "")]),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


def torchrun_env(rank: int, size: int, port: int, secret: bytes, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A rank's environment under torchrun-style variables (no hora launcher variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(size),
        HORA_SECRET=secret.hex(),
        HORA_START_TIMEOUT="30",
        PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    check: bool = True,
    during: Callable[[RendezvousServer], None] | None = None,
    hosts: list[str] | None = None,
    secret: bytes | None = None,
    launcher: str = "hora",
) -> list[Any] | list[RankResult]:
    """Runs ``fn(*args)`` on ``size`` ranks.

    Returns:
        With ``check``: each rank's return value, by rank (raising JobFailed, with
        every rank's output, when a rank fails or the timeout passes). Without:
        a RankResult per rank.

    ``during(server)``, when given, runs in the test process while the ranks run.
    ``hosts``, when given, names each rank's host (``HORA_HOSTNAME``) with local and
    cross ranks to match: ranks given different host names act as different hosts.
    ``secret`` fixes the job secret (by default a fresh one). ``launcher="torchrun"``
    starts the ranks with torchrun's variables (see above; ``during`` and ``hosts`` do
    not apply).
    """
    secret = secret or auth.new_secret()
    torchrun = launcher == "torchrun"
    server = None if torchrun else RendezvousServer(secret).start()
    port = free_port() if torchrun else 0
    workdir = Path(tempfile.mkdtemp(prefix="hora-test-"))
    (workdir / "payload").write_bytes(cloudpickle.dumps((fn, args)))
    procs = []
    try:
        for rank in range(size):
            if server is None:
                rank_environ = torchrun_env(rank, size, port, secret, env)
            else:
                rank_environ = rank_env(rank, size, server.port, secret, {**(env or {}), **_host_env(rank, hosts)})
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "rank_main", str(workdir)],
                    env=rank_environ,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        if during is not None and server is not None:
            during(server)
        deadline = time.monotonic() + timeout
        results = []
        timed_out = False
        for rank, proc in enumerate(procs):
            try:
                output, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                output += f"\n[harness] rank {rank} killed after the {timeout:g} s timeout"
            result = RankResult(rank, proc.returncode, output)
            value_file = workdir / f"result.{rank}"
            error_file = workdir / f"error.{rank}"
            if value_file.exists():
                result.value = cloudpickle.loads(value_file.read_bytes())
            if error_file.exists():
                result.error = error_file.read_text()
            results.append(result)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    if not check:
        return results
    if timed_out or any(r.returncode != 0 for r in results):
        report = "\n".join(
            f"--- rank {r.rank} (exit {r.returncode})\n{r.output}{r.error or ''}" for r in results
        )
        raise JobFailed(f"job of {size} ranks failed:\n{report}")
    return [r.value for r in results]


def freeze(seconds: float) -> None:
    """Stops this process (SIGSTOP); a helper continues it after ``seconds``, or kills it
    when ``seconds`` is negative (after the others are done)."""
    action = f"os.kill({os.getpid()}, signal.SIGCONT)" if seconds >= 0 else f"os.kill({os.getpid()}, signal.SIGKILL)"
    subprocess.Popen(
        [sys.executable, "-c", f"import os, signal, time; time.sleep({abs(seconds)}); {action}"],
        start_new_session=True,
    )
    os.kill(os.getpid(), signal.SIGSTOP)


def _host_env(rank: int, hosts: list[str] | None) -> dict[str, str]:
    """Topology variables for ``rank`` when ranks are spread over named hosts."""
    if hosts is None:
        return {}
    me = hosts[rank]
    local = [r for r, host in enumerate(hosts) if host == me]
    local_rank = local.index(rank)
    # The hosts that have a rank with this local rank, in order of first appearance.
    cross = [host for host in dict.fromkeys(hosts) if hosts.count(host) > local_rank]
    return {
        "HORA_HOSTNAME": me,
        "HORA_LOCAL_RANK": str(local_rank),
        "HORA_LOCAL_SIZE": str(len(local)),
        "HORA_CROSS_RANK": str(cross.index(me)),
        "HORA_CROSS_SIZE": str(len(cross)),
    }


def horarun(*args: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``horarun ARGS`` from the project's root with this interpreter and ``src`` on the path."""
    return subprocess.run(
        [sys.executable, "-m", "hora.runner", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", **(env or {})),
    )


def check_digits_example(script: str, epochs: int = 20, timeout: float = 230) -> None:
    """Runs a digits example at 2 ranks: it must exit 0, report a final test accuracy of at
    least 95% on 2 ranks, and print progress for every epoch from rank 0 only."""
    import re

    proc = horarun("-np", "2", sys.executable, script, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    final = re.search(r"\[0\]<stdout>:final test accuracy ([0-9.]+) on (\d) ranks", proc.stdout)
    assert final, proc.stdout
    assert float(final.group(1)) >= 0.95 and int(final.group(2)) == 2
    assert re.findall(r"\[0\]<stdout>:epoch +(\d+) +loss", proc.stdout) == [str(e) for e in range(1, epochs + 1)]
    assert not any(line.startswith("[1]<stdout>") for line in proc.stdout.splitlines())
