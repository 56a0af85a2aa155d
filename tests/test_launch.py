"""hora started by other launchers: real Open MPI mpirun, MPICH mpiexec, torchrun, Slurm srun, and
torchrun-style variables set by hand, each running a job with hora's built-in transport; plus the
reading of each launcher's variables (recorded environments) and the errors that name what to set.

The Debian packages (openmpi-bin, mpich, slurm-wlm, munge) come from scripts/setup-system.sh; mpi4py
is installed into this Python if it is missing.
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from hora import config as config_module
from hora.core.bootstrap import topology_from_hosts
from hora.config import Config
from hora.config.launchers import (
    AgentStore,
    block_cross,
    detect,
    expand_hostlist,
    parse_tasks_per_node,
    slurm_port,
)
from hora.errors import HoraInternalError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from netns_hosts import ensure_system  # noqa: E402
from slurm_cluster import SlurmCluster  # noqa: E402

PY = sys.executable
SECRET = "ab" * 32

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    if "no-mpi4py" in sys.argv:
        sys.modules["mpi4py"] = None  # as if mpi4py were not installed
    import numpy as np
    import hora.numpy as hvd
    from hora.config import Config

    hvd.init()
    total = hvd.allreduce(np.full(2, float(hvd.rank() + 1)), op=hvd.Sum, name="x")
    print(json.dumps({
        "rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "sum": total.tolist(),
        "launcher": Config.from_env().launcher, "mpi": "mpi4py.MPI" in sys.modules,
    }), flush=True)
    hvd.shutdown()
    """
)

