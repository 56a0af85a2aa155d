"""The timeline: rank 0's Chrome trace of negotiation and execution, from the start or on demand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness import run_ranks
from hora.engine.timeline import Timeline


def test_the_file_is_a_complete_json_array_after_every_flush(tmp_path: Path) -> None:
    clock = iter(range(0, 10**9, 1000))
    timeline = Timeline(str(tmp_path / "t.json"), mark_cycles=True, clock=lambda: next(clock))
    timeline.begin("allreduce.x", "NEGOTIATE_ALLREDUCE")
    timeline.tick("allreduce.x", "1")
    timeline.end("allreduce.x")
    timeline.flush()
    events = json.loads((tmp_path / "t.json").read_text())
    assert [e.get("name") for e in events if e["ph"] in "BX"] == ["NEGOTIATE_ALLREDUCE", "1"]
    timeline.cycle()
    timeline.begin("allreduce.x", "ALLREDUCE")
    timeline.end("allreduce.x", {"dtype": "float32", "shape": "[3]"})
    timeline.close()
    events = json.loads((tmp_path / "t.json").read_text())
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name" and e["pid"]}
    assert names == {"allreduce.x"}
    assert events[-1] == {"ph": "E", "ts": events[-1]["ts"], "pid": 1, "args": {"dtype": "float32", "shape": "[3]"}}
    assert any(e["ph"] == "i" and e["name"] == "CYCLE_START" for e in events)


def _signal(path: str, what: str, rank: int) -> None:
    """Rank 0 says it has started or stopped its timeline; the others wait for it, so that
    no request of theirs reaches rank 0's coordinator on the other side of the switch
    (rank 0 records a tensor's negotiation from the first request it sees)."""
    import time

    flag = Path(f"{path}.{what}")
    if rank == 0:
        flag.touch()
        return
    deadline = time.monotonic() + 30
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def traced_job(path: str, dynamic: bool) -> None:
    import hora.numpy as hvd

    hvd.init()
    if dynamic:
        hvd.allreduce(np.ones(3), name="before")  # not recorded
        hvd.start_timeline(path)
        _signal(path, "started", hvd.rank())
    hvd.allreduce(np.ones(3, dtype=np.float32), name="grad")
    hvd.allgather(np.ones((hvd.rank() + 1, 2)), name="gathered")
    if dynamic:
        hvd.stop_timeline()
        _signal(path, "stopped", hvd.rank())
        hvd.allreduce(np.ones(3), name="after")  # not recorded
    hvd.shutdown()


@pytest.mark.ranks
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.timeout(60)
def test_rank_zero_records_every_tensor(tmp_path: Path, dynamic: bool) -> None:
    path = str(tmp_path / "timeline.json")
    env = {"HORA_TIMELINE": "DYNAMIC" if dynamic else path}
    run_ranks(2, traced_job, path, dynamic, env=env)
    events = json.loads(Path(path).read_text())
    tensors = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name" and e["pid"]}
    assert sorted(tensors.values()) == ["allgather.gathered", "allreduce.grad"]
    by_tensor: dict[str, list[dict]] = {name: [] for name in tensors.values()}
    for event in events:
        if event["ph"] in "BEX" and event.get("pid") in tensors:
            by_tensor[tensors[event["pid"]]].append(event)
    grad = by_tensor["allreduce.grad"]
    # 12 bytes: the data rides with the requests, and the coordinator computes the sum (riders).
    assert [e.get("name") for e in grad if e["ph"] != "E"] in (
        ["NEGOTIATE_ALLREDUCE", "0", "1", "ALLREDUCE", "COORDINATOR_ALLREDUCE"],
        ["NEGOTIATE_ALLREDUCE", "1", "0", "ALLREDUCE", "COORDINATOR_ALLREDUCE"],
    )
    assert sum(e["ph"] == "B" for e in grad) == sum(e["ph"] == "E" for e in grad) == 3
    assert grad[-1]["args"] == {"dtype": "float32", "shape": "[3]"}
    assert [e["ts"] for e in grad] == sorted(e["ts"] for e in grad)
    assert any(e.get("name") == "SHM_ALLGATHER" for e in by_tensor["allgather.gathered"])


def live_job(path: str) -> list[str]:
    """Rank 0 reads the timeline file while the job runs on, idle, after each collective."""
    import time

    import hora.numpy as hvd

    hvd.init()
    seen = []
    for name, call in (("allreduce.small", lambda: hvd.allreduce(np.ones(3), name="small")),
                       ("allgather.rows", lambda: hvd.allgather(np.ones((2, 2)), name="rows")),
                       ("allreduce.large", lambda: hvd.allreduce(np.ones(1 << 18), name="large"))):  # fmt: skip
        call()
        time.sleep(0.2)  # idle: only the other rank's next request makes rank 0's engine write
        if hvd.rank() == 0:
            # That request (the barrier below) may arrive while this reads: the file is a
            # complete array after every write, but a read that straddles one sees the
            # old end and then the appended events (not JSON). Read it again then.
            deadline = time.monotonic() + 10
            while True:
                text = Path(path).read_text()
                try:
                    json.loads(text)
                    break
                except json.JSONDecodeError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            seen.append(f"{name}: {'there' if name in text else 'missing'}")
        hvd.barrier()
    hvd.shutdown()
    return seen


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_the_file_shows_each_finished_collective_while_the_job_runs(tmp_path: Path) -> None:
    path = str(tmp_path / "timeline.json")
    seen = run_ranks(2, live_job, path, env={"HORA_TIMELINE": path})[0]
    assert seen == ["allreduce.small: there", "allgather.rows: there", "allreduce.large: there"]
