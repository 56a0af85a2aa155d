"""How one rank's engine ends: leaving the job, failing it, and naming the root cause.

Run by the thread holding the drive lock (the engine thread, at the end).

* Leaving (``shutdown()``): the rank refuses new work (work already submitted goes on),
  and on rank 0 tells the coordinator it departed. A worker then says goodbye to rank 0
  (SHUTDOWN, with what the others are told of it), runs the responses rank 0 decided
  before it read that, and waits for rank 0 to close its end, so no frame is lost to a
  connection reset (at most ``LEAVE_WAIT`` seconds: rank 0 may be frozen).
* Failing: rank 0 tells every worker why (ABORT); a worker tells rank 0 (FAILURE) and
  waits briefly for rank 0's ABORT, whose reason names the root cause. Every entry in
  flight, queued or taken for execution, fails with ``HoraInternalError``.
"""

from __future__ import annotations

import logging
import select
import socket
import time

from hora import logs
from hora.engine import messages
from hora.engine.control import LINGER_NOTICE, ControlPlane, JobFailed
from hora.engine.queue import internal_error
from hora.engine.stall import StalledError
from hora.errors import ProtocolError
from hora.transport.tcp import Link, LinkClosed, PeerProtocolError, encode_frame

log = logging.getLogger(__name__)

ROOT_CAUSE_WAIT = 2.0  # seconds a failing worker waits for rank 0's account of the failure
LEAVE_WAIT = 60.0  # seconds a leaving worker waits for rank 0 to acknowledge its shutdown


def reason_for(control: ControlPlane, exc: BaseException) -> str:
    """What every pending operation fails with, for an exception that ended the engine."""
    if isinstance(exc, (JobFailed, StalledError)):
        return str(exc)
    if isinstance(exc, LinkClosed):
        return control.lost(exc.link, exc.detail)
    if isinstance(exc, PeerProtocolError):
        link = exc.link
        return (
            f"rank {link.peer} on host {link.peer_host} sent a malformed control message ({exc.detail}); "
            "the job cannot go on with it"
        )
    log.error("the engine failed", exc_info=exc, extra=logs.at(control.rank))
    return f"hora's engine on rank {control.rank} failed: {exc!r}"


def begin_leaving(control: ControlPlane, how: str) -> None:
    """Refuses new work from this rank's threads; work already submitted goes on."""
    control.leaving_since = time.monotonic()
    if control.lane is not None:
        control.lane.leave()
    control.queue.seal(internal_error(f"hora has shut down on rank {control.rank}"))
    if control.coordinator is not None:
        control.announce(control.queue.drain())
        control.coordinator.depart(control.rank, f"on host {control.hostname} {how}")
        control.watch_leaving()


def leave(control: ControlPlane, how: str) -> None:
    """A worker's goodbye: tell rank 0, run what it already decided, wait for its close.

    Raises:
        JobFailed: rank 0 aborted the job meanwhile.
    """
    link = control.links.get(0)
    if link is None:
        return
    control.farewells.add(0)  # rank 0 closes its end once it has read our goodbye
    link.send_frame(messages.SHUTDOWN, messages.encode_reason(how), control.watch)
    try:
        link.sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # rank 0 already closed: nothing left to say
    poller = select.poll()
    poller.register(link.fileno(), select.POLLIN)
    deadline = time.monotonic() + LEAVE_WAIT
    while True:
        while link.frames:
            kind, payload = link.frames.popleft()
            if kind in (messages.ABORT, messages.FAILURE):
                raise JobFailed(messages.decode_reason(payload), settled=True)
            if kind == messages.RESPONSES:
                for response in messages.decode_responses(payload):
                    control.executor.run(response)
        if link.closed_by_peer:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            log.warning(
                "rank 0 did not answer its shutdown within %g s (frozen?); leaving anyway",
                LEAVE_WAIT,
                extra=logs.at(control.rank),
            )
            return
        if poller.poll(remaining * 1000.0):
            link.pump()


def fail(control: ControlPlane, reason: str, settled: bool = False) -> str:
    """Fails the job on this rank, telling the others, and settles on the root cause
    (unless ``settled``: the reason is rank 0's account already). Every entry in flight
    fails with it.

    Returns:
        The reason settled on.
    """
    if control.coordinator is not None:
        for link in list(control.links.values()):
            _send_quietly(link, messages.ABORT, messages.encode_reason(reason))
    elif 0 in control.links and not settled:
        link = control.links[0]
        if not link.closed_by_peer:
            _send_quietly(link, messages.FAILURE, messages.encode_reason(f"rank {control.rank}: {reason}"))
        reason = _await_abort(control, link, reason)
    log.error("%s", reason.removeprefix(f"rank {control.rank}: "), extra=logs.at(control.rank))
    control.queue.close(internal_error(reason))
    control.executor.abandon(internal_error(reason))
    return reason


def _await_abort(control: ControlPlane, link: Link, reason: str) -> str:
    """Waits briefly for rank 0's ABORT, whose reason names the root cause.

    Rank 0 closing its end without one means rank 0 itself was lost: that is then the
    root cause (every rank that failed after it sees it so), not the peer whose loss
    this rank happened to notice first (which may only have failed because rank 0 did).
    """
    deadline = time.monotonic() + ROOT_CAUSE_WAIT
    poller = select.poll()
    poller.register(link.fileno(), select.POLLIN)
    while True:
        for kind, payload in link.frames:
            if kind == messages.ABORT:
                return messages.decode_reason(payload)
        remaining = deadline - time.monotonic()
        if link.closed_by_peer:
            return reason if 0 in control.farewells else control.lost(link, link.close_detail)
        if remaining <= 0:
            return reason
        if poller.poll(remaining * 1000.0):
            try:
                link.pump()
            except ProtocolError:
                return reason


def _send_quietly(link: Link, kind: int, payload: bytes) -> None:
    """Sends a small frame if the socket takes it now; a dead peer is not an error here."""
    try:
        link.sock.send(encode_frame(kind, payload))
    except OSError:
        pass  # the peer is gone or its buffer is full: it learns from the closed link


def note_lingering(control: ControlPlane) -> None:
    """On rank 0, says once whom it still waits for, long after its own shutdown()."""
    if control.leaving_since is None or control.lingering_noted or not control.links:
        return
    if time.monotonic() - control.leaving_since >= LINGER_NOTICE:
        control.lingering_noted = True
        waiting = ", ".join(map(str, sorted(control.links)))
        log.warning(
            "shut down, and coordinates rank(s) %s until they shut down too", waiting, extra=logs.at(control.rank)
        )