LAUNCH_VARIABLES = ("HORA_", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "RANK", "WORLD_SIZE",
                    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "GROUP_RANK", "TORCHELASTIC")  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARIABLES)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def records(output: str, size: int) -> list[dict[str, object]]:
    found = {}
    # MPICH's mpiexec forwards ranks' output in chunks, so two records may share a line.
    for text in re.findall(r'\{"rank"[^{}]*\}', output):
        data = json.loads(text)
        found[int(data["rank"])] = data
    assert sorted(found) == list(range(size)), output
    return [found[rank] for rank in range(size)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def system() -> None:
    ensure_system()
    if subprocess.run([PY, "-c", "import mpi4py"], capture_output=True).returncode != 0:
        subprocess.run([PY, "-m", "pip", "install", "--quiet", "mpi4py==4.1.2"], check=True)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


OPENMPI = ["mpirun.openmpi", "--oversubscribe", "--allow-run-as-root", "-np", "3"]
OPENMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_btl": "self,tcp",
               "OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_oob_tcp_if_include": "lo"}  # fmt: skip


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def check_job(result: subprocess.CompletedProcess[str], size: int, launcher: str) -> list[dict[str, object]]:
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = records(result.stdout, size)
    total = float(size * (size + 1) // 2)
    for rank, data in enumerate(ranks):
        assert data["sum"] == [total, total] and data["size"] == size and data["launcher"] == launcher
        assert (data["local_rank"], data["local_size"], data["cross_rank"], data["cross_size"]) == (rank, size, 0, 1)
    return ranks


def test_openmpi_mpirun_rank_zero_shares_secret_and_address_through_mpi(
    system: None, script: Path, tmp_path: Path
) -> None:
    result = run([*OPENMPI, PY, str(script)], clean_env(**OPENMPI_ENV), tmp_path)
    ranks = check_job(result, 3, "openmpi")
    assert all(data["mpi"] for data in ranks)


def test_openmpi_with_secret_and_port_in_the_environment_needs_no_mpi4py(
    system: None, script: Path, tmp_path: Path
) -> None:
    env = clean_env(**OPENMPI_ENV, HORA_SECRET=SECRET, HORA_RENDEZVOUS_PORT=str(free_port()))
    command = [*OPENMPI, "-x", "HORA_SECRET", "-x", "HORA_RENDEZVOUS_PORT", PY, str(script), "no-mpi4py"]
    result = run(command, env, tmp_path)
    ranks = check_job(result, 3, "openmpi")
    assert not any(data["mpi"] for data in ranks)


def test_openmpi_without_secret_or_mpi4py_says_what_to_set(system: None, script: Path, tmp_path: Path) -> None:
    result = run([*OPENMPI, PY, str(script), "no-mpi4py"], clean_env(**OPENMPI_ENV), tmp_path)
    assert result.returncode != 0
    assert (
        "ValueError: 3 ranks started by mpirun, but HORA_SECRET is not set and mpi4py is not installed: "
        "pip install mpi4py (rank 0 then shares what is missing through MPI)"
    ) in result.stderr


@pytest.fixture(scope="module")
def mpich_env(system: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """mpi4py's wheel looks for MPICH's library as libmpi.so.12; Debian names it libmpich.so.12."""
    found = sorted(glob.glob("/usr/lib/*/libmpich.so.12"))
    assert found, "MPICH's libmpich.so.12 is missing (scripts/setup-system.sh installs mpich)"
    shim = tmp_path_factory.mktemp("mpich-lib")
    (shim / "libmpi.so.12").symlink_to(found[0])
    return {"MPI4PY_MPIABI": "mpich", "LD_LIBRARY_PATH": str(shim)}


def test_mpich_mpiexec(mpich_env: dict[str, str], script: Path, tmp_path: Path) -> None:
    result = run(["mpiexec.mpich", "-n", "3", PY, str(script)], clean_env(**mpich_env), tmp_path)
    ranks = check_job(result, 3, "mpich")
    assert all(data["mpi"] for data in ranks)


@pytest.mark.ranks
def test_torchrun_style_variables_set_by_hand(script: Path, tmp_path: Path) -> None:
    port = str(free_port())
    processes = [
        subprocess.Popen(
            [PY, str(script)],
            env=clean_env(RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=port, HORA_SECRET=SECRET),  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for rank in range(3)
    ]
    outputs = [process.communicate(timeout=60) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr
    check_job(subprocess.CompletedProcess([], 0, "".join(out for out, _ in outputs), ""), 3, "torchrun")


def test_torchrun_itself(system: None, script: Path, tmp_path: Path) -> None:
    torchrun = Path(PY).with_name("torchrun")
    if not torchrun.exists():
        pytest.fail("torchrun is missing: the test environment installs torch (requirements/frameworks.txt)")
    # Twice in one process: the second init() must meet at its own rank 0's new port, not the first's.
    twice = tmp_path / "twice.py"
    twice.write_text(SCRIPT.replace("hvd.init()", "hvd.init(); hvd.barrier(); hvd.shutdown(); hvd.init()"))
    # With the port after MASTER_PORT taken: hora no longer needs it (rank 0 publishes a free one).
    port = free_port()
    with socket.socket() as neighbour:
        try:
            neighbour.bind(("127.0.0.1", port + 1))
        except OSError:
            pass  # already taken by someone else: the same case
        neighbour.listen()
        result = run(
            [str(torchrun), "--nproc_per_node=2", f"--master_port={port}", "--no-python", PY, str(twice)],
            clean_env(HORA_SECRET=SECRET),
            tmp_path,
        )
    check_job(result, 2, "torchrun")


def test_torchrun_agent_store_carries_rank_0s_port() -> None:
    from torch.distributed import TCPStore

    from hora.core.bootstrap import _AgentStore

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    where = AgentStore("127.0.0.1", master.port, "/hora/attempt_0/rendezvous_port")
    rank0, rank1 = _AgentStore(where, 0, 5.0), _AgentStore(where, 1, 0.5)
    assert rank0.publish(41234) == 41234 and rank1.read() == 41234
    rank0.withdraw()  # every rank connected: a later init() waits for its own port
    with pytest.raises(HoraInternalError, match=r"rank 1 did not get rank 0's rendezvous port from torchrun's agent"):
        rank1.read()
    rank0.withdraw()  # twice (a failed start, then close) is harmless
    gone = AgentStore("127.0.0.1", free_port(), where.key)
    with pytest.raises(HoraInternalError, match=r"rank 2 cannot reach torchrun's agent store at 127\.0\.0\.1:"):
        _AgentStore(gone, 2, 0.5)


@pytest.fixture(scope="module")
def slurm(system: None) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster().up()
    try:
        yield cluster
    finally:
        cluster.down()


def test_slurm_srun(slurm: SlurmCluster, script: Path, tmp_path: Path) -> None:
    env = clean_env(HORA_SECRET=SECRET, SLURM_CONF=slurm.conf)
    result = run(["srun", "-n", "3", PY, str(script)], env, tmp_path)
    check_job(result, 3, "slurm")
    missing = run(["srun", "-n", "2", PY, str(script)], clean_env(SLURM_CONF=slurm.conf), tmp_path)
    assert missing.returncode != 0
    assert "2 ranks started by srun, but HORA_SECRET is not set" in missing.stderr


# --- the launchers' variables, from environments recorded under each launcher --------------------

OPENMPI_RECORDED = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "PMIX_RANK": "3"}  # fmt: skip
MPICH_RECORDED = {"PMI_RANK": "2", "PMI_SIZE": "3", "PMI_FD": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"}
# srun -N 3 -n 5 (block distribution) on node02, recorded on a three-node cluster.
SLURM_RECORDED = {
    "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "5", "SLURM_NTASKS": "5",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_STEP_NODELIST": "node[01-03]", "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "node02", "HORA_SECRET": SECRET,
}  # fmt: skip
# torchrun --nnodes 2 --nproc_per_node 2, rank 3, recorded on the second node.
TORCHRUN_RECORDED = {
    "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "ROLE_RANK": "3",
    "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node01", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "x", "HORA_SECRET": SECRET,
}  # fmt: skip


def topology(config: Config) -> tuple[int, ...]:
    t = config.topology
    return t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size


def test_recorded_openmpi_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "mpi4py_available", lambda: True)
    config = Config.from_env(OPENMPI_RECORDED)
    assert topology(config) == (3, 4, 1, 2, 1, 2)
    assert config.launcher == "openmpi" and config.host_rendezvous and config.mpi_bootstrap
    assert not config.exact_cross  # Open MPI does not name the node: hora assumes blocks and checks later
    env = dict(OPENMPI_RECORDED, HORA_SECRET=SECRET, MASTER_ADDR="10.0.0.1", MASTER_PORT="5000")
    config = Config.from_env(env)
    assert not config.mpi_bootstrap and (config.rendezvous_addr, config.rendezvous_port) == ("10.0.0.1", 5000)


def test_recorded_mpich_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "mpi4py_available", lambda: False)
    env = dict(MPICH_RECORDED, HORA_SECRET=SECRET, HORA_RENDEZVOUS_PORT="5001")
    config = Config.from_env(env)
    assert topology(config) == (2, 3, 2, 3, 0, 1) and config.launcher == "mpich"
    # Every rank on one host: rank 0 hosts on loopback, nothing to share through MPI.
    assert (config.rendezvous_addr, config.rendezvous_port, config.mpi_bootstrap) == ("127.0.0.1", 5001, False)


def test_recorded_slurm_environment() -> None:
    config = Config.from_env(SLURM_RECORDED)
    assert topology(config) == (3, 5, 1, 2, 1, 2) and config.exact_cross
    assert config.launcher == "slurm" and config.topology.hostname == "node02"
    assert (config.rendezvous_addr, config.rendezvous_port) == ("node01", slurm_port(4242, 0))
    # The rank on node03 (local rank 0 of 1) is the third host with a local rank 0.
    third = dict(SLURM_RECORDED, SLURM_PROCID="4", SLURM_LOCALID="0", SLURM_NODEID="2")
    assert topology(Config.from_env(third)) == (4, 5, 0, 1, 2, 3)
    # A batch script (no srun step) is one process, not a job of SLURM_NTASKS ranks.
    batch = {k: v for k, v in SLURM_RECORDED.items() if not k.startswith("SLURM_STEP")}
    assert Config.from_env(batch).topology.size == 1


def test_recorded_torchrun_environment() -> None:
    config = Config.from_env(TORCHRUN_RECORDED)
    assert topology(config) == (3, 4, 1, 2, 1, 2) and config.launcher == "torchrun"
    # torchrun's agent serves its own store on MASTER_PORT: rank 0 publishes its own port there.
    assert (config.rendezvous_addr, config.rendezvous_port) == ("node01", None)
    assert config.agent_store == AgentStore("node01", 29500, "/hora/attempt_0/rendezvous_port")
    restarted = Config.from_env(dict(TORCHRUN_RECORDED, TORCHELASTIC_RESTART_COUNT="2"))
    assert restarted.agent_store is not None and restarted.agent_store.key == "/hora/attempt_2/rendezvous_port"
    named = Config.from_env(dict(TORCHRUN_RECORDED, HORA_RENDEZVOUS_PORT="5005"))  # a port named for hora wins
    assert (named.rendezvous_port, named.agent_store) == (5005, None)
    operator = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
                "HORA_SECRET": SECRET}  # fmt: skip
    config = Config.from_env(operator)  # a Kubernetes operator: one process per pod, no local variables
    assert topology(config) == (1, 3, 0, 1, 1, 3) and config.rendezvous_port == 23456


def test_horarun_variables_win_over_a_launcher_around_it() -> None:
    env = dict(OPENMPI_RECORDED, HORA_RANK="0", HORA_SIZE="1")
    assert Config.from_env(env).launcher == "horarun"
    assert Config.from_env({}).launcher == "none"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
         "2 ranks started by a torchrun-style launcher, but HORA_SECRET is not set: every rank needs the same job "
         "secret; export HORA_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')"),
        ({"RANK": "0", "WORLD_SIZE": "2", "HORA_SECRET": SECRET},
         "2 ranks started by a torchrun-style launcher, but MASTER_ADDR and MASTER_PORT are not set: rank 0 hosts "
         "hora's rendezvous there"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "node1", "MASTER_PORT": "1",
          "HORA_SECRET": SECRET},
         "LOCAL_RANK is set but LOCAL_WORLD_SIZE is not, and MASTER_ADDR is not a loopback address: set "
         "LOCAL_WORLD_SIZE"),
        ({"RANK": "5", "WORLD_SIZE": "2"}, "the rank 5 is not below its size 2"),
        ({"SLURM_PROCID": "x", "SLURM_STEP_NUM_TASKS": "2"}, "SLURM_PROCID='x' is not valid: expected an integer"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2(3)"},
         "SLURM_TASKS_PER_NODE='2(3)' is not valid"),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "MASTER_PORT": "70000"},
         "MASTER_PORT='70000' is not valid: expected an integer in [1, 65535]"),
    ],
)  # fmt: skip
def test_launcher_errors_name_the_variables_and_the_fix(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        Config.from_env(env)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_mpirun_without_secret_or_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "mpi4py_available", lambda: False)
    with pytest.raises(ValueError) as info:
        Config.from_env(OPENMPI_RECORDED)
    assert "4 ranks started by mpirun, but HORA_SECRET is not set and mpi4py is not installed" in str(info.value)
    with pytest.raises(ValueError) as info:
        Config.from_env(dict(OPENMPI_RECORDED, HORA_SECRET=SECRET))
    assert "HORA_RENDEZVOUS_ADDR and HORA_RENDEZVOUS_PORT (or MASTER_ADDR and MASTER_PORT) are not set" in str(
        info.value
    )


