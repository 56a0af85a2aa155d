"""``horarun --mpi``: start the ranks with ``mpirun``, MPI carrying the collectives' data.

As ``horovodrun --mpi`` does, ``horarun`` hands the job to the MPI launcher found on
``PATH`` (Open MPI's ``mpirun``, or MPICH's Hydra ``mpirun``/``mpiexec``) with the
hosts and slots it was given, and the ranks run with ``HORA_TRANSPORT=mpi``. Each rank
reads its topology from the MPI launcher's variables, rank 0 runs the rendezvous (hora's
control plane still negotiates over TCP), and the job secret, made fresh here, reaches
the ranks through the environment by name (``-x HORA_SECRET`` / ``-genvlist``), never
on a command line. Output, failures and signals are ``mpirun``'s: each line is tagged
with the rank (``[1,0]<stdout>:`` with Open MPI), and ``horarun`` exits with
``mpirun``'s exit code.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

from hora.runner.hosts import SlotInfo
from hora.runner.settings import FORWARDED, FORWARDED_PREFIXES, LaunchSettings
from hora.transport import auth


def find_mpirun() -> tuple[str, str]:
    """Returns the MPI launcher's path and its flavour, ``openmpi`` or ``mpich``.

    Raises:
        ValueError: no MPI launcher on ``PATH``; says what to install.
    """
    for name in ("mpirun", "mpiexec"):
        path = shutil.which(name)
        if path is None:
            continue
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        text = version.stdout + version.stderr
        if "Open MPI" in text or "OpenRTE" in text:
            return path, "openmpi"
        if "HYDRA" in text or "MPICH" in text or "Intel" in text:
            return path, "mpich"
    raise ValueError(
        "--mpi: no MPI launcher (mpirun or mpiexec) on PATH: install Open MPI or MPICH, "
        "or drop --mpi (hora's built-in transport runs the job)"
    )


def _hosts(slots: Sequence[SlotInfo]) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for slot in slots:
        counts[slot.hostname] = counts.get(slot.hostname, 0) + 1
    return list(counts.items())


def mpirun_command(
    mpirun: str,
    flavour: str,
    settings: LaunchSettings,
    slots: Sequence[SlotInfo],
    names: Sequence[str],
    mpi_args: str | None = None,
) -> list[str]:
    """Builds the MPI launcher's command line.

    Args:
        mpirun: the launcher's path.
        flavour: ``openmpi`` or ``mpich``.
        settings: the launch settings.
        slots: where each rank runs, by rank (consecutive ranks per host).
        names: environment variables the ranks must get (passed by name).
        mpi_args: extra launcher arguments (``--mpi-args``), split as a shell would.
    """
    hosts = _hosts(slots)
    extra = shlex.split(mpi_args) if mpi_args else []
    if flavour == "openmpi":
        command = [mpirun, "--allow-run-as-root", "--oversubscribe", "--tag-output", "-np", str(settings.num_proc)]
        command += ["-H", ",".join(f"{host}:{count}" for host, count in hosts)]
        command += ["-bind-to", "none", "-map-by", "slot"]
        for name in names:
            command += ["-x", name]
    else:
        command = [mpirun, "-n", str(settings.num_proc), "-prepend-rank"]
        command += ["-hosts", ",".join(f"{host}:{count}" for host, count in hosts)]
        command += ["-genvlist", ",".join(names)]
    return [*command, *extra, *settings.command]


def mpi_env(settings: LaunchSettings, base: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment: ours, the settings' variables, the MPI transport and a fresh secret."""
    env = dict(base)
    env.update(settings.env or {})
    env.update(settings.tuning.env())
    # Unlike the built-in launch, PYTHONUNBUFFERED is left alone: mpirun tags every chunk a
    # rank writes, and an unbuffered print() writes a line in several chunks.
    env.update(HORA_TRANSPORT="mpi", HORA_SECRET=auth.new_secret().hex())
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")  # what --allow-run-as-root says, for nested launches
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    if settings.start_timeout is not None:
        env["HORA_START_TIMEOUT"] = repr(float(settings.start_timeout))
    return env


def forwarded_names(env: Mapping[str, str], settings: LaunchSettings) -> list[str]:
    """The variables every rank gets, by name: hora's, Horovod's, Python's and the user's."""
    names = {name for name in env if name.startswith(FORWARDED_PREFIXES) or name in FORWARDED}
    names.update(settings.env or {})
    names.update(settings.forward_env)
    return sorted(names)


def launch_mpi(settings: LaunchSettings, slots: Sequence[SlotInfo], mpi_args: str | None = None) -> int:
    """Runs the job under the MPI launcher and returns its exit code.

    SIGINT and SIGTERM to ``horarun`` are passed on to the launcher, which stops its ranks.

    Raises:
        ValueError: no MPI launcher is installed.
    """
    mpirun, flavour = find_mpirun()
    env = mpi_env(settings, os.environ)
    command = mpirun_command(mpirun, flavour, settings, slots, forwarded_names(env, settings), mpi_args)
    if settings.verbose:
        print("horarun: " + " ".join(shlex.quote(part) for part in command), file=sys.stderr, flush=True)
    process = subprocess.Popen(command, env=env)

    def forward(signum: int, frame: FrameType | None) -> None:
        process.send_signal(signum)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():  # hora.run may be called from any thread
        previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
