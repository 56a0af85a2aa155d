"""``horarun --check-build``: what this hora installation can do, as ``horovodrun -cb`` prints it.

Nothing is imported to find out: a framework counts as available when its package is
installed (``importlib.metadata``) and importable (``importlib.util.find_spec``), so the
report takes a fraction of a second even with TensorFlow installed. Example::

    hora v0.1.0 (Python 3.11.7, /srv/project/.venv/bin/python)

    Available Frameworks:
        [X] NumPy 1.26.4 (hora.numpy)
        [X] PyTorch 2.13.0 (hora.torch)
        [ ] TensorFlow: not installed
    ...
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import shutil
import sys

from hora.version import __version__

# (shown name, distribution names, import name, hora binding)
FRAMEWORKS = (
    ("NumPy", ("numpy",), "numpy", "hora.numpy"),
    ("PyTorch", ("torch",), "torch", "hora.torch"),
    ("TensorFlow", ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly"), "tensorflow", "hora.tensorflow"),
    ("Keras", ("keras", "tf_keras", "tf-keras"), "keras", "hora.keras"),
    ("JAX", ("jax",), "jax", "hora.jax"),
    ("MXNet", ("mxnet",), "mxnet", "hora.mxnet"),
)
# The cluster engines hora runs on: (shown name, distribution names, import name, hora module)
INTEGRATIONS = (
    ("Ray", ("ray",), "ray", "hora.ray"),
    ("Spark", ("pyspark",), "pyspark", "hora.spark"),
    ("Lightning", ("lightning",), "lightning", "hora.lightning"),
)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _version(distributions: tuple[str, ...]) -> str | None:
    for distribution in distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _box(ok: bool) -> str:
    return "[X]" if ok else "[ ]"


def framework_lines(table: tuple[tuple[str, tuple[str, ...], str, str], ...] = FRAMEWORKS) -> list[str]:
    """One line per framework (or integration) of ``table``: installed, and whether hora has its module."""
    lines = []
    for shown, distributions, module, binding in table:
        version = _version(distributions)
        installed = version is not None and _importable(module)
        has_binding = _importable(binding)
        if installed and has_binding:
            lines.append(f"    [X] {shown} {version} ({binding})")
        elif installed:
            lines.append(f"    [ ] {shown} {version}: installed, but hora has no binding for it yet")
        else:
            lines.append(f"    [ ] {shown}: not installed")
    return lines


def _mpi_launchers() -> list[str]:
    found = []
    for program in ("mpirun", "mpiexec", "mpirun.openmpi", "mpiexec.mpich", "mpiexec.hydra"):
        path = shutil.which(program)
        if path is not None:
            found.append(program)
    return found


def transport_lines() -> list[str]:
    mpi4py = _version(("mpi4py",))
    shm = _importable("hora.transport.shm")
    return [
        "    [X] TCP (hora's built-in transport, every host)",
        f"    {_box(shm)} shared memory (ranks on one host)" + ("" if shm else ": not built"),
        f"    {_box(mpi4py is not None)} MPI through mpi4py"
        + (f" {mpi4py}: bootstrap under mpirun, and the data plane (HORA_TRANSPORT=mpi)" if mpi4py else ": pip install mpi4py"),
        "    [ ] NCCL: not built (GPU collectives are planned)",
    ]


def launcher_lines() -> list[str]:
    ssh = shutil.which("ssh")
    mpi = _mpi_launchers()
    srun = shutil.which("srun")
    torchrun = shutil.which("torchrun")
    return [
        "    [X] horarun on this machine",
        f"    {_box(ssh is not None)} horarun over ssh (-H/--hostfile)" + ("" if ssh else ": no ssh client"),
        f"    {_box(bool(mpi))} mpirun / mpiexec" + (f" ({', '.join(mpi)})" if mpi else ": not found"),
        f"    {_box(srun is not None)} Slurm srun" + ("" if srun else ": not found"),
        "    [X] torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
        + (" (torchrun found)" if torchrun else ""),
    ]


def report() -> str:
    """The whole ``--check-build`` report."""
    lines = [f"hora v{__version__} (Python {platform.python_version()}, {sys.executable})", ""]
    lines += ["Available Frameworks:", *framework_lines(), ""]
    lines += ["Available Transports:", *transport_lines(), ""]
    lines += ["Available Launchers:", *launcher_lines(), ""]
    lines += ["Available Integrations:", *framework_lines(INTEGRATIONS)]
    return "\n".join(lines)
