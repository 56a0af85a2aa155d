"""MPI as the data plane (HORA_TRANSPORT=mpi): real Open MPI mpirun, and horarun --mpi.

Every collective's result is checked against NumPy on every rank, as in
test_collectives.py; only the transport differs.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from test_launch import OPENMPI_ENV, PY, clean_env, run
from test_launch import system as system  # noqa: F401 - the fixture that installs Open MPI and mpi4py

TESTS = Path(__file__).resolve().parent

JOB = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from data import ALL, FLOATS, INTS, make, tolerance
    import hora.numpy as hvd
    from hora.core.api import current

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    problems = []

    def check(case, got, want, dtype):
        ok = got.shape == want.shape and (
            np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tolerance(dtype), atol=tolerance(dtype))
            if dtype.kind == "f" or dtype.name == "bfloat16" else np.array_equal(got, want.astype(dtype)))
        if not ok:
            problems.append(f"{case}: got {got.reshape(-1)[:4]} want {want.reshape(-1)[:4]}")

    for dtype in ALL:
        inputs = [make(dtype, r, (5, 3)) for r in range(n)]
        wide = np.stack([x.astype(np.float64) if dtype.kind == "f" or dtype.name == "bfloat16" else x for x in inputs])
        ops = {"Sum": hvd.Sum, "Max": hvd.Max} if dtype != np.bool_ else {"Sum": hvd.Sum, "Min": hvd.Min}
        for name, op in ops.items():
            if dtype == np.bool_:
                want = wide.any(0) if name == "Sum" else wide.all(0)
            else:
                want = wide.sum(0) if name == "Sum" else wide.max(0)
            check(f"allreduce {dtype} {name}", hvd.allreduce(inputs[me], op=op, name=f"ar {dtype} {name}"), want, dtype)
        check(f"broadcast {dtype}", hvd.broadcast(inputs[me], root_rank=n - 1, name=f"bc {dtype}"), inputs[n - 1], dtype)
        pieces = [make(dtype, r, (r + 1, 2)) for r in range(n)]
        check(f"allgather {dtype}", hvd.allgather(pieces[me], name=f"ag {dtype}"), np.concatenate(pieces), dtype)
        rows = [make(dtype, r, (2 * n, 2), 7) for r in range(n)]
        want = np.concatenate([rows[r][2 * me : 2 * me + 2] for r in range(n)])
        check(f"alltoall {dtype}", hvd.alltoall(rows[me], name=f"a2a {dtype}"), want, dtype)
    for dtype in FLOATS + INTS:
        inputs = [make(dtype, r, (2 * n + 1, 3), 3) for r in range(n)]
        total = np.stack([x.astype(np.float64) for x in inputs]).sum(0)
        q, m = divmod(2 * n + 1, n)
        start = me * q + min(me, m)
        got = hvd.reducescatter(inputs[me], op=hvd.Sum, name=f"rs {dtype}")
        check(f"reducescatter {dtype}", got, total[start : start + q + (me < m)], dtype)
    if n & (n - 1) == 0:
        e = np.zeros(n)
        e[me] = 1.0
        check("adasum", hvd.allreduce(e, op=hvd.Adasum, name="adasum"), np.ones(n), np.dtype(np.float64))
    # A process set gets a communicator of its own, after a re-init.
    hvd.shutdown()
    evens = hvd.ProcessSet([r for r in range(n) if r % 2 == 0])
    hvd.init(process_sets=[evens])
    if evens.included():
        got = hvd.allreduce(np.ones(2), op=hvd.Sum, name="evens", process_set=evens)
        check("process set", got, np.full(2, float(evens.size())), np.dtype(np.float64))
    label = current().engine.stats().algorithm
    print(json.dumps({"rank": me, "problems": problems, "collectives": label}), flush=True)
    hvd.shutdown()
    """
)


