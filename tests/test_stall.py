"""A rank's watch on a silent peer: its clock on its own (a clock the test moves), and the answers."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import pytest

from hora.config import Config
from hora.engine import messages
from hora.engine.control import ControlPlane
from hora.engine.executor import Executor
from hora.engine.process_sets import ProcessSetTable
from hora.engine.queue import TensorQueue
from hora.engine.stall import MAX_GRACE, DataPhaseStall, SilentPeer, StalledError, StallInspector
from hora.transport.tcp import FrameReader, Link, Watch, encode_frame


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def silence(clock: Clock, **env: str) -> SilentPeer:
    inspector = StallInspector(Config.from_env(env), clock)
    return SilentPeer(inspector, 3, "rank 0 (the coordinator) on host host-a", "its responses", clock)


def test_a_silent_coordinator_is_pinged_warned_about_then_ends_the_job(caplog):
    clock = Clock()
    watch = silence(clock, HORA_STALL_CHECK_TIME_SECONDS="10", HORA_STALL_SHUTDOWN_TIME_SECONDS="30")
    assert watch.due_at == 110.0
    clock.now = 109.0
    assert watch.check(lambda: True) is False  # not yet
    clock.now = 110.0
    assert watch.check(lambda: True) is True and watch.pings == 1  # the caller sends PING 0
    assert watch.check(lambda: True) is False  # one PING until it is answered
    assert watch.due_at == 120.0  # the first warning
    clock.now = 120.0
    with caplog.at_level(logging.WARNING, logger="hora.engine.stall"):
        assert watch.check(lambda: True) is False
    assert "rank 0 (the coordinator) on host host-a has sent nothing for 20 s" in caplog.text
    assert "nor answered a ping for 10 s" in caplog.text
    # The end: the PING unanswered for the shutdown time less the warning time, 30 s of silence in all.
    assert watch.due_at == 130.0
    clock.now = 130.0
    with pytest.raises(StalledError, match="has sent nothing for 30 s .* shutting the job down after 30 s"):
        watch.check(lambda: True)


def test_an_answer_or_a_request_starts_the_silence_anew():
    clock = Clock()
    watch = silence(clock, HORA_STALL_CHECK_TIME_SECONDS="10", HORA_STALL_SHUTDOWN_TIME_SECONDS="30")
    clock.now = 110.0
    assert watch.check(lambda: True) is True
    clock.now = 111.0
    watch.heard()  # the PONG
    assert watch.due_at == 121.0
    clock.now = 140.0  # long after: a second PING, never the end
    assert watch.check(lambda: True) is True and watch.pings == 2
    clock.now = 145.0
    assert watch.check(lambda: True) is False


def test_a_worker_that_waits_for_nothing_never_pings_and_checks_can_be_off():
    clock = Clock()
    watch = silence(clock, HORA_STALL_CHECK_TIME_SECONDS="10", HORA_STALL_SHUTDOWN_TIME_SECONDS="30")
    clock.now = 1000.0
    assert watch.check(lambda: False) is False and watch.pings == 0
    assert watch.due_at == 1010.0  # the silence starts anew
    off = silence(clock, HORA_STALL_CHECK_DISABLE="1")
    clock.now = 5000.0
    assert off.due_at == float("inf") and off.check(lambda: True) is False


def test_without_a_shutdown_time_it_only_warns(caplog):
    clock = Clock()
    watch = silence(clock, HORA_STALL_CHECK_TIME_SECONDS="10")
    clock.now = 110.0
    assert watch.check(lambda: True) is True
    with caplog.at_level(logging.WARNING, logger="hora.engine.stall"):
        for step in range(1, 20):
            clock.now = 110.0 + 10 * step
            assert watch.check(lambda: True) is False
    assert caplog.text.count("nor answered a ping") == 19


def control_of_two(rank: int) -> tuple[ControlPlane, Link, socket.socket]:
    """Rank ``rank``'s control plane in a 2-rank job, its link to the other rank, and that
    link's far end (the other rank's socket, non-blocking)."""
    mine, theirs = socket.socketpair()
    peer = 1 - rank
    link = Link(mine, peer, f"host-{peer}")
    link.set_nonblocking()
    theirs.setblocking(False)
    env = {"HORA_RANK": str(rank), "HORA_SIZE": "2", "HORA_RENDEZVOUS_ADDR": "127.0.0.1", "HORA_RENDEZVOUS_PORT": "1"}
    config = Config.from_env({**env, "HORA_SECRET": "00" * 32})
    queue = TensorQueue()
    executor = Executor(rank, ProcessSetTable(2), queue, lambda ranks: None)  # type: ignore[arg-type,return-value]

    def watch_for(check: Callable[[Link], None]) -> Watch:
        return Watch([link], check)

    return ControlPlane(config, {peer: link}, queue, executor, None, watch_for, f"host-{rank}"), link, theirs


def test_rank_0_answers_each_ping_once_even_from_a_data_plane_wait():
    control, link, theirs = control_of_two(0)

    def answers() -> list[tuple[int, bytes]]:
        try:
            return FrameReader().feed(theirs.recv(1 << 16))
        except BlockingIOError:
            return []

    theirs.sendall(encode_frame(messages.PING, messages.encode_count(0)))
    assert link.pump()
    control.check_urgent(link)  # as a data-plane wait does when the frame arrives
    assert answers() == [(messages.PONG, messages.encode_count(0))]
    control.check_urgent(link)  # a later frame makes it look again
    control.read_control()  # and the next pass reads the PING itself
    assert answers() == []
    # A link part-way through a frame is not interrupted: the pass answers.
    theirs.sendall(encode_frame(messages.PING, messages.encode_count(1)))
    assert link.pump()
    link.sending = True
    control.check_urgent(link)
    link.sending = False
    assert answers() == []
    control.read_control()
    assert answers() == [(messages.PONG, messages.encode_count(1))]
    theirs.close()
    link.close()


class FakeArbiter:
    def __init__(self, silent: list[int]) -> None:
        self.probes = 0
        self.answer = silent

    def probe(self) -> None:
        self.probes += 1

    def silent(self) -> list[int]:
        return self.answer


def data_stall(rank: int = 0, silent: list[int] | None = None, **env: str) -> DataPhaseStall:
    env = {"HORA_STALL_CHECK_TIME_SECONDS": "2", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "6", **env}
    stall = DataPhaseStall(StallInspector(Config.from_env(env)), rank, lambda: "allreduce 'x'")
    if silent is not None:
        stall.arbiter = FakeArbiter(silent)
    return stall


def test_a_data_phase_stall_warns_then_ends_the_job_naming_the_peers(caplog):
    stall = data_stall()
    with caplog.at_level(logging.WARNING, logger="hora.engine.stall"):
        assert stall([2], 2.0) == 4.0
    assert "allreduce 'x' has waited 2 s in its data phase for rank(s) 2" in caplog.text
    assert stall([2], 4.0) == 6.0  # the next warning, then the shutdown time
    with pytest.raises(StalledError, match=r"for rank\(s\) 2, which stopped .*shutting the job down after 6 s"):
        stall([2], 6.0)  # nobody to ask: at once


@pytest.mark.parametrize("rank, grace", [(0, 2.0), (3, 4.0)])  # a worker waits twice as long
@pytest.mark.parametrize("silent", [[1], []])
def test_at_the_shutdown_time_a_rank_probes_and_names_the_ones_that_did_not_answer(rank, grace, silent):
    stall = data_stall(rank, silent=silent)
    assert stall.grace == grace
    assert stall([2], 6.0) == 6.0 + grace
    assert stall.arbiter is not None and stall.arbiter.probes == 1  # type: ignore[attr-defined]
    with pytest.raises(StalledError) as raised:
        stall([2], 6.0 + grace)
    if silent:
        assert "rank(s) 1 stopped making progress and answer no ping" in str(raised.value)
    else:  # everybody asked answered: the peers it waits for, as before
        assert "for rank(s) 2, which stopped" in str(raised.value)


def test_the_grace_is_the_warning_time_up_to_a_few_seconds():
    assert data_stall(HORA_STALL_CHECK_TIME_SECONDS="60", HORA_STALL_SHUTDOWN_TIME_SECONDS="600").grace == MAX_GRACE


def test_a_probe_pings_every_peer_and_hears_who_answers():
    control, link, theirs = control_of_two(0)
    control.probe()
    assert FrameReader().feed(theirs.recv(1 << 16)) == [(messages.PING, messages.encode_count(0))]
    assert control.silent() == [1]
    theirs.sendall(encode_frame(messages.PONG, messages.encode_count(0)))
    assert link.pump()
    control.check_urgent(link)  # heard from inside a data-plane wait
    assert control.silent() == []
    control.probe()  # a later probe needs a later answer
    assert FrameReader().feed(theirs.recv(1 << 16)) == [(messages.PING, messages.encode_count(1))]
    assert control.silent() == [1]
    link.sending = True  # part-way through a frame: no PING, and silent until it answers
    control.probe()
    link.sending = False
    with pytest.raises(BlockingIOError):
        theirs.recv(1 << 16)
    assert control.silent() == [1]
    # Rank 0's clocks on leaving workers number their PINGs on from the probes'.
    control.watch_leaving()
    assert control.silences[1].pings == 3
    theirs.close()
    link.close()


def test_a_workers_probe_numbers_on_from_its_clock_on_rank_0():
    control, link, theirs = control_of_two(1)
    control.silences[0].pings = 4  # it pinged rank 0 four times before
    control.probe()
    assert FrameReader().feed(theirs.recv(1 << 16)) == [(messages.PING, messages.encode_count(4))]
    assert control.silences[0].pings == 5 and control.silent() == [0]
    theirs.close()
    link.close()
