"""hora.spark.run on a real Spark cluster: local-cluster[2,1,1024], two executors of one core each.

One SparkSession serves the whole module (starting one costs 10-30 s here); every test
that runs ranks leaves it usable for the next. The ranks run hora.numpy / hora.torch for
real, each a child process of its Spark task on an executor.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs Java: neither java on PATH nor JAVA_HOME", allow_module_level=True)

import hora.spark  # noqa: E402
from hora.spark import elastic as spark_elastic  # noqa: E402
from hora.spark import runner as spark_runner  # noqa: E402
from hora.spark import stage as spark_stage  # noqa: E402
from hora.spark.task import place  # noqa: E402

pytestmark = [
    pytest.mark.ranks,
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
]

ROOT = Path(__file__).resolve().parents[1]
MASTER = "local-cluster[2,1,1024]"


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    # The executors' Python workers (and so the ranks) must run this interpreter, not python3.
    previous = {name: os.environ.get(name) for name in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    os.environ["PYSPARK_PYTHON"] = os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    # C1 only and the serial collector: the JVMs start in about half the time on 2 cores.
    java_options = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    session = (
        SparkSession.builder.master(MASTER)
        .config("spark.driver.extraJavaOptions", java_options)
        .config("spark.executor.extraJavaOptions", java_options)
        .appName("hora-test-spark")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "512m")
        .config("spark.executor.memory", "512m")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _topology_and_sum(scale: float) -> tuple[int, int, int, int, float, str]:
    import numpy as np

    import hora.numpy as hvd

    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="total")
    print(f"rank {hvd.rank()} says hello", flush=True)
    value = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), float(total[0]) * scale,
             os.environ.get("SPARK_TEST_MARK", ""))  # fmt: skip
    hvd.shutdown()
    return value


@pytest.mark.timeout(120)
def test_run_returns_every_ranks_result_in_rank_order(spark):
    out = io.StringIO()
    results = hora.spark.run(
        _topology_and_sum, args=(10.0,), num_proc=2, env={"SPARK_TEST_MARK": "set"}, stdout=out, verbose=0
    )
    # Both executors are on this host: local ranks 0 and 1 of 2; the allreduce sums 1 + 2.
    assert results == [(0, 2, 0, 2, 30.0, "set"), (1, 2, 1, 2, 30.0, "set")]
    lines = out.getvalue().splitlines()
    assert "[0]<stdout>:rank 0 says hello" in lines and "[1]<stdout>:rank 1 says hello" in lines


def _fail_on_rank_one() -> None:
    import numpy as np

    import hora.numpy as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one gives up on purpose")
    hvd.allreduce(np.ones(4), name="never")  # rank 0 blocks here until hora fails it


@pytest.mark.timeout(120)
def test_a_failing_rank_fails_the_job_naming_the_rank_and_its_error(spark):
    err = io.StringIO()
    begin = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        hora.spark.run(_fail_on_rank_one, num_proc=2, stderr=err, verbose=0)
    message = str(caught.value)
    assert "rank 1 (Spark task 1 on host" in message and "failed first" in message
    assert "ValueError: rank one gives up on purpose" in message
    assert "_fail_on_rank_one" in message  # its traceback
    # Rank 0, blocked in an allreduce, failed by itself with hora's error naming rank 1.
    assert "rank 0: exit code 1: hora.errors.HoraInternalError" in message
    assert time.monotonic() - begin < spark_runner.SETTLE_PERIOD + 30
    assert "[1]<stderr>:ValueError: rank one gives up on purpose" in err.getvalue().splitlines()
    # The SparkContext is still usable.
    assert spark.sparkContext.parallelize(range(4), 2).map(lambda x: x * x).sum() == 14


def _die_by_signal() -> None:
    import signal

    print("about to die", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_is_reported_as_such(spark):
    with pytest.raises(RuntimeError, match=r"rank 0 \(Spark task 0 on host .*\) failed first, killed by signal 9"):
        hora.spark.run(_die_by_signal, num_proc=1, stdout=io.StringIO(), verbose=0)


def _hang(pid_file: str) -> None:
    with open(pid_file, "w") as handle:
        handle.write(str(os.getpid()))
    time.sleep(600)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(120)
def test_timeout_stops_a_job_that_hangs_and_its_ranks(spark, tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(TimeoutError, match=r"did not finish within timeout=8 s on 1 ranks; ranks still running: 0"):
        hora.spark.run(_hang, args=(str(pid_file),), num_proc=1, timeout=8, verbose=0)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(pid), "the rank outlived its cancelled Spark task"


@pytest.mark.timeout(120)
def test_more_ranks_than_task_slots_fails_within_the_start_timeout(spark):
    begin = time.monotonic()
    # Spark holds a barrier stage until it has a slot for every task; the start timeout ends the wait.
    with pytest.raises(TimeoutError, match=r"only 0 of 3 Spark tasks started within start_timeout=5 s"):
        hora.spark.run(lambda: 1, num_proc=3, start_timeout=5, verbose=0)
    assert time.monotonic() - begin < 5 + spark_stage.CANCEL_TIMEOUT


@pytest.mark.timeout(120)
def test_the_example_trains_digits_to_95_percent_on_two_ranks(spark):
    sys.path.insert(0, str(ROOT / "examples" / "spark"))  # shipped to the ranks with the driver's sys.path
    try:
        import digits  # examples/spark/digits.py

        accuracies = digits.run_on_spark(2, epochs=12)  # 20 by default; 12 reach 0.97 here, in less time
    finally:
        sys.path.remove(str(ROOT / "examples" / "spark"))
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1]  # the same allreduced counts on both
    assert accuracies[0] >= 0.95


@pytest.mark.timeout(30)
def test_without_an_active_spark_context_run_says_so(monkeypatch):
    from pyspark import SparkContext

    monkeypatch.setattr(SparkContext, "_active_spark_context", None)
    with pytest.raises(RuntimeError, match="no active SparkContext"):
        hora.spark.run(lambda: 1, num_proc=1)


@pytest.mark.timeout(30)
def test_arguments_are_checked_before_anything_starts(spark, monkeypatch):
    with pytest.raises(ValueError, match="use_mpi=True is not supported"):
        hora.spark.run(lambda: 1, num_proc=1, use_mpi=True)
    with pytest.raises(ValueError, match="num_proc=0 is not valid"):
        hora.spark.run(lambda: 1, num_proc=0)
    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HOROVOD_SPARK_START_TIMEOUT='soon' is not valid"):
        hora.spark.run(lambda: 1, num_proc=1)


def _elastic_counter(log_path: str, steps: int, kill_at: int, kill_task: bool = False) -> tuple[int, int, int, float]:
    """Trains a counter: each step allreduces one per rank into ``state.total`` and commits.

    Rank 0 logs every committed step with the world's size. With ``kill_at``, the rank
    that started as rank 1 of world 0 kills itself at that step, before its commit.
    """
    import json
    import signal

    import numpy as np

    import hora.numpy as hvd
    from hora.numpy import elastic

    hvd.init()
    state = elastic.ObjectState(step=0, total=0.0)
    first_world = os.environ.get("HORA_ELASTIC_GENERATION") == "0" and hvd.rank() == 1

    @elastic.run
    def train(state: Any) -> None:
        while state.step < steps:
            x = hvd.allreduce(np.ones(1), op=hvd.Sum)
            state.total = state.total + float(x[0])
            state.step += 1
            if kill_at and state.step == kill_at and first_world:
                # Lost mid-training: the rank alone, or (kill_task) its Spark task's Python worker,
                # as when an executor is lost; the rank's guardian then stops the rank too.
                os.kill(os.getppid() if kill_task else os.getpid(), signal.SIGKILL)
                time.sleep(60)
            state.commit()
            if hvd.rank() == 0:
                with open(log_path, "a") as handle:
                    handle.write(json.dumps({"step": state.step, "size": hvd.size(), "total": state.total}) + "\n")
            time.sleep(0.02)

    train(state)
    value = (hvd.rank(), hvd.size(), state.step, state.total)
    hvd.shutdown()
    return value


def _committed_sizes(log_path: Path, steps: int) -> list[int]:
    """Checks that no committed step was lost or counted twice; returns the world sizes seen, in order.

    A step whose commit raised (a reset) is not logged; it ran in the world of the step
    before it, and the logged total says so (as tests/test_elastic_horarun.py checks).
    """
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    assert rows, "nothing was committed"
    assert [row["step"] for row in rows] == sorted({row["step"] for row in rows}), "a committed step repeats"
    total, previous, size = 0.0, 0, rows[0]["size"]
    for row in rows:
        skipped = row["step"] - previous - 1
        assert skipped in (0, 1), f"steps {previous + 1}..{row['step'] - 1} were lost"
        total += skipped * size + row["size"]
        size, previous = row["size"], row["step"]
        assert row["total"] == total, f"step {row['step']}: total {row['total']}, expected {total}"
    assert rows[-1]["step"] == steps
    sizes = [rows[0]["size"]]
    for row in rows:
        if row["size"] != sizes[-1]:
            sizes.append(row["size"])
    return sizes


@pytest.mark.timeout(120)
def test_run_elastic_returns_every_ranks_result_in_rank_order(spark, tmp_path):
    log_path = tmp_path / "log"
    results = hora.spark.run_elastic(
        _elastic_counter, args=(str(log_path), 10, 0), num_proc=2, min_num_proc=1, elastic_timeout=60,
        stdout=io.StringIO(), verbose=0,
    )  # fmt: skip
    assert results == [(0, 2, 10, 20.0), (1, 2, 10, 20.0)]
    assert _committed_sizes(log_path, 10) == [2]


@pytest.mark.timeout(120)
def test_run_elastic_goes_on_from_the_last_commit_when_a_rank_is_killed(spark, tmp_path):
    log_path = tmp_path / "log"
    begin = time.monotonic()
    results = hora.spark.run_elastic(
        _elastic_counter, args=(str(log_path), 30, 8), num_proc=2, min_num_proc=1, elastic_timeout=60,
        stdout=io.StringIO(), stderr=io.StringIO(), verbose=0,
    )  # fmt: skip
    # The survivor goes on alone from the last commit: one rank, every step counted once.
    assert _committed_sizes(log_path, 30) == [2, 1]
    rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert len(results) == 1 and results[0][:3] == (0, 1, 30) and results[0][3] == rows[-1]["total"]
    assert time.monotonic() - begin < 60
    # The SparkContext is still usable.
    assert spark.sparkContext.parallelize(range(4), 2).map(lambda x: x * x).sum() == 14


@pytest.mark.timeout(120)
def test_run_elastic_goes_on_when_a_spark_task_is_lost(spark, tmp_path, caplog):
    log_path = tmp_path / "log"
    results = hora.spark.run_elastic(
        _elastic_counter, args=(str(log_path), 30, 8, True), num_proc=2, min_num_proc=1, elastic_timeout=60,
        stdout=io.StringIO(), stderr=io.StringIO(), verbose=0,
    )  # fmt: skip
    # The driver saw the agent go; Spark re-ran its task, and the new agent joined the next world
    # or a later one: no committed step was lost or counted twice.
    assert "its agent spark-" in caplog.text and "was lost" in caplog.text
    assert _committed_sizes(log_path, 30) in ([2], [2, 1], [2, 1, 2])
    assert [result[:3] for result in results] == [(rank, len(results), 30) for rank in range(len(results))]
    assert spark.sparkContext.parallelize(range(4), 2).map(lambda x: x * x).sum() == 14


@pytest.mark.timeout(120)
def test_run_elastic_stops_with_horovods_message_at_the_reset_limit(spark, tmp_path):
    from hora.runner.elastic.settings import RESET_LIMIT_EXCEEDED_MESSAGE

    with pytest.raises(RuntimeError, match=re.escape(RESET_LIMIT_EXCEEDED_MESSAGE.format(0))):
        hora.spark.run_elastic(
            _elastic_counter, args=(str(tmp_path / "log"), 30, 4), num_proc=2, min_num_proc=1, reset_limit=0,
            elastic_timeout=60, stdout=io.StringIO(), stderr=io.StringIO(), verbose=0,
        )  # fmt: skip
    assert spark.sparkContext.parallelize(range(4), 2).map(lambda x: x * x).sum() == 14


@pytest.mark.timeout(120)
def test_run_elastic_fails_within_the_start_timeout_without_enough_task_slots(spark):
    begin = time.monotonic()
    # Two task slots: the third agent waits for Spark; the start timeout ends the wait, and the
    # agents that ran end (and the waiting task with them) once the driver says the job is over.
    with pytest.raises(TimeoutError, match=r"only [0-2] of 3 Spark tasks started and registered within start_timeout=5 s"):
        hora.spark.run_elastic(lambda: 1, num_proc=3, start_timeout=5, verbose=0)
    assert time.monotonic() - begin < 5 + 30
    assert spark.sparkContext.parallelize(range(4), 2).map(lambda x: x * x).sum() == 14


@pytest.mark.timeout(30)
def test_run_elastic_checks_its_arguments_before_anything_starts(spark, monkeypatch):
    with pytest.raises(ValueError, match="expected min_num_proc <= num_proc <= max_num_proc"):
        hora.spark.run_elastic(lambda: 1, num_proc=2, min_num_proc=3)
    with pytest.raises(ValueError, match="max_num_proc=0 is not valid"):
        hora.spark.run_elastic(lambda: 1, num_proc=1, max_num_proc=0)
    with pytest.raises(ValueError, match="reset_limit=-1 is not valid"):
        hora.spark.run_elastic(lambda: 1, num_proc=1, reset_limit=-1)
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HOROVOD_ELASTIC_TIMEOUT='soon' is not valid"):
        hora.spark.run_elastic(lambda: 1, num_proc=1)
    assert spark_elastic._counts(None, None, None, 3) == spark_elastic.Counts(3, 3, 3)
    assert spark_elastic._counts(2, 1, 4, 3) == spark_elastic.Counts(2, 1, 4)


@pytest.mark.timeout(10)
def test_start_timeout_and_num_proc_defaults():
    resolve = spark_stage.resolve_start_timeout
    assert resolve(None, {}, "run") == 600.0
    assert resolve(None, {"HOROVOD_SPARK_START_TIMEOUT": "42"}, "run") == 42.0
    both = {"HORA_SPARK_START_TIMEOUT": "7", "HOROVOD_SPARK_START_TIMEOUT": "42"}
    assert resolve(None, both, "run") == 7.0
    assert resolve(5, {"HORA_SPARK_START_TIMEOUT": "7"}, "run") == 5.0
    with pytest.raises(ValueError, match="run: start_timeout=0 is not valid"):
        resolve(0, {}, "run")
    assert spark_runner._num_proc(None, 3) == 3


@pytest.mark.timeout(10)
def test_ranks_of_one_host_are_consecutive():
    slots = place(["a", "b", "a", "b", "c"])
    assert [slot.rank for slot in slots] == [0, 2, 1, 3, 4]
    assert [(slot.local_rank, slot.local_size) for slot in slots] == [(0, 2), (0, 2), (1, 2), (1, 2), (0, 1)]
    assert [(slot.cross_rank, slot.cross_size) for slot in slots] == [(0, 3), (1, 3), (0, 2), (1, 2), (2, 3)]
    assert {slot.size for slot in slots} == {5}
