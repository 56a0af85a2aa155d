"""Local ranks die with their launcher, even when the launcher is killed with SIGKILL.

A rank on another host runs under ``hora.runner.remote``, which stops it when ssh's stdin
closes. A rank on this machine is ``horarun``'s child in a session of its own; if
``horarun`` is killed with SIGKILL nothing stops it: it is reparented to init and, if it
writes nothing (so never meets a closed pipe), runs on. The lifeline closes that gap.

``Job.run`` starts one guardian process per job (``Lifeline.start``) before any rank and
keeps the write end of a pipe to its stdin. The guardian reads lines:

* ``<pgid>``: a local rank's process group (the rank's pid: it leads its own session);
* ``END``: the launcher stopped and reaped every rank itself; exit without a signal.

If stdin reaches end of file without ``END``, the launcher is gone (the kernel closed the
pipe when it died, however it died): the guardian sends SIGTERM to every group it was
given, SIGKILL ``grace`` seconds later to the groups still there, and exits. That is what
the supervisor on a remote host does, and it reaches what a rank started too (a wrapper
script's child, data-loader workers), and ranks that ignore SIGTERM.

Rules that keep it sound:

* The guardian is started in a session of its own, so a Ctrl-C in the terminal or a
  signal to ``horarun``'s process group never reaches it.
* It runs by path with ``-I`` and imports only the standard library (no ``hora``, no
  NumPy), so it costs about 30 ms of CPU at the start of a job.
* It holds no rank's pipes: it starts before the ranks, and the ranks inherit nothing of
  its pipe (``close_fds``).
* It signals only groups the launcher named, and only after the launcher is gone;
  ``END`` comes after ``Job.run`` killed what was left of every group.

If the guardian cannot be started, the job runs without it and ``horarun`` says so: a
SIGKILL of ``horarun`` then leaves its local ranks running, as before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import IO

END = b"END"
_CLOSE_TIMEOUT = 2.0  # seconds the guardian gets to exit after END
_POLL = 0.05  # seconds between checks that the groups are gone


class Lifeline:
    """The launcher's end of the pipe to the guardian.

    Use ``Lifeline.start``; ``watch`` each local rank; ``close`` once every rank is reaped.
    """

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process

    @classmethod
    def start(cls, grace: float) -> Lifeline:
        """Starts the guardian.

        Args:
            grace: seconds between SIGTERM and SIGKILL when the launcher is gone.

        Returns:
            The running lifeline.

        Raises:
            OSError: the guardian cannot be started.
        """
        path = os.path.abspath(__file__)
        # By path, so that it imports nothing of hora; by module where hora is not plain files.
        program = [path] if os.path.isfile(path) else ["-m", "hora.runner.lifeline"]
        process = subprocess.Popen(
            [sys.executable, "-I", *program, repr(float(grace)), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        return cls(process)

    def watch(self, pgid: int) -> None:
        """Hands the guardian a local rank's process group, to stop if the launcher dies.

        Args:
            pgid: the rank's process group id (its pid).
        """
        self._send(f"{pgid}\n".encode())

    def close(self) -> None:
        """Tells the guardian the launcher ended normally, and waits for it to exit."""
        self._send(END + b"\n")
        stdin: IO[bytes] | None = self._process.stdin
        if stdin is not None:
            try:
                stdin.close()
            except OSError:
                pass
        try:
            self._process.wait(_CLOSE_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _send(self, line: bytes) -> None:
        stdin: IO[bytes] | None = self._process.stdin
        if stdin is None or stdin.closed:
            return
        try:
            stdin.write(line)
            stdin.flush()
        except OSError:  # the guardian is gone; the ranks are then stopped only by the launcher
            pass


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal(pgids: list[int], signum: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def guard(grace: float, launcher: int) -> int:
    """The guardian: reads groups from stdin; stops them if stdin ends without ``END``.

    Args:
        grace: seconds between SIGTERM and SIGKILL.
        launcher: the launcher's pid, for the message.

    Returns:
        The exit status: 0.
    """
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_IGN)
    groups: list[int] = []
    for raw in sys.stdin.buffer:
        line = raw.strip()
        if line == END:
            return 0
        if line.isdigit():
            groups.append(int(line))
    if not groups:
        return 0
    count = f"{len(groups)} local rank{'s' if len(groups) != 1 else ''}"
    sys.stderr.write(
        f"horarun: the launcher (pid {launcher}) is gone without stopping its ranks: stopping its {count} "
        f"(SIGTERM, then SIGKILL after {grace:g} s)\n"
    )
    sys.stderr.flush()
    _signal(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(_alive(pgid) for pgid in groups) and time.monotonic() < deadline:
        time.sleep(_POLL)
    _signal(groups, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(guard(float(sys.argv[1]), int(sys.argv[2])))