def test_secret_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
           "HORA_SECRET_FILE": str(path)}  # fmt: skip
    assert Config.from_env(env).secret == bytes.fromhex(SECRET)
    with pytest.raises(ValueError, match="HORA_SECRET_FILE=/nonexistent: cannot read the job secret"):
        Config.from_env(dict(env, HORA_SECRET_FILE="/nonexistent"))


def test_slurm_hostlists_and_task_counts() -> None:
    assert expand_hostlist("node[01-03,7],login,gpu[8-9]-ib") == [
        "node01", "node02", "node03", "node7", "login", "gpu8-ib", "gpu9-ib"
    ]  # fmt: skip
    assert expand_hostlist("a") == ["a"]
    with pytest.raises(ValueError, match="unbalanced"):
        expand_hostlist("node[1-2")
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert 20000 <= slurm_port(123, 4) < 40000 and slurm_port(123, 4) != slurm_port(123, 5)


def test_block_cross_and_topology_from_hosts() -> None:
    assert [block_cross(rank, 5, rank % 2, 2) for rank in range(5)] == [(0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]
    hosts = ["a", "a", "b", "b", "c"]
    assert [topology_from_hosts(hosts, rank) for rank in range(5)] == [
        (0, 2, 0, 3), (1, 2, 0, 2), (0, 2, 1, 3), (1, 2, 1, 2), (0, 1, 2, 3)
    ]  # fmt: skip


@pytest.mark.ranks
def test_check_build_reports_what_is_there() -> None:
    result = subprocess.run([PY, "-m", "hora.runner", "--check-build"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("hora v") and "Available Frameworks:" in out and "[X] NumPy" in out
    assert "Available Transports:" in out and "[X] TCP" in out and "NCCL" in out
    assert "Available Launchers:" in out and "[X] horarun on this machine" in out and "torchrun-style" in out
    # make test installs every integration (requirements/integrations.txt)
    assert "Available Integrations:" in out
    for integration in ("Ray", "Spark", "Lightning"):
        assert f"[X] {integration} " in out and f"(hora.{integration.lower()})" in out, out
    assert subprocess.run([PY, "-m", "hora.runner", "-cb"], capture_output=True, text=True).stdout == out


def test_topology_from_the_hosts_ranks_report() -> None:
    from hora.core.bootstrap import topology_from_hosts

    # mpirun -H a:2,b:1 -np 3: rank 2 is alone on host b, the second host with a local rank 0.
    assert topology_from_hosts(["a", "a", "b"], 2) == (0, 1, 1, 2)
    assert topology_from_hosts(["a", "a", "b"], 1) == (1, 2, 0, 1)
    assert topology_from_hosts(["a", "b", "a", "b"], 3) == (1, 2, 1, 2)
