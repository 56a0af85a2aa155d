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
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

PEERS = ("torch-gloo", "mpi4py", "horovod-gloo", "horovod-mpi")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
_PROBE_TIMEOUT = 120.0
_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


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
        self, num_proc: int, worker_args: Sequence[str], env: Mapping[str, str]
    ) -> list[tuple[list[str], dict[str, str]]]:
        """The processes to start: argv and complete environment for each."""
        base = {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        worker = [self.python, WORKER, "--backend", self.backend, *worker_args]
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
        hosts = f"localhost:{num_proc}"
        return [([self.launcher, "-np", str(num_proc), "-H", hosts, transport, *worker], mpi_env)]


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
