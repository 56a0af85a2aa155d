"""Collectives across hosts on shaped links: network-namespace hosts (scripts/netns_hosts.py) whose
links ``tc ... tbf`` limits to 1 Gbit/s each way, as benchmarks/cluster.py measures them.

Also hora-bench's peers on the same hosts (``hora-bench -H ... --peers torch-gloo,mpi4py``:
checked results, nothing left running on the hosts afterwards) and benchmarks/training.py's
``--cluster`` mode (one tiny round of hora and DDP on 2 hosts it brings up itself).

Timing-free: every job checks results only. An 8 MiB tensor takes ~0.1 s at 1 Gbit/s,
long enough that the filters hold packets back (TCP meets a link slower than the machine),
which the small tensors alone would not. Needs root (network namespaces) and ``tc``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from netns_hosts import Cluster, ensure_system, parse_rate, run, tbf_parameters  # noqa: E402

pytestmark = pytest.mark.system

PY = sys.executable
RATE = "1gbit"

# Each collective on small tensors and on one of 8 MiB, on rank-dependent data; prints what
# differed from the known answer (nothing when all is right).
RANK = textwrap.dedent(
    """
    import json
    import numpy as np
    import hora.numpy as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    wrong = []

    def check(what, got, expected):
        if got.shape != expected.shape or not np.array_equal(got, expected):
            wrong.append(f"{what}: rank {rank} got {got.ravel()[:4]}... expected {expected.ravel()[:4]}...")

    ranks_sum = size * (size + 1) / 2
    for count in (1, 3, 1000, 2 * 1024 * 1024 + 5):  # the last: 8 MiB of float32, split unevenly
        base = np.arange(count, dtype=np.float32) % 7
        check(f"allreduce {count}",
              hvd.allreduce(base * (rank + 1), op=hvd.Sum, name=f"ar{count}"), base * ranks_sum)
        rows = [count // size + r for r in range(size)]  # each rank its own number of rows
        check(f"allgather {count}",
              hvd.allgather(np.full((rows[rank], 2), rank + 1, dtype=np.int32), name=f"ag{count}"),
              np.concatenate([np.full((rows[r], 2), r + 1, dtype=np.int32) for r in range(size)]))
        root = size - 1
        check(f"broadcast {count}",
              hvd.broadcast(base + rank, root_rank=root, name=f"bc{count}"), base + root)
        per = max(1, count // size)
        data = (np.arange(size * per, dtype=np.float32) % 11).reshape(size * per, 1)
        check(f"reducescatter {count}",
              hvd.reducescatter(data * (rank + 1), op=hvd.Sum, name=f"rs{count}"),
              (data * ranks_sum)[rank * per:(rank + 1) * per])
    print(json.dumps({"rank": rank, "size": size, "host": hvd.cross_rank(), "wrong": wrong}))
    hvd.shutdown()
    """
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ensure_system()
    hosts = Cluster(4, rate=RATE).up()
    try:
        yield hosts
    finally:
        hosts.down()


def test_rates_and_filter_parameters() -> None:
    assert parse_rate("1gbit") == 1e9 and parse_rate("500Mbit") == 5e8 and parse_rate("100mbps") == 8e8
    assert tbf_parameters("1gbit") == ["tbf", "rate", "1gbit", "burst", "125000", "latency", "50ms"]
    assert tbf_parameters("10gbit")[4] == "1250000"  # 1 ms of the link
    assert tbf_parameters("10mbit")[4] == str(64 * 1024)  # but at least 64 KiB
    for bad in ("fast", "1gb", "0gbit", ""):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)
    with pytest.raises(ValueError, match="rate 'fast'"):
        Cluster(2, rate="fast")


@pytest.mark.parametrize(("hosts", "slots"), [(2, 1), (3, 1), (4, 1), (2, 2)])
def test_collectives_on_shaped_links(cluster: Cluster, tmp_path: Path, hosts: int, slots: int) -> None:
    for host in cluster.hosts:  # both ends of each host's link are shaped
        for namespace, device in ((host.namespace, "eth0"), (cluster.switch, f"p{host.index}s0")):
            shown = run(["tc", "qdisc", "show", "dev", device], namespace=namespace).stdout
            assert "tbf" in shown and "rate 1Gbit" in shown, (namespace, device, shown)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    spec = ",".join(f"{host.address}:{slots}" for host in cluster.hosts[:hosts])
    held = cluster.qdisc_stats()["overlimits"]
    result = subprocess.run(
        [PY, "-m", "hora.runner", "-np", str(hosts * slots), "-H", spec, PY, str(script)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env=dict(os.environ, HORA_SSH_OPTIONS=cluster.ssh_options(), HORA_START_TIMEOUT="60"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = {}
    for line in result.stdout.splitlines():
        _, _, rest = line.partition(">:")
        if rest.startswith("{"):
            data = json.loads(rest)
            found[data["rank"]] = data
    assert sorted(found) == list(range(hosts * slots)), result.stdout[-3000:]
    assert {data["host"] for data in found.values()} == set(range(hosts))
    assert all(not data["wrong"] for data in found.values()), [data["wrong"] for data in found.values()]
    stats = cluster.qdisc_stats()
    assert stats["overlimits"] > held, stats  # the links, not the machine, set the pace at some point


def _leftovers(cluster: Cluster) -> list[str]:
    """Processes other than sshd still running on any host."""
    return [line for host in cluster.hosts for line in cluster.processes(host)]


def test_bench_peers_across_hosts(cluster: Cluster, tmp_path: Path) -> None:
    """hora-bench -H runs hora, torch-gloo and mpi4py on 2 shaped hosts with checked results, and leaves
    nothing running on the hosts."""
    pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    spec = ",".join(f"{host.address}:1" for host in cluster.hosts[:2])
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [PY, "-m", "hora.bench", "-H", spec, "--network-interfaces", "eth0", "--peers", "torch-gloo,mpi4py",
         "--collective", "allreduce,allgather,broadcast", "--sizes", "4,1M", "-c", "1", "-n", "3", "-w", "1",
         "--latency", "0", "--wait-test", "0", "--timeout", "120", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=dict(os.environ, HORA_SSH_OPTIONS=cluster.ssh_options(), HORA_START_TIMEOUT="60"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads(out.read_text())
    assert document["world_size"] == 2
    assert set(document["backends"]) == {"hora", "torch-gloo", "mpi4py"}, document.get("skipped")
    for name, backend in document["backends"].items():
        rows = {(row["collective"], row["requested_bytes"]): row["wrong"] for row in backend["results"]}
        assert set(rows) == {(c, s) for c in ("allreduce", "allgather", "broadcast") for s in (4, 1 << 20)}, name
        assert all(wrong == 0 for wrong in rows.values()), (name, rows)
    assert "ratio = hora's time" in result.stdout  # the comparison tables
    assert not _leftovers(cluster)


def test_training_cluster_mode() -> None:
    """benchmarks/training.py --cluster brings up 2 hosts, runs one tiny round of hora and DDP with one rank per
    host, and takes them down."""
    pytest.importorskip("torch")
    before = run(["ip", "netns", "list"]).stdout
    result = subprocess.run(
        [PY, str(ROOT / "benchmarks" / "training.py"), "--cluster", "2", "--rate", RATE, "--engines", "hora,ddp",
         "--model", "cnn", "--batch-size", "4", "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
         "--num-iters", "1", "--rounds", "1"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, HORA_START_TIMEOUT="60"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    assert results["ranks"] == 2
    assert set(results["medians"]) == {"hora", "ddp"} and all(v > 0 for v in results["medians"].values())
    assert "on 2 emulated hosts" in result.stdout
    assert run(["ip", "netns", "list"]).stdout == before  # the hosts are gone


def test_cluster_benchmark_reports_and_plots(tmp_path: Path) -> None:
    """benchmarks/cluster.py brings up 2 shaped hosts, runs hora-bench on them with torch gloo beside hora,
    prints the ratios, writes its JSON and one plot per run, and takes the hosts down."""
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    before = run(["ip", "netns", "list"]).stdout
    out = tmp_path / "cluster.json"
    result = subprocess.run(
        [PY, str(ROOT / "benchmarks" / "cluster.py"), "--hosts", "2", "--rate", "1gbit", "--collective", "broadcast",
         "--sizes", "4,64K", "-n", "2", "-w", "1", "--max-time", "1", "--peers", "torch-gloo", "--timeout", "120",
         "--json", str(out), "--plot", str(tmp_path / "peers")],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ratio = hora's time" in result.stdout and "(torch-gloo)" in result.stdout  # the comparison table
    runs = json.loads(out.read_text())["runs"]
    assert [r["cluster"]["hosts"] for r in runs] == [2]
    assert set(runs[0]["backends"]) == {"hora", "torch-gloo"}, runs[0].get("skipped")
    image = tmp_path / "peers-2x1-1gbit.png"
    assert image.stat().st_size > 1000 and image.read_bytes()[:4] == b"\x89PNG"
    assert run(["ip", "netns", "list"]).stdout == before  # the hosts are gone
