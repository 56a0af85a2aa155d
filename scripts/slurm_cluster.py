"""A one-machine Slurm cluster for tests: munged, slurmctld and slurmd with a minimal config.

Used by ``tests/test_launch*.py`` (``srun -n 3 python script.py`` runs a hora job) and by
hand (``python scripts/slurm_cluster.py`` prints ``export SLURM_CONF=...`` and waits).

Everything lives in a temporary directory: a fresh munge key and socket, the state and
spool directories, pid and log files, and ``slurm.conf`` with free ports for slurmctld
and slurmd. The node (``horanode``, 8 CPUs declared, ``config_overrides`` so the real
core count does not matter) uses ``proctrack/linuxproc`` and ``task/none``, so no cgroup
set-up is needed. The daemons run in the foreground as children of this process, and
``down()`` (also run at exit) stops them and removes the directory. Commands that talk
to the cluster need ``SLURM_CONF`` from ``env()``.

Needs root and Debian's slurm-wlm and munge (``scripts/setup-system.sh``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

NODE = "horanode"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SlurmCluster:
    """munged + slurmctld + slurmd on this machine; ``up()`` starts, ``down()`` stops."""

    def __init__(self) -> None:
        self.dir = ""
        self.processes: list[subprocess.Popen[bytes]] = []
        self.conf = ""

    def env(self) -> dict[str, str]:
        """This process's environment with ``SLURM_CONF`` pointing at the cluster."""
        return dict(os.environ, SLURM_CONF=self.conf)

    def up(self, timeout: float = 30.0) -> SlurmCluster:
        self.dir = tempfile.mkdtemp(prefix="hora-slurm-")
        atexit.register(self.down)
        munge = os.path.join(self.dir, "munge")
        for sub in ("munge", "state", "spool"):
            os.makedirs(os.path.join(self.dir, sub), mode=0o700)
        key = os.path.join(munge, "munge.key")
        with open(key, "wb") as key_file:
            key_file.write(os.urandom(1024))
        os.chmod(key, 0o600)
        sock = os.path.join(munge, "munge.socket")
        self._start(
            ["munged", "-F", "-f", f"--key-file={key}", f"--socket={sock}", f"--pid-file={munge}/munged.pid",
             f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"]  # fmt: skip
        )
        self._wait(lambda: os.path.exists(sock), timeout, "munged did not create its socket")
        self.conf = os.path.join(self.dir, "slurm.conf")
        with open(self.conf, "w") as handle:
            handle.write(
                "ClusterName=hora\n"
                "SlurmctldHost=localhost(127.0.0.1)\n"
                f"SlurmctldPort={_free_port()}\n"
                f"SlurmdPort={_free_port()}\n"
                "SlurmUser=root\nSlurmdUser=root\n"
                f"AuthType=auth/munge\nAuthInfo=socket={sock}\nCredType=cred/munge\n"
                f"StateSaveLocation={self.dir}/state\nSlurmdSpoolDir={self.dir}/spool\n"
                f"SlurmctldPidFile={self.dir}/slurmctld.pid\nSlurmdPidFile={self.dir}/slurmd.pid\n"
                f"SlurmctldLogFile={self.dir}/slurmctld.log\nSlurmdLogFile={self.dir}/slurmd.log\n"
                "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
                "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
                "SchedulerType=sched/builtin\nSelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
                "SlurmdParameters=config_overrides\nReturnToService=2\nMpiDefault=none\n"
                f"NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} CPUs=8 State=UNKNOWN\n"
                f"PartitionName=hora Nodes={NODE} Default=YES MaxTime=INFINITE State=UP\n"
            )
        self._start(["slurmctld", "-D", "-c", "-f", self.conf])
        self._start(["slurmd", "-D", "-N", NODE, "-f", self.conf])

        def idle() -> bool:
            result = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=self.env())
            return result.stdout.strip() == "idle"

        self._wait(idle, timeout, "the Slurm node did not become idle")
        return self

    def _start(self, argv: list[str]) -> None:
        self.processes.append(
            subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )

    def _wait(self, ready: Callable[[], bool], timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.processes):
                raise RuntimeError(f"{message}; logs: {self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        parts = []
        for name in ("munge/munged.log", "slurmctld.log", "slurmd.log"):
            try:
                with open(os.path.join(self.dir, name), errors="replace") as handle:
                    parts.append(f"--- {name}\n{handle.read()[-1500:]}")
            except OSError:
                continue
        return "\n".join(parts)

    def down(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.processes.clear()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""


if __name__ == "__main__":
    cluster = SlurmCluster().up()
    print(f"export SLURM_CONF={cluster.conf}")
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.down()
    sys.exit(0)
