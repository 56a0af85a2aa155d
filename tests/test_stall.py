"""A rank's watch on a silent peer: its clock on its own (a clock the test moves), and the answers."""

from __future__ import annotations

import logging
import socket

import pytest

from hora.config import Config
from hora.engine import messages
from hora.engine.control import ControlPlane
from hora.engine.executor import Executor
from hora.engine.process_sets import ProcessSetTable
from hora.engine.queue import TensorQueue
from hora.engine.stall import SilentPeer, StalledError, StallInspector
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


def coordinator_of_two(link: Link) -> ControlPlane:
    """Rank 0's control plane of a 2-rank job whose only worker is at the other end of ``link``."""
    env = {"HORA_RANK": "0", "HORA_SIZE": "2", "HORA_RENDEZVOUS_ADDR": "127.0.0.1", "HORA_RENDEZVOUS_PORT": "1"}
    config = Config.from_env({**env, "HORA_SECRET": "00" * 32})
    queue = TensorQueue()
    executor = Executor(0, ProcessSetTable(2), queue, lambda ranks: None)  # type: ignore[arg-type,return-value]
    return ControlPlane(config, {1: link}, queue, executor, None, lambda check: Watch([link], check), "host-a")


def test_rank_0_answers_each_ping_once_even_from_a_data_plane_wait():
    mine, theirs = socket.socketpair()
    link = Link(mine, 1, "host-b")
    link.set_nonblocking()
    theirs.setblocking(False)
    control = coordinator_of_two(link)

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
