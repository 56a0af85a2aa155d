"""TensorFlow's data service run by hora jobs (``hora.tensorflow.data``), for real.

A compute job (``horarun -np 2 python -m hora.tensorflow.data.compute_worker CONFIG``)
and a training job (``horarun -np 2 examples/tensorflow/data_service_digits.py CONFIG``)
run side by side, as Horovod's documentation starts them: the training job reads the
config the compute job writes, trains on batches its pipeline's workers made, and its
rank 0 shuts the compute job down, so both end by themselves. Every layout Horovod
documents: one dispatcher or one per training rank, on the compute or the training side,
the dataset shared round robin. Then what must fail fast: a compute job whose size the
dispatchers do not divide, and a training job whose compute job has gone (an error
naming the service, not a wait), or a dispatcher it cannot reach. Last, the two jobs on
two network-namespace hosts: with TensorFlow's ``localhost`` addresses passed on, as
Horovod passes them, the training job waited for ever (checked by hand, before the
reachability check: killed at the 200 s timeout; with the check it fails at once naming
``grpc://localhost:<port>``); with the addresses hora advertises it trains.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import run_ranks
from test_tensorflow_ops import TF_ENV

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from netns_hosts import Cluster, ensure_system  # noqa: E402

pytestmark = pytest.mark.framework

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/tensorflow/data_service_digits.py"


def _horarun(*args: str, hosts: str | None = None) -> list[str]:
    where = ["-H", hosts] if hosts else []
    return [sys.executable, "-m", "hora.runner", "-np", "2", *where, sys.executable, *args]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"), **TF_ENV, **extra)


def _compute_job(
    config: Path, *args: str, hosts: str | None = None, timeout: int = 60, **env: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _horarun(
            "-m", "hora.tensorflow.data.compute_worker", str(config), "--timeout", str(timeout), *args, hosts=hosts
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=_env(**env),
    )


def _training_job(
    config: Path, *args: str, epochs: int = 6, timeout: float = 180, hosts: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _horarun(str(ROOT / EXAMPLE), str(config), "--epochs", str(epochs), *args, hosts=hosts),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=_env(**env),
    )


def _ended(compute: subprocess.Popen[str], timeout: float = 60) -> str:
    """The compute job's output once it ended; it must end by itself, with exit status 0."""
    try:
        out, _ = compute.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        compute.kill()
        out, _ = compute.communicate()
        pytest.fail(f"the compute job did not end after the training job shut it down:\n{out[-3000:]}")
    assert compute.returncode == 0, out[-3000:]
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("compute_args", "training_args"),
    [
        ((), ()),
        (("--dispatchers", "2"), ()),
        (("--dispatcher-side", "training"), ()),
        ((), ("--reuse-dataset", "--round-robin")),
    ],
    ids=["one-dispatcher", "a-dispatcher-per-rank", "training-side", "round-robin"],
)
def test_a_training_job_trains_on_a_compute_job_and_ends_it(
    tmp_path: Path, compute_args: tuple[str, ...], training_args: tuple[str, ...]
) -> None:
    config = tmp_path / "compute.json"
    compute = _compute_job(config, *compute_args)
    try:
        training = _training_job(config, *training_args)
    finally:
        out = _ended(compute)
    assert training.returncode == 0, training.stdout[-3000:] + training.stderr[-3000:]
    final = re.search(r"\[0\]<stdout>:final test accuracy ([0-9.]+) on 2 ranks", training.stdout)
    assert final and float(final.group(1)) >= 0.9, training.stdout[-3000:]
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("side", ["compute", "training"])
def test_the_compute_job_ends_at_once_while_a_reader_still_fetches(tmp_path: Path, side: str) -> None:
    """The training job leaves a data-service iterator prefetching when it stops its
    dispatchers and shuts the compute job down. A tf.data worker fetching splits from a
    dispatcher that has gone retries for its whole ``dispatcher_timeout_ms`` (the compute
    job's ``--timeout``, 120 s here) and cannot stop before; before hora stopped the workers
    ahead of their dispatcher, a training-side compute job at ``--timeout 60`` took three
    minutes to end."""
    config = tmp_path / "compute.json"
    compute = _compute_job(config, "--dispatcher-side", side, timeout=120)
    try:
        training = subprocess.run(
            _horarun(str(ROOT / "tests/scripts/data_service_reader.py"), str(config)),
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
            env=_env(),
        )
    finally:
        out = _ended(compute, timeout=60)
    assert training.returncode == 0, training.stdout[-3000:] + training.stderr[-3000:]
    assert "[0]<stdout>:shut the compute job down" in training.stdout, training.stdout[-3000:]
    assert "Traceback" not in out, out[-3000:]


def compute_rank_lost_job(configfile: str) -> str:
    """A compute job of two ranks whose rank 0 (the compute service and the dispatcher) dies
    once both workers registered; rank 1 reports what it raised."""
    import threading

    from hora.core.compute_service import ComputeClient
    from hora.tensorflow.data import compute_worker
    from hora.tensorflow.data.compute_service import TfDataServiceConfig

    def die_once_registered() -> None:
        config = TfDataServiceConfig.read(configfile, wait_for_file_creation=True)
        ComputeClient(config.addresses, config.key, verbose=0).wait_for_dispatcher_worker_registration(0, 60)
        os._exit(1)

    if int(os.environ["RANK"]) == 0:
        threading.Thread(target=die_once_registered, daemon=True).start()
    try:
        compute_worker.main(1, "compute", configfile, 60)
    except Exception as exc:  # noqa: BLE001 - the test reads its class and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.timeout(180)
