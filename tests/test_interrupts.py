"""A signal handler that raises inside a blocking collective: the call raises, the runtime lives.

Ctrl-C (SIGINT) and a watchdog's or test timeout's SIGALRM raise in the main thread,
which is where blocking collectives run the engine. The interrupted call must raise the
handler's exception, the collective must complete (or fail) on its own, and every later
collective must work on every rank.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import numpy as np
import pytest

from harness import run_ranks

pytestmark = pytest.mark.ranks

MiB = 1 << 20


class Watchdog(Exception):
    pass


def interrupted_job(kind: str, nbytes: int, interval: float) -> dict[str, object]:
    import hora.numpy as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    data = np.ones(max(1, nbytes // 4), np.float32)
    inside = [False]  # the handlers raise only inside a hora call: the test's own code is not under test
    stop = threading.Event()
    if rank == 1:
        if kind == "alarm":

            def on_alarm(signum: int, frame: object) -> None:
                if inside[0]:
                    raise Watchdog()

            signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, interval, interval)
        else:

            def on_int(signum: int, frame: object) -> None:
                if inside[0]:
                    signal.default_int_handler(signum, frame)

            signal.signal(signal.SIGINT, on_int)

            def ctrl_c() -> None:
                while not stop.wait(interval):
                    os.kill(os.getpid(), signal.SIGINT)

            threading.Thread(target=ctrl_c, daemon=True).start()
    interrupts = 0
    for i in range(60):
        handle = hvd.allreduce_async_(data, op=hvd.Sum, name=f"step.{i}")
        try:
            inside[0] = True  # a signal before the submission would skip the collective on this rank
            hvd.synchronize(handle)
        except (Watchdog, KeyboardInterrupt):
            # The interrupted allreduce completes in the background (its name stays in
            # flight until then: each step has its own).
            interrupts += 1
        finally:
            inside[0] = False
        data[:] = 1.0
    if rank == 1:
        if kind == "alarm":
            signal.setitimer(signal.ITIMER_REAL, 0)
        stop.set()
    # Every rank: later collectives work and agree.
    results = [float(hvd.allreduce(np.full(3, rank + i, np.float64), op=hvd.Sum, name=f"after.{i}")[0]) for i in range(5)]
    total = hvd.allgather(np.array([rank]), name="last")
    hvd.shutdown()
    return {"interrupts": interrupts, "results": results, "gathered": total.tolist(), "size": size}


@pytest.mark.parametrize(
    "kind, nbytes, interval",
    [("alarm", 16 * MiB, 0.013), ("alarm", 4, 0.0007), ("sigint", 4 * MiB, 0.011)],
    ids=["alarm-16MiB", "alarm-4B", "sigint-4MiB"],
)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.timeout(120)
def test_an_interrupted_wait_raises_in_its_caller_and_the_runtime_lives(kind, nbytes, interval, transport):
    env = {"HORA_SHARED_MEMORY": "1" if transport == "shm" else "0"}
    values = run_ranks(3, interrupted_job, kind, nbytes, interval, env=env, timeout=100)
    assert values[1]["interrupts"] > 0, values
    for value in values:
        size = value["size"]
        assert value["results"] == [float(sum(range(size)) + size * i) for i in range(5)], value
        assert value["gathered"] == list(range(size))


def frozen_peer_job() -> str:
    import hora.numpy as hvd
    from hora.transport import shm
    from test_data_phase_failures import arm_kill

    # Ctrl-C as an interactive program gets it (a rank started in the background of a
    # script inherits SIGINT ignored, and the Timer's SIGINT below would then do nothing).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    hvd.init()
    data = np.ones(16 * MiB // 4, np.float32)
    for _ in range(2):
        hvd.allreduce_(data, name="x")
    if hvd.rank() == 2:  # frozen for good at its third barrier of the next allreduce (the test kills it)
        arm_kill(shm.Domain, "barrier", 3, then=lambda: os.kill(os.getpid(), signal.SIGSTOP))
    if hvd.rank() == 1:
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        for _ in range(5):
            hvd.allreduce_(data, name="x")
    except KeyboardInterrupt:
        return f"KeyboardInterrupt after {time.monotonic() - start:.1f} s"
    except hvd.HoraInternalError as exc:
        return f"HoraInternalError after {time.monotonic() - start:.1f} s: {exc}"
    return "no error"


@pytest.mark.timeout(120)
def test_ctrl_c_while_a_peer_is_frozen_gives_up_and_fails_the_job():
    # Rank 1's Ctrl-C lands while it waits in the data phase for frozen rank 2: the
    # collective cannot finish, so after a second without progress rank 1 gives up:
    # its call raises KeyboardInterrupt, and the job fails on the others, naming it.
    # Rarely, rank 1's engine thread ran that data phase while its main thread waited on
    # its bell (a safe point): the call raises at once and the collective goes on without
    # it, as any Ctrl-C there; the frozen peer then ends the job past the stall shutdown
    # time, naming rank 2. Either way nobody hangs.
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "2", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "6"}
    results = run_ranks(3, frozen_peer_job, check=False, launcher="torchrun", timeout=25, env=env)
    assert results[1].value is not None and results[1].value.startswith("KeyboardInterrupt"), results[1]
    assert float(results[1].value.split()[2]) < 10
    message = results[0].value
    assert message is not None and message.startswith("HoraInternalError"), results[0]
    if "rank 1 was interrupted" not in message and re.search(r"rank\(s\) 2\b.*stopped making progress", message):
        return  # the engine thread's data phase (above): rank 2 named, by the stall or by its missed ping
    assert "rank 1 was interrupted (KeyboardInterrupt)" in message and "stopped making progress" in message, message
