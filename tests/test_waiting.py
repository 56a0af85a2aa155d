"""How engine threads wait: the spin that stops while it does not pay, and the machine's CPU quota."""

from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path

from hora.engine.waiting import SPIN_BACKOFF, SPIN_WINDOW, Sleeper, Spin, barrier_spin, machine_cpus
from hora.transport.shm import SPIN_SECONDS


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def score(spin: Spin, hits: int, misses: int) -> None:
    for _ in range(hits):
        spin.score(True)
    for _ in range(misses):
        spin.score(False)


def test_a_spin_that_gets_its_answer_goes_on():
    spin = Spin(300e-6, adapts=True, clock=Clock())
    score(spin, SPIN_WINDOW - SPIN_WINDOW // 4, SPIN_WINDOW // 4)  # exactly the lowest rate that pays
    assert spin.seconds == 300e-6


def test_a_spin_that_runs_out_stops_then_tries_again_later_and_later():
    clock = Clock()
    spin = Spin(300e-6, adapts=True, clock=clock)
    score(spin, SPIN_WINDOW // 2, SPIN_WINDOW // 2)
    assert spin.seconds == 0.0
    clock.now += SPIN_BACKOFF - 0.01
    assert spin.seconds == 0.0
    clock.now += 0.01
    assert spin.seconds == 300e-6  # it tries again
    score(spin, 0, SPIN_WINDOW)  # and still does not pay: off for twice as long
    clock.now += 2 * SPIN_BACKOFF - 0.01
    assert spin.seconds == 0.0
    clock.now += 0.01
    assert spin.seconds == 300e-6
    score(spin, SPIN_WINDOW, 0)  # it pays again: the next stop is short again
    score(spin, 0, SPIN_WINDOW)
    clock.now += SPIN_BACKOFF
    assert spin.seconds == 300e-6


def test_a_spin_the_user_set_never_changes():
    spin = Spin(50e-6, adapts=False, clock=Clock())
    score(spin, 0, 10 * SPIN_WINDOW)
    assert spin.seconds == 50e-6
    none = Spin(0.0, adapts=True, clock=Clock())
    score(none, SPIN_WINDOW, 0)
    assert none.seconds == 0.0


def test_a_barrier_spins_as_long_as_the_rank_spins_after_work_and_never_less_than_its_own_spin():
    clock = Clock()
    spin = Spin(300e-6, adapts=True, clock=clock)
    barrier = barrier_spin(spin)
    assert barrier() == 300e-6
    score(spin, 0, SPIN_WINDOW)  # callers' spins run out: the rank stops spinning a while
    assert barrier() == SPIN_SECONDS
    clock.now += SPIN_BACKOFF
    assert barrier() == 300e-6
    assert barrier_spin(Spin(0.0, adapts=False))() == SPIN_SECONDS  # ranks outnumber CPUs, or HORA_SPIN_US=0


def cgroups(tmp_path: Path, lines: str, files: dict[str, str]) -> int:
    tmp_path.mkdir()
    proc = tmp_path / "cgroup"
    proc.write_text(lines)
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return machine_cpus(tmp_path / "fs", proc)


def test_machine_cpus_reads_a_cgroup_quota_and_its_parents(tmp_path):
    cpus = os.cpu_count() or 1
    assert cgroups(tmp_path / "none", "0::/job\n", {"job/cpu.max": "max 100000\n"}) == cpus
    # v2: the job's own quota is 4 CPUs, its parent's 1.5 (rounded up: 2); the smallest wins.
    v2 = {"job/cpu.max": "400000 100000\n", "cpu.max": "max 100000\n"}
    assert cgroups(tmp_path / "v2", "0::/job\n", v2) == min(cpus, 4)
    v2["job/slice/cpu.max"] = "max 100000\n"
    v2["job/cpu.max"] = "150000 100000\n"
    assert cgroups(tmp_path / "v2b", "0::/job/slice\n", v2) == min(cpus, 2)
    # v1: the cpu controller's files, beside others' lines.
    v1 = {"cpu,cpuacct/pod/cpu.cfs_quota_us": "100000\n", "cpu,cpuacct/pod/cpu.cfs_period_us": "100000\n"}
    assert cgroups(tmp_path / "v1", "4:memory:/pod\n3:cpu,cpuacct:/pod\n0::/\n", v1) == 1
    v1["cpu,cpuacct/pod/cpu.cfs_quota_us"] = "-1\n"
    assert cgroups(tmp_path / "v1b", "3:cpu,cpuacct:/pod\n", v1) == cpus
    assert machine_cpus(tmp_path / "missing", tmp_path / "missing" / "cgroup") == cpus


def _wake_bytes(sleeper: Sleeper) -> int:
    """How many wake-up bytes are pending (and reads them)."""
    got = 0
    while select.select([sleeper._wake_r], [], [], 0)[0]:
        got += len(sleeper._wake_r.recv(4096))
    return got


def test_a_burst_of_submits_writes_one_wake_up_byte_per_sleep_and_a_new_sleep_is_woken_again():
    from hora.engine.control import WaitPlan
    from hora.engine.interrupts import InterruptShield
    from hora.engine.queue import TensorQueue

    sleeper = Sleeper([], TensorQueue(), None, None, InterruptShield(), Spin(0.0, adapts=False))
    for _ in range(3):
        sleeper.wake_if_sleeping()
    assert _wake_bytes(sleeper) == 0  # nobody sleeps: nothing to write
    sleeper.sleeping = True  # as poll sets it, after clearing _rung
    for _ in range(3):
        sleeper.wake_if_sleeping()
    assert _wake_bytes(sleeper) == 1
    sleeper.sleeping = False

    # A thread that goes to sleep afterwards is woken by the next submit.
    woken = threading.Event()

    def sleep() -> None:
        sleeper.poll(sleeper.poller, lambda: WaitPlan(), caller=False, spin_since=float("-inf"))
        woken.set()

    thread = threading.Thread(target=sleep, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not sleeper.sleeping and time.monotonic() < deadline:
        time.sleep(0.001)
    assert sleeper.sleeping
    sleeper.wake_if_sleeping()
    assert woken.wait(30)
    thread.join(30)
    sleeper.close()