def test_a_compute_rank_lost_fails_the_others_without_a_launcher(tmp_path: Path) -> None:
    """Started as torchrun starts ranks, nobody stops the survivor: it finds the service gone,
    stops its worker and fails at the barrier before the dispatchers stop, naming rank 0."""
    results = run_ranks(
        2, compute_rank_lost_job, str(tmp_path / "compute.json"), env=TF_ENV, check=False, launcher="torchrun",
        timeout=150,
    )  # fmt: skip
    survivor = results[1]
    assert survivor.returncode == 0, survivor.output + (survivor.error or "")
    assert survivor.value.startswith("HoraInternalError: "), survivor.value
    assert "barrier failed: rank 0 (the coordinator) on host" in survivor.value, survivor.value
    assert "was lost" in survivor.value, survivor.value


@pytest.mark.timeout(120)
def test_dispatchers_that_do_not_divide_the_compute_job_fail_every_rank(tmp_path: Path) -> None:
    compute = _compute_job(tmp_path / "compute.json", "--dispatchers", "3")
    out, _ = compute.communicate(timeout=100)
    assert compute.returncode != 0
    for rank in (0, 1):
        assert re.search(rf"\[{rank}\]<stderr>:.*Number of processes \(2\) must be a multiple of number of "
                         r"dispatchers \(3\)", out), out[-3000:]  # fmt: skip
    assert not (tmp_path / "compute.json").exists()


@pytest.mark.timeout(180)
def test_a_training_job_whose_compute_job_has_gone_fails_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "compute.json"
    compute = _compute_job(config)
    try:
        first = _training_job(config, epochs=1)
    finally:
        _ended(compute)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # The config file stays behind; the service it names has gone.
    second = _training_job(config, epochs=1, timeout=120)
    assert second.returncode != 0
    assert "ConnectionError: Compute service" in second.stdout + second.stderr, second.stdout[-3000:]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ensure_system()
    hosts = Cluster(2).up()
    try:
        yield hosts
    finally:
        hosts.down()


@pytest.mark.timeout(300)
def test_the_compute_job_and_the_training_job_on_different_hosts(cluster: Cluster, tmp_path: Path) -> None:
    """TensorFlow names its dispatcher and workers ``localhost``; hora advertises the address
    their host reaches the compute service at, so ranks on another host can read from them
    (network-namespace hosts with real sshd; the config file on the shared file system)."""
    config = tmp_path / "compute.json"
    ssh = {"HORA_SSH_OPTIONS": cluster.ssh_options(), "HORA_START_TIMEOUT": "60"}
    compute_host, training_host = (host.address for host in cluster.hosts)
    compute = _compute_job(config, hosts=f"{compute_host}:2", **ssh)
    try:
        training = _training_job(config, epochs=3, hosts=f"{training_host}:2", timeout=200, **ssh)
    finally:
        _ended(compute, timeout=90)
    assert training.returncode == 0, training.stdout[-3000:] + training.stderr[-3000:]
    final = re.search(r"\[0\]<stdout>:final test accuracy ([0-9.]+) on 2 ranks", training.stdout)
    assert final, training.stdout[-3000:]
    addresses = {address for entries in json.loads(config.read_text())["addresses"].values() for address, _ in entries}
    assert compute_host in addresses, addresses


@pytest.mark.timeout(120)
def test_an_unreachable_dispatcher_is_an_error_not_a_wait() -> None:
    """A dispatcher registered at an address this host cannot reach (a firewall, the wrong
    interface): TensorFlow's client would retry for ever; hora names the dispatcher."""
    code = (
        "import socket\n"
        "from hora.core.compute_service import ComputeService, make_secret_key\n"
        "from hora.tensorflow.data.compute_service import TfDataServiceConfig\n"
        "import tensorflow as tf\n"
        "key = make_secret_key()\n"
        "service = ComputeService(1, 1, key)\n"
        "config = TfDataServiceConfig(1, 1, 'compute', service.addresses(), key, timeout=5)\n"
        "closed = socket.socket(); closed.bind(('127.0.0.1', 0)); port = closed.getsockname()[1]; closed.close()\n"
        "client = config.compute_client()\n"
        "client.register_dispatcher(0, f'grpc://127.0.0.1:{port}')\n"
        "client.register_worker_for_dispatcher(0, 0)\n"
        "try:\n"
        "    tf.data.Dataset.range(4).send_to_data_service(config, 0, 1)\n"
        "except ConnectionError as exc:\n"
        "    print('refused:', exc)\n"
        "service.shutdown()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"refused: dispatcher 0 at grpc://127.0.0.1:\d+ cannot be reached from this host", result.stdout), (
        result.stdout + result.stderr[-2000:]
    )
