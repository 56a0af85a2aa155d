"""The peers ``hora-bench --peers`` runs next to hora, each with its own launcher.

=================  =======================================================================
``torch-gloo``     torch.distributed with the gloo backend: one process per rank, started
                   here with ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` (what
                   ``torchrun`` sets), running ``worker.py`` with this interpreter.
``mpi4py``         mpi4py on Open MPI: ``mpirun -np N --oversubscribe python worker.py``,
                   with ``OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1`` (harmless when not root) and
                   ``MPI4PY_MPIABI=openmpi`` unless set (the wheel carries several MPI ABIs).
``horovod-gloo``,  Horovod through ``horovodrun -np N -H localhost:N --gloo|--mpi``, with the
``horovod-mpi``    interpreter given by ``--horovod-python`` (default: this one), which
                   may live in its own virtualenv without hora: ``worker.py`` runs by path.
=================  =======================================================================

``detect`` says which peers can run and, for the others, why not and how to get them.
Every peer's processes get ``OMP_NUM_THREADS=1``, like hora's ranks.

Across hosts (``hora-bench -H host:slots,...``, a ``Hosts``), each peer starts its ranks
where horarun would put hora's, reaching the hosts with the ssh command horarun uses
(``hora.runner.ssh.SshSettings``: ``-p``, ``-i``, ``HORA_SSH_OPTIONS``):

* ``torch-gloo``: one ``ssh HOST exec env MASTER_ADDR=<first host> ... python worker.py``
  per rank (a rank on this machine starts here), ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` from
  the placement, ``GLOO_SOCKET_IFNAME`` from ``--network-interfaces``;
* ``mpi4py``: ``mpirun -H host:slots,... --mca plm_rsh_agent <ssh>``, where ``<ssh>`` is a
  small script that runs ssh with those options;
* Horovod: ``horovodrun -np N -H host:slots,... --gloo|--mpi`` run *on the first host* (over
  ssh unless it is this machine), with that script first in ``PATH`` as ``ssh``
  (horovodrun runs ``ssh`` from ``PATH`` and has no option for a config file), and
  ``--network-interfaces`` passed on. horovodrun's gloo mode takes its rendezvous
  server's address from the launching machine's interface of that name, so it must
  start on one of the hosts, as its documentation assumes.

The processes on the hosts read the plan and rank 0 writes its results in hora-bench's
temporary directory, and the ssh script lies there too: the hosts must share this
machine's filesystem there (true of the network-namespace hosts of
``benchmarks/cluster.py``), and have the same interpreters at the same paths.

Every process a run starts carries ``HORABENCH_RUN=<marker>`` in its environment
(launchers pass it on to their ranks); ``sweep`` kills whatever still carries it on
every host after the run, so a failed or timed-out run leaves nothing behind on a host,
where stopping the local ssh client would not reach (ssh without a terminal does not
signal the remote command).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import concurrent.futures
import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

from hora.runner.hosts import SlotInfo, is_local_host
from hora.runner.ssh import SshSettings

PEERS = ("torch-gloo", "mpi4py", "horovod-gloo", "horovod-mpi")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
_PROBE_TIMEOUT = 120.0
_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MARKER = "HORABENCH_RUN"
# Variables a remote rank gets from hora-bench's environment besides the ones set per rank:
# the same families a local rank would see and that change how the libraries behave.
_FORWARDED_PREFIXES = ("HOROVOD_", "OMPI_", "MPI4PY_", "GLOO_", "TORCH_", "NCCL_")
_FORWARDED_NAMES = ("PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", MARKER)
_SWEEP_TIMEOUT = 60.0
# Run by the interpreter on each host: kills (TERM, then KILL) every process of this user
# whose environment holds MARKER=<argv[1]>, and prints how many it found.
_SWEEP = """
import os, signal, sys, time
mark = (sys.argv[1] + "=" + sys.argv[2]).encode()
def marked():
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open("/proc/" + entry + "/environ", "rb") as handle:
                    if mark in handle.read().split(b"\\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found
first = marked()
for sig in (signal.SIGTERM, signal.SIGKILL):
    for pid in marked():
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and marked():
        time.sleep(0.05)
print(len(first))
"""


@dataclasses.dataclass(frozen=True)
class Hosts:
    """Where the ranks run across hosts (``hora-bench -H``) and how to reach them.

    Attributes:
        spec: the ``-H`` value, ``host:slots,...``.
        slots: where each rank runs, by rank (``hora.runner.hosts.plan``).
        ssh: the ssh settings horarun would use.
        interfaces: ``--network-interfaces`` (comma-separated), or None.
        directory: a directory every host shares with this machine (hora-bench's
            temporary directory), for the ssh script.
    """

    spec: str
    slots: tuple[SlotInfo, ...]
    ssh: SshSettings
    interfaces: str | None
    directory: str

    @property
    def names(self) -> list[str]:
        """The distinct host names, in rank order."""
        return list(dict.fromkeys(slot.hostname for slot in self.slots))

    def ssh_script(self) -> str:
        """Writes (once) ``<directory>/bin/ssh``: ssh with horarun's options; returns its path."""
        path = os.path.join(self.directory, "bin", "ssh")
        if not os.path.exists(path):
            real = shutil.which("ssh") or "ssh"
            # SshSettings.command ends with "--", host, command: keep only the options.
            options = self.ssh.command("HOST", "COMMAND")[1:-3]
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(f"#!/bin/sh\nexec {shlex.quote(real)} {shlex.join(options)} \"$@\"\n")
            os.chmod(path, 0o755)
        return path

    def remote(self, host: str, argv: Sequence[str], env: Mapping[str, str], path_first: str | None = None) -> list[str]:
        """The ssh command that runs ``argv`` on ``host`` with the variables ``env``.

        Args:
            host: the host, as ``-H`` names it.
            argv: the program and its arguments.
            env: variables set for it (on the command line: none of them is secret).
            path_first: a directory put before the remote ``PATH``, or None.

        Returns:
            The local argv (``ssh ... HOST 'exec env ... ARGV'``).
        """
        words = [f"{name}={shlex.quote(value)}" for name, value in env.items()]
        if path_first is not None:
            words.insert(0, f'PATH={shlex.quote(path_first)}:"$PATH"')
        return self.ssh.command(host, f"exec env {' '.join(words)} {shlex.join(argv)}")

    def torch_ranks(self, worker: Sequence[str], env: Mapping[str, str]) -> list[tuple[list[str], dict[str, str]]]:
        """One process per slot running ``worker`` with torchrun's variables (``MASTER_ADDR``
        the first host), over ssh unless the slot is on this machine.

        Returns:
            Each process's argv and environment.
        """
        port, size = str(free_port()), len(self.slots)
        commands: list[tuple[list[str], dict[str, str]]] = []
        for slot in self.slots:
            rank_env = {
                "MASTER_ADDR": self.slots[0].hostname,
                "MASTER_PORT": port,
                "RANK": str(slot.rank),
                "LOCAL_RANK": str(slot.local_rank),
                "WORLD_SIZE": str(size),
                "LOCAL_WORLD_SIZE": str(slot.local_size),
            }
            if self.interfaces:
                rank_env["GLOO_SOCKET_IFNAME"] = self.interfaces
            if is_local_host(slot.hostname):
                commands.append((list(worker), {**env, **rank_env}))
            else:
                commands.append((self.remote(slot.hostname, worker, {**forwarded(env), **rank_env}), dict(env)))
        return commands

    def horovodrun(
        self, launcher: str, transport: str, worker: Sequence[str], env: Mapping[str, str]
    ) -> list[tuple[list[str], dict[str, str]]]:
        """``horovodrun -H ... --gloo|--mpi worker`` started on the first host (see the module
        docstring), with the ssh script first in ``PATH``.

        Args:
            launcher: horovodrun's path.
            transport: ``--gloo`` or ``--mpi``.
            worker: the rank's program and arguments.
            env: the environment to start from.

        Returns:
            The one process to start: its argv and environment.
        """
        # --disable-cache: horovodrun would otherwise skip its ssh check for an hour after a
        # success, on host names that the next cluster reuses.
        argv = [launcher, "-np", str(len(self.slots)), "-H", self.spec, transport, "--disable-cache"]
        if self.interfaces:
            argv += ["--network-interfaces", self.interfaces]
        argv += worker
        mpi_env = {**env, **_MPI_ENV}
        script_dir = os.path.dirname(self.ssh_script())
        first = self.slots[0].hostname
        if is_local_host(first):
            return [(argv, {**mpi_env, "PATH": script_dir + os.pathsep + mpi_env.get("PATH", os.defpath)})]
        return [(self.remote(first, argv, forwarded(mpi_env), path_first=script_dir), mpi_env)]


def forwarded(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` a remote rank gets (see ``_FORWARDED_PREFIXES``)."""
    return {k: v for k, v in env.items() if k in _FORWARDED_NAMES or k.startswith(_FORWARDED_PREFIXES)}


def sweep(hosts: Hosts, marker: str) -> int:
    """Kills every process that still carries ``HORABENCH_RUN=marker``, on every host.

    Args:
        hosts: the hosts of the run.
        marker: the run's marker.

    Returns:
        How many such processes were found (0 after a run that ended cleanly).
    """

    def one(host: str) -> int:
        argv = [sys.executable, "-c", _SWEEP, MARKER, marker]
        command = argv if is_local_host(host) else hosts.ssh.command(host, shlex.join(argv))
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=_SWEEP_TIMEOUT,
                                  stdin=subprocess.DEVNULL)  # fmt: skip
            return int(done.stdout.split()[-1]) if done.returncode == 0 and done.stdout.split() else 0
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return 0

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(hosts.names))) as pool:
        return sum(pool.map(one, hosts.names))


@dataclasses.dataclass(frozen=True)
class Peer:
    """A peer that can run here.

    Attributes:
        key: one of ``PEERS``.
        backend: the worker backend it runs (``torch``, ``mpi`` or ``horovod``).
        python: the interpreter its ranks run.
        launcher: ``horovodrun`` for Horovod, ``mpirun`` for mpi4py, else None.
    """

    key: str
    backend: str
    python: str
    launcher: str | None = None

    def commands(
        self, num_proc: int, worker_args: Sequence[str], env: Mapping[str, str], hosts: Hosts | None = None
    ) -> list[tuple[list[str], dict[str, str]]]:
        """The processes to start: argv and complete environment for each.

        Args:
            num_proc: the number of ranks.
            worker_args: ``worker.py``'s arguments after ``--backend``.
            env: the environment to start from (hora-bench's, with the run's marker).
            hosts: where the ranks run across hosts, or None for this machine only.

        Returns:
            Each process's argv and complete environment; the first one's stdout carries
            rank 0's table.
        """
        base = {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        worker = [self.python, WORKER, "--backend", self.backend, *worker_args]
        if hosts is not None:
            return self._across(hosts, worker, base)
        if self.key == "torch-gloo":
            port = str(free_port())
            return [
                (
                    worker,
                    {
                        **base,
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port,
                        "RANK": str(rank),
                        "LOCAL_RANK": str(rank),
                        "WORLD_SIZE": str(num_proc),
                        "LOCAL_WORLD_SIZE": str(num_proc),
                    },
                )
                for rank in range(num_proc)
            ]
        assert self.launcher is not None  # set by detect for every launched peer
        mpi_env = {**base, **_MPI_ENV}
        if self.key == "mpi4py":
            mpi_env.setdefault("MPI4PY_MPIABI", "openmpi")
            return [([self.launcher, "-np", str(num_proc), "--oversubscribe", *worker], mpi_env)]
        transport = "--mpi" if self.key == "horovod-mpi" else "--gloo"
        local = f"localhost:{num_proc}"
        return [([self.launcher, "-np", str(num_proc), "-H", local, transport, *worker], mpi_env)]

    def _across(self, hosts: Hosts, worker: list[str], base: dict[str, str]) -> list[tuple[list[str], dict[str, str]]]:
        """``commands`` across hosts (see the module docstring)."""
        if self.key == "torch-gloo":
            return hosts.torch_ranks(worker, base)
        assert self.launcher is not None  # set by detect for every launched peer
        if self.key in ("horovod-gloo", "horovod-mpi"):
            return hosts.horovodrun(self.launcher, "--mpi" if self.key == "horovod-mpi" else "--gloo", worker, base)
        mpi_env = {**base, **_MPI_ENV}
        mpi_env.setdefault("MPI4PY_MPIABI", "openmpi")
        argv = [self.launcher, "-np", str(len(hosts.slots)), "-H", hosts.spec, "--oversubscribe",
                "--mca", "plm_rsh_agent", hosts.ssh_script()]  # fmt: skip
        if hosts.interfaces:
            argv += ["--mca", "btl_tcp_if_include", hosts.interfaces]
        for name in forwarded(mpi_env):  # mpirun passes on only what -x names
            argv += ["-x", name]
        return [([*argv, *worker], mpi_env)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_peers(text: str) -> list[str]:
    """Parses ``--peers``' value: ``all`` or a comma-separated list of ``PEERS`` (``horovod`` = both)."""
    if text.strip().lower() == "all":
        return list(PEERS)
    chosen: list[str] = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        names = ["horovod-gloo", "horovod-mpi"] if part == "horovod" else [part]
        for name in names:
            if name not in PEERS:
                raise ValueError(f"unknown peer {part!r}: expected 'all' or some of {', '.join(PEERS)}, horovod")
            if name not in chosen:
                chosen.append(name)
    return chosen


def _open_mpi_mpirun() -> tuple[str | None, str]:
    """Returns (Open MPI's mpirun, '') or (None, why not)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None, "mpirun not found (Debian: apt-get install openmpi-bin libopenmpi-dev)"
    try:
        version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{mpirun} --version failed: {exc}"
    if "Open MPI" not in version:
        first = version.strip().splitlines()[0] if version.strip() else "unknown"
        return None, f"{mpirun} is not Open MPI's ({first}); select it: update-alternatives --config mpirun"
    return mpirun, ""


def _horovod(python: str) -> tuple[bool, bool, str]:
    """Returns (gloo built, MPI built, why not) for Horovod in ``python``."""
    probe = "import horovod.torch as h; print(int(h.gloo_built()), int(h.mpi_built()))"
    try:
        done = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=_PROBE_TIMEOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, False, f"could not run {python}: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return False, False, (
            f"horovod.torch is not importable by {python} ({last}); build it as docs/benchmarking.md shows "
            "and pass --horovod-python"
        )
    gloo, mpi = (bool(int(v)) for v in done.stdout.split()[-2:])
    return gloo, mpi, ""


def detect(chosen: Sequence[str], horovod_python: str | None) -> tuple[list[Peer], dict[str, str]]:
    """Finds which of the ``chosen`` peers can run here.

    Args:
        chosen: keys from ``PEERS``.
        horovod_python: the interpreter that has Horovod; None uses this one.

    Returns:
        The peers to run, in ``PEERS`` order, and for each skipped one the reason.
    """
    peers: list[Peer] = []
    skipped: dict[str, str] = {}
    if "torch-gloo" in chosen:
        if importlib.util.find_spec("torch") is None:
            skipped["torch-gloo"] = f"torch is not installed in {sys.executable} (pip install 'torch==<version>')"
        else:
            peers.append(Peer("torch-gloo", "torch", sys.executable))
    mpirun, mpi_why = (None, "") if not any(k in chosen for k in ("mpi4py", "horovod-mpi")) else _open_mpi_mpirun()
    if "mpi4py" in chosen:
        if importlib.util.find_spec("mpi4py") is None:
            skipped["mpi4py"] = f"mpi4py is not installed in {sys.executable} (pip install mpi4py)"
        elif mpirun is None:
            skipped["mpi4py"] = mpi_why
        else:
            peers.append(Peer("mpi4py", "mpi", sys.executable, mpirun))
    wanted = [k for k in ("horovod-gloo", "horovod-mpi") if k in chosen]
    if wanted:
        python = horovod_python or sys.executable
        gloo, mpi, why = _horovod(python)
        horovodrun = os.path.join(os.path.dirname(python), "horovodrun")
        if not why and not os.path.exists(horovodrun):
            why = f"horovodrun not found next to {python}"
        for key, built, transport in (("horovod-gloo", gloo, "gloo"), ("horovod-mpi", mpi, "MPI")):
            if key not in wanted:
                continue
            if why:
                skipped[key] = why
            elif not built:
                skipped[key] = f"Horovod in {python} was built without {transport}"
            elif key == "horovod-mpi" and mpirun is None:
                skipped[key] = mpi_why
            else:
                peers.append(Peer(key, "horovod", python, horovodrun))
    return peers, skipped