def records(output: str, size: int) -> list[dict]:
    found = {}
    # mpirun interleaves the ranks' output in chunks: two records may share a line.
    for text in re.findall(r'\{"rank"[^{}]*\}', output):
        data = json.loads(text)
        found[int(data["rank"])] = data
    assert sorted(found) == list(range(size)), output
    return [found[r] for r in range(size)]


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.timeout(180)
def test_collectives_over_mpi(system: None, tmp_path: Path, size: int) -> None:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    argv = ["mpirun.openmpi", "--oversubscribe", "--allow-run-as-root", "-np", str(size), PY, str(job), str(TESTS)]
    result = run(argv, clean_env(HORA_TRANSPORT="mpi", **OPENMPI_ENV), tmp_path, timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    for data in records(result.stdout, size):
        assert data["problems"] == [], data
        assert data["collectives"] == "MpiCollectives"


@pytest.mark.timeout(120)
def test_horarun_mpi_starts_the_job_with_mpirun(system: None, tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(
        "import numpy as np, hora.numpy as hvd\n"
        "from hora.core.api import current\n"
        "hvd.init()\n"
        "total = hvd.allreduce(np.ones(3) * (hvd.rank() + 1), op=hvd.Sum)\n"
        "print(hvd.rank(), hvd.size(), total.tolist(), current().engine.stats().algorithm)\n"
        "print('flags', hvd.mpi_enabled(), hvd.gloo_enabled(), hvd.mpi_built(), hvd.mpi_threads_supported())\n"
    )
    env = clean_env(**OPENMPI_ENV)
    del env["PYTHONUNBUFFERED"]  # mpirun tags each chunk a rank writes: let Python write whole lines
    result = run([PY, "-m", "hora.runner", "--mpi", "-np", "2", "--verbose", PY, str(job)], env, tmp_path, timeout=110)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if "<stdout>:" in line)
    assert lines == [
        "[1,0]<stdout>:0 2 [3.0, 3.0, 3.0] MpiCollectives",
        "[1,0]<stdout>:flags True False True True",  # mpi4py initialises MPI for any thread
        "[1,1]<stdout>:1 2 [3.0, 3.0, 3.0] MpiCollectives",
        "[1,1]<stdout>:flags True False True True",
    ], result.stdout
    # The secret reaches the ranks by name: never on mpirun's command line.
    command = next(line for line in result.stderr.splitlines() if line.startswith("horarun: "))
    assert "-x HORA_SECRET" in command and "HORA_SECRET=" not in command


def test_the_mpirun_command_line() -> None:
    from hora.runner.hosts import plan
    from hora.runner.mpi_launch import mpirun_command
    from hora.runner.settings import LaunchSettings

    settings = LaunchSettings(command=("python", "train.py"), num_proc=4, hosts="a:2,b:2")
    slots = plan(4, "a:2,b:2", None)
    openmpi = mpirun_command("/usr/bin/mpirun", "openmpi", settings, slots, ["HORA_SECRET", "PATH"], "-mca btl tcp,self")
    assert openmpi == [
        "/usr/bin/mpirun", "--allow-run-as-root", "--oversubscribe", "--tag-output", "-np", "4", "-H", "a:2,b:2",
        "-bind-to", "none", "-map-by", "slot", "-x", "HORA_SECRET", "-x", "PATH", "-mca", "btl", "tcp,self",
        "python", "train.py",
    ]  # fmt: skip
    mpich = mpirun_command("/usr/bin/mpiexec", "mpich", settings, slots, ["HORA_SECRET", "PATH"])
    assert mpich == [
        "/usr/bin/mpiexec", "-n", "4", "-prepend-rank", "-hosts", "a:2,b:2", "-genvlist", "HORA_SECRET,PATH",
        "python", "train.py",
    ]  # fmt: skip


FAILING_JOB = textwrap.dedent(
    """
    import os, signal, sys, time
    import numpy as np
    import hora.numpy as hvd
    from hora.engine.mpi_collectives import MpiThread

    how = sys.argv[1]
    hvd.init()
    data = np.ones(4 << 20, np.float32)
    hvd.allreduce_(data, name="warm-up")
    if hvd.rank() == 1:  # stopped while the others are inside the next allreduce's MPI call
        calls = []
        original = MpiThread.run

        def run(self, call, watch, peers):
            calls.append(1)
            if len(calls) == 1:
                os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            return original(self, call, watch, peers)

        MpiThread.run = run
    start = time.monotonic()
    try:
        for i in range(5):
            hvd.allreduce_(data, name=f"step {i}")
    except hvd.HoraInternalError as exc:
        line = f"rank {hvd.rank()} after {time.monotonic() - start:.1f} s: HoraInternalError: {exc}"
        print(line, flush=True)
        # mpirun may end before it forwards a rank's output once another rank aborted: a
        # file of the rank's own keeps what it said.
        with open(f"rank{hvd.rank()}.txt", "w") as out:
            out.write(line)
            out.flush()
            os.fsync(out.fileno())
        sys.exit(3)  # at exit hora calls MPI_Abort: the abandoned collective cannot finish
    print(f"rank {hvd.rank()}: no error", flush=True)
    """
)


@pytest.mark.parametrize("how", ["kill", "freeze"])
@pytest.mark.timeout(120)
def test_a_rank_lost_or_frozen_inside_an_mpi_collective_ends_the_job(system: None, tmp_path: Path, how: str) -> None:
    job = tmp_path / "job.py"
    job.write_text(FAILING_JOB)
    argv = ["mpirun.openmpi", "--oversubscribe", "--allow-run-as-root", "-np", "3", PY, str(job), how]
    env = clean_env(
        HORA_TRANSPORT="mpi", HORA_STALL_CHECK_TIME_SECONDS="1", HORA_STALL_SHUTDOWN_TIME_SECONDS="3", **OPENMPI_ENV
    )
    result = run(argv, env, tmp_path, timeout=100)  # a hang fails here
    assert result.returncode != 0
    if how == "freeze":
        # MPI does not notice a stopped process: hora's stall clock in the wait does (a rank
        # names the set's other ranks, MPI does not say which one stopped; rank 0's probe
        # names the one that answers no ping).
        for rank in (0, 2):
            said = tmp_path / f"rank{rank}.txt"
            line = said.read_text() if said.exists() else ""
            assert "HoraInternalError" in line and "stopped making progress" in line, result.stdout + result.stderr
            assert re.search(r"rank\(s\) [\d, ]*\b1\b", line), line
