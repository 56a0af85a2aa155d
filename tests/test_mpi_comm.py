"""mpi4py communicators as Horovod takes them, under real Open MPI mpirun: ``init(comm=...)``
with the whole world and with sub-communicators (each a job of its own, over hora's own
transport and over MPI's), and ``ProcessSet(comm)`` registered as Horovod registers it
(Horovod's test_process_sets_multi_comm.py scenario, its ids and its duplicates); and a
program that turned mpi4py's initialisation of MPI off, as Horovod's tests do.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from test_launch import OPENMPI_ENV, PY, clean_env, free_port, run
from test_launch import system as system  # noqa: F401 - the fixture that installs Open MPI and mpi4py
from test_mpi_transport import records

pytestmark = pytest.mark.ranks

OVER_COMMS = textwrap.dedent(
    """
    import json
    import numpy as np
    from mpi4py import MPI
    import hora.numpy as hvd

    world = MPI.COMM_WORLD
    me, n = world.Get_rank(), world.Get_size()
    seen = {"rank": me}
    hvd.init(comm=world)
    seen["whole"] = [hvd.rank(), hvd.size(), hvd.global_process_set.mpi_comm is world,
                     hvd.allreduce(np.array([me]), op=hvd.Sum, name="whole").tolist()]
    hvd.shutdown()
    # Two jobs in one mpirun, numbered backwards by the communicator.
    sub = world.Split(color=me % 2, key=n - me)
    hvd.init(comm=sub)
    seen["sub"] = [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_size(),
                   hvd.allgather(np.array([me]), name="members").tolist(),
                   hvd.allreduce(np.array([me]), op=hvd.Sum, name="total").tolist(),
                   hvd.broadcast(np.array([me]), root_rank=0, name="root").tolist()]
    hvd.shutdown()
    try:
        hvd.init(comm=42)
    except ValueError as exc:
        seen["bad"] = str(exc)
    print(json.dumps(seen), flush=True)
    """
)


@pytest.mark.parametrize(("size", "transport"), [(3, "builtin"), (4, "builtin"), (3, "mpi")])
@pytest.mark.timeout(150)
def test_init_over_the_world_and_over_sub_communicators(
    system: None, tmp_path: Path, size: int, transport: str
) -> None:
    job = tmp_path / "job.py"
    job.write_text(OVER_COMMS)
    argv = ["mpirun.openmpi", "--oversubscribe", "--allow-run-as-root", "-np", str(size), PY, str(job)]
    result = run(argv, clean_env(HORA_TRANSPORT=transport, **OPENMPI_ENV), tmp_path, timeout=140)
    assert result.returncode == 0, result.stdout + result.stderr
    for me, seen in enumerate(records(result.stdout, size)):
        assert seen["whole"] == [me, size, True, [size * (size - 1) // 2]]
        members = sorted((r for r in range(size) if r % 2 == me % 2), reverse=True)  # key n - rank: backwards
        rank, sub_size, local_rank, local_size, cross_size, gathered, total, root = seen["sub"]
        assert (rank, sub_size, local_rank, local_size, cross_size) == (members.index(me), len(members),
                                                                         members.index(me), len(members), 1)
        assert gathered == members and total == [sum(members)] and root == [members[0]]
        assert "expected a list of rank integers or an mpi4py.MPI.Comm object" in seen["bad"]


SETS = textwrap.dedent(
    """
    import json
    import numpy as np
    from mpi4py import MPI
    import hora.numpy as hvd
    from hora.core.api import current

    world = MPI.COMM_WORLD
    me, n = world.Get_rank(), world.Get_size()
    seen = {"rank": me, "errors": []}

    def fails(sets):
        try:
            hvd.init(comm=world, process_sets=sets)
        except ValueError as exc:
            seen["errors"].append(str(exc))
            return True
        return False

    try:
        hvd.init(process_sets=[hvd.ProcessSet(world)])
    except NotImplementedError as exc:
        seen["no_comm"] = str(exc)
    hvd.shutdown()
    parity = world.Split(color=me % 2, key=me)
    evens = hvd.ProcessSet(range(0, n, 2))
    # As in Horovod's test: a duplicate of the global set or of another entry fails on every rank.
    seen["dups"] = [fails([hvd.ProcessSet(parity), hvd.ProcessSet(world.Dup()), hvd.ProcessSet([0])]),
                    fails([hvd.ProcessSet(parity), evens, hvd.ProcessSet([0])])]
    mine = [hvd.ProcessSet(parity)] + ([hvd.ProcessSet([0])] if n > 2 else [])  # at 2 ranks, [0] is evens
    hvd.init(comm=world, process_sets=mine)  # running: binds the entries to the registered sets
    table = current().engine.sets
    seen["table"] = [list(table.ranks(i)) for i in table.ids()]  # by id (records() reads flat objects)
    seen["mine"] = [mine[0].process_set_id, mine[0].ranks, mine[0].size(), mine[0].rank()]
    seen["sum"] = hvd.allreduce(np.array([me]), op=hvd.Sum, name="parity", process_set=mine[0]).tolist()
    seen["initialized"] = hvd.is_initialized()
    hvd.shutdown()
    # The ranks must agree on how many communicator-defined sets they give: no MPI gathering hangs.
    extra = [hvd.ProcessSet(parity)] if me == 0 else []
    try:
        hvd.init(comm=world, process_sets=[hvd.ProcessSet(world.Dup())] + extra)
    except ValueError as exc:
        seen["counts"] = str(exc)
    hvd.shutdown()
    hvd.init(comm=world, process_sets="dynamic")
    try:
        hvd.add_process_set(hvd.ProcessSet(parity))
    except NotImplementedError as exc:
        seen["dynamic"] = str(exc)
    hvd.shutdown()
    print(json.dumps(seen), flush=True)
    """
)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.timeout(150)
def test_process_sets_from_communicators(system: None, tmp_path: Path, size: int) -> None:
    job = tmp_path / "job.py"
    job.write_text(SETS)
    argv = ["mpirun.openmpi", "--oversubscribe", "--allow-run-as-root", "-np", str(size), PY, str(job)]
    result = run(argv, clean_env(**OPENMPI_ENV), tmp_path, timeout=140)
    assert result.returncode == 0, result.stdout + result.stderr
    evens, odds = list(range(0, size, 2)), list(range(1, size, 2))
    for me, seen in enumerate(records(result.stdout, size)):
        assert "need hvd.init(comm=<an mpi4py communicator>)" in seen["no_comm"]
        # Horovod's outcome: the even ranks' communicator repeats `evens`; on odd ranks it does
        # not, unless [0] (registered) is evens itself (2 ranks).
        assert seen["dups"] == [True, size == 2 or me % 2 == 0], seen["errors"]
        assert "process_sets entry number 1 is a duplicate" in seen["errors"][0]
        assert seen["table"] == [list(range(size)), evens, odds] + ([[0]] if size > 2 else [])
        members = evens if me % 2 == 0 else odds
        assert seen["mine"] == [1 if me % 2 == 0 else 2, members, len(members), members.index(me)]
        assert seen["sum"] == [sum(members)] and seen["initialized"]
        assert "the ranks give different numbers of process sets from communicators" in seen["counts"]
        assert "rank 0: 2, rank 1: 1" in seen["counts"]
        assert "Dynamically adding process sets defined by an MPI communicator" in seen["dynamic"]



UNINITIALIZED = textwrap.dedent(
    """
    import json
    import mpi4py
    mpi4py.rc.initialize = False  # as Horovod's tests: the library initialises MPI
    from mpi4py import MPI  # imported, not initialised: hora must not call it then
    import numpy as np
    import hora.numpy as hvd

    hvd.init(process_sets=[hvd.ProcessSet([0])])
    total = hvd.allreduce(np.array([hvd.rank()]), op=hvd.Sum, name="total").tolist()
    print(json.dumps({"rank": hvd.rank(), "total": total}), flush=True)
    hvd.shutdown()
    """
)


@pytest.mark.parametrize("transport", ["builtin", "mpi", "builtin, secret and port given"])
@pytest.mark.timeout(120)
def test_mpi_left_uninitialized_by_the_program(system: None, tmp_path: Path, transport: str) -> None:
    # hora initialises MPI itself, as Horovod does, and finalises it at exit; before, the
    # secret's broadcast called MPI before MPI_Init and Open MPI aborted every rank. With the
    # secret and port given nothing needs MPI, and hora must not touch it (registering a
    # process set once asked MPI's world for its rank, and Open MPI aborted the rank).
    job = tmp_path / "job.py"
    job.write_text(UNINITIALIZED)
    argv = ["mpirun.openmpi", "--oversubscribe", "--allow-run-as-root", "-np", "3", PY, str(job)]
    given = {"HORA_SECRET": "ab" * 32, "HORA_RENDEZVOUS_PORT": str(free_port())} if "given" in transport else {}
    env = clean_env(HORA_TRANSPORT=transport.split(",")[0], **given, **OPENMPI_ENV)
    result = run(argv, env, tmp_path, timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [seen["total"] for seen in records(result.stdout, 3)] == [[3]] * 3
