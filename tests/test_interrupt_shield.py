"""The interrupt shield, driven by hand in one process (no ranks): what runs when."""

from __future__ import annotations

import os
import signal

import pytest

from hora.engine.interrupts import Abandoned, Interrupted, InterruptShield


class Boom(Exception):
    pass


@pytest.fixture
def shield():
    # Python's own SIGINT handler, as an interactive program has it (a test run started in
    # the background of a script inherits SIGINT ignored).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    shield = InterruptShield()
    yield shield
    shield.restore()
    shield.close()
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGINT, inherited)


def raise_boom(signum, frame):
    raise Boom()


def test_a_program_sees_the_handlers_it_installed(shield):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous = signal.signal(signal.SIGUSR1, raise_boom)
    assert signal.getsignal(signal.SIGUSR1) is raise_boom
    assert signal.signal(signal.SIGUSR1, previous) is raise_boom
    shield.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the real one again


def test_with_the_shield_down_a_handler_runs_at_once(shield):
    signal.signal(signal.SIGUSR1, raise_boom)
    with pytest.raises(Boom):
        os.kill(os.getpid(), signal.SIGUSR1)
        signal.pause()  # not reached: the handler raised


def test_with_the_shield_up_a_handler_waits_until_it_comes_down(shield):
    signal.signal(signal.SIGUSR1, raise_boom)  # installed after the shield: wrapped all the same
    assert shield.enter()
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(1000):  # plenty of bytecodes: the handler would have run by now
        pass
    assert len(shield.pending) == 1
    with pytest.raises(Boom):
        shield.leave()
    assert shield.pending == []


def test_a_safe_point_ends_the_wait_at_once(shield):
    signal.signal(signal.SIGUSR1, raise_boom)
    assert shield.enter()
    shield.safe = True
    with pytest.raises(Interrupted):
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(1000):
            pass
    shield.safe = False
    with pytest.raises(Boom):
        shield.leave()


def test_a_data_plane_wait_gives_up_a_while_after_the_signal(shield):
    signal.signal(signal.SIGUSR1, raise_boom)
    assert shield.enter()
    assert shield.deadline(idle_since=0.0) is None
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(1000):
        pass
    deadline = shield.deadline(idle_since=0.0)
    assert deadline is not None and deadline == pytest.approx(shield.pending_since + 1.0)
    with pytest.raises(Abandoned) as caught:
        shield.give_up()
    assert isinstance(caught.value.error, Boom)
    shield.leave()  # nothing left to run


def test_a_handler_that_does_not_raise_just_runs_later(shield):
    seen = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    assert shield.enter()
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(1000):
        pass
    assert seen == []
    shield.leave()
    assert seen == [signal.SIGUSR1]
