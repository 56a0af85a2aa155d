"""Test layers and the guard that keeps the fast one fast.

Every test belongs to one layer, a pytest marker:

* ``unit``: one process (threads and loopback sockets allowed); seconds. ``make check``
  runs these alone, with no system setup.
* ``ranks``: starts processes on this machine (ranks, launchers, examples).
* ``system``: needs root and system pieces (network namespaces, sshd, MPI, Slurm).
* ``framework``: imports TensorFlow/Keras (seconds per import).

A module declares its layer with ``pytestmark``, a test that differs from its module with
its own marker, and a test that uses a fixture of ``SYSTEM_FIXTURES`` is ``system``; a
test with none is ``unit``. While a ``unit`` test runs, starting a
process or importing TensorFlow raises and fails the test, naming the layer to use, so a
test cannot sit in the fast layer by mistake.
"""

import importlib.util
import os
import sys
from collections.abc import Generator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# tests/test_mxnet*.py run in MXNet's own environment (.venv-mxnet: MXNet 1.9.1 needs NumPy < 2),
# in the second pytest run of `make test`; an interpreter without mxnet does not collect them.
if importlib.util.find_spec("mxnet") is None:
    collect_ignore_glob = ["test_mxnet*.py"]

LAYERS = {
    "unit": "one process, seconds: what `make check` runs",
    "ranks": "starts processes on this machine",
    "system": "needs root and system pieces (namespaces, sshd, MPI, Slurm)",
    "framework": "imports TensorFlow/Keras",
}
SLOW_LAYERS = ("ranks", "system", "framework")
# Audit events that start a process (os.exec* replaces this one: also not a unit test's).
PROCESS_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.system", "os.exec"}
HEAVY_IMPORTS = {"tensorflow", "keras", "tf_keras"}
# Fixtures that set up system pieces: a test that uses one is a system test.
SYSTEM_FIXTURES = {"system", "cluster", "slurm", "mpich_env"}


class UnitGuard:
    """Refuses, while a unit test runs, what only the slower layers may do."""

    def __init__(self) -> None:
        self.active = False
        self.violations: list[str] = []

    def audit(self, event: str, args: tuple) -> None:
        if not self.active:
            return
        what = None
        if event in PROCESS_EVENTS:
            what = f"started a process ({event}): mark it ranks or system"
        elif event == "import" and args and str(args[0]).split(".")[0] in HEAVY_IMPORTS:
            what = f"imported {args[0]}: mark it framework"
        if what is not None:
            self.violations.append(what)
            self.active = False  # report once; let the test unwind
            raise RuntimeError(f"a unit test {what}")


GUARD = UnitGuard()
sys.addaudithook(GUARD.audit)


def pytest_configure(config: pytest.Config) -> None:
    for name, meaning in LAYERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SYSTEM_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.system)
        if not any(item.get_closest_marker(layer) for layer in SLOW_LAYERS):
            item.add_marker(pytest.mark.unit)


def _guarded(item: pytest.Item) -> Generator[None, None, None]:
    GUARD.violations.clear()
    GUARD.active = item.get_closest_marker("unit") is not None
    try:
        result = yield
    finally:
        GUARD.active = False
    if GUARD.violations:  # also when the test caught the error
        pytest.fail(f"this unit test {GUARD.violations[0]}", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """Fixtures count: a unit test's fixtures start no process either."""
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _guarded(item))


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Generator[None, None, None]:
    """hora as a job of one rank in this process (no launcher variables), shut down after."""
    for name in list(os.environ):
        if name.startswith(("HORA_", "HOROVOD_")):
            monkeypatch.delenv(name)
    yield
    from hora.core.api import shutdown

    shutdown()
