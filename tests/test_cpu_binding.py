"""``horarun --bind-to core``: which CPUs each local rank gets, and that ranks really run there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hora.runner import cpu_binding

PY = sys.executable


def test_whole_cores_split_into_contiguous_blocks() -> None:
    cores = [[c] for c in range(8)]
    assert [cpu_binding.block(r, 2, cores) for r in range(2)] == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    # Uneven: the first ranks get one core more, blocks stay contiguous and cover every core.
    assert [cpu_binding.block(r, 3, cores) for r in range(3)] == [{0, 1, 2}, {3, 4, 5}, {6, 7}]
    assert cpu_binding.block(0, 1, cores) == set(range(8))


def test_hyperthreads_of_a_core_stay_together_until_ranks_outnumber_cores() -> None:
    # Linux numbers siblings apart: CPUs 0-3 are the first threads of cores 0-3, 4-7 the second.
    topology = {cpu: (0, cpu % 4) for cpu in range(8)}
    cores = cpu_binding.cores(range(8), topology.__getitem__)
    assert cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [cpu_binding.block(r, 2, cores) for r in range(2)] == [{0, 4, 1, 5}, {2, 6, 3, 7}]
    # Six ranks on four cores: hardware threads in core order, the first two ranks get two.
    assert [cpu_binding.block(r, 6, cores) for r in range(6)] == [{0, 4}, {1, 5}, {2}, {6}, {3}, {7}]
    assert cpu_binding.block(0, 9, cores) is None  # more ranks than CPUs: unbound


def test_cores_of_two_packages_and_unknown_topology() -> None:
    topology = {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)}  # core 0 exists in both packages
    assert cpu_binding.cores([0, 1, 2, 3], topology.__getitem__) == [[0], [1], [2], [3]]
    assert cpu_binding.cores([3, 1], lambda cpu: (-1, -1)) == [[1], [3]]  # unknown: one core per CPU


def test_the_variable_is_checked_and_needs_the_topology() -> None:
    assert not cpu_binding.requested({})
    assert cpu_binding.preexec({"HORA_BIND_TO": "none"}) is None
    assert cpu_binding.requested({"HORA_BIND_TO": "CORE"})
    with pytest.raises(ValueError, match="HORA_BIND_TO='socket' is not valid: expected one of none, core"):
        cpu_binding.requested({"HORA_BIND_TO": "socket"})
    with pytest.raises(ValueError, match="needs HORA_LOCAL_RANK and HORA_LOCAL_SIZE"):
        cpu_binding.rank_cpus({"HORA_BIND_TO": "core"})
    with pytest.raises(ValueError, match="local rank 2 is not in"):
        cpu_binding.block(2, 2, [[0], [1]])


AFFINITY = "import json, os; print(json.dumps(sorted(os.sched_getaffinity(0))))"
# A rank's child (a thread pool, a data loader worker) inherits the binding.
CHILD = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {AFFINITY!r}], check=True)"


def horarun(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HORA_BIND_TO"}
    return subprocess.run([PY, "-m", "hora.runner", *args], capture_output=True, text=True, env=env, timeout=60)


def affinities(stdout: str) -> dict[int, list[int]]:
    found = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition("]<stdout>:")
        found[int(prefix.lstrip("["))] = json.loads(rest)
    return found


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_each_local_rank_and_its_children_run_on_their_own_cores() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs")
    result = horarun("-np", "2", "--bind-to", "core", PY, "-c", CHILD)
    assert result.returncode == 0, result.stderr
    expected = cpu_binding.cores(allowed)
    ranks = affinities(result.stdout)
    assert ranks == {r: sorted(cpu_binding.block(r, 2, expected) or ()) for r in range(2)}
    assert not set(ranks[0]) & set(ranks[1]) and sorted(ranks[0] + ranks[1]) == allowed
    # Unbound by default, and with more ranks than CPUs (said on stderr).
    assert affinities(horarun("-np", "2", PY, "-c", AFFINITY).stdout) == {0: allowed, 1: allowed}
    many = len(allowed) + 1
    result = horarun("-np", str(many), "--bind-to", "core", PY, "-c", AFFINITY)
    assert result.returncode == 0, result.stderr
    assert affinities(result.stdout) == {r: allowed for r in range(many)}
    assert f"--bind-to core: {many} ranks on this host but {len(allowed)} CPUs; its ranks are left unbound" in (
        result.stderr
    )
    env = {**os.environ, "HORA_BIND_TO": "socket"}
    bad = subprocess.run([PY, "-m", "hora.runner", "-np", "1", PY, "-c", "pass"], capture_output=True, text=True,
                         env=env, timeout=60)  # fmt: skip
    assert bad.returncode != 0 and "HORA_BIND_TO='socket' is not valid: expected one of none, core" in bad.stderr
