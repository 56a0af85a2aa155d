"""One rank's process on this machine: start it, watch it, signal it.

Each rank starts in a session of its own (``start_new_session=True``), so the rank
and every process it starts form one process group that ``signal_group`` reaches as
a whole, and a Ctrl-C in the terminal reaches only ``horarun``, which decides what
the ranks get. Its stdout and stderr are binary pipes drained by ``StreamForwarder``
threads; its stdin is ``/dev/null``.

A waiter thread per rank blocks in ``wait()`` and, when the rank exits, records the
exit status and the time, then posts the rank number to the job's event queue.

Invariant: only the waiter thread reaps the process; other threads read
``returncode`` and ``exit_time`` after the waiter set them.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from hora.runner.hosts import SlotInfo
from hora.runner.output import Sink, StreamForwarder, rank_dir

# Events posted to a job's queue: ("exit", rank) by waiters, ("signal", signum) by handlers.
Event = tuple[str, int]


def describe_status(returncode: int) -> str:
    """Describes an exit status the way a person reads it.

    Args:
        returncode: ``Popen.returncode``: the exit code, or minus the signal number.

    Returns:
        ``"exit code 3"`` or ``"killed by SIGKILL"``.
    """
    if returncode >= 0:
        return f"exit code {returncode}"
    return f"killed by {signal_name(-returncode)}"


def signal_name(signum: int) -> str:
    """Returns a signal's name (``SIGTERM``), or ``signal <n>`` for an unknown number."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Worker:
    """A running rank: its process, its output forwarders and its waiter thread.

    Use ``Worker.start``; attributes after start:

    Attributes:
        slot: where the rank runs.
        pid: the rank's process id (also its process group id).
        returncode: the exit status once the rank exited, else None.
        exit_time: ``time.monotonic()`` when the waiter saw the exit, else None.
        signals_sent: the signals ``signal_group`` sent, in order.
    """

    def __init__(self, slot: SlotInfo, process: subprocess.Popen[bytes], forwarders: list[StreamForwarder]) -> None:
        self.slot = slot
        self.pid = process.pid
        self.returncode: int | None = None
        self.exit_time: float | None = None
        self.signals_sent: list[int] = []
        self._process = process
        self._forwarders = forwarders
        self._waiter: threading.Thread | None = None

    @classmethod
    def start(
        cls,
        slot: SlotInfo,
        command: Sequence[str],
        env: Mapping[str, str],
        events: queue.SimpleQueue[Event],
        stdout: Sink,
        stderr: Sink,
        output_dir: str | None = None,
        timestamp: bool = False,
    ) -> Worker:
        """Starts one rank.

        Args:
            slot: where the rank runs.
            command: the program and its arguments.
            env: the rank's complete environment.
            events: the job's queue; ``("exit", rank)`` is posted when the rank exits.
            stdout: where the rank's prefixed stdout lines go.
            stderr: where the rank's prefixed stderr lines go.
            output_dir: the ``--output-filename`` directory, or None.
            timestamp: prefix forwarded lines with the local time.

        Returns:
            The running worker.

        Raises:
            OSError: the command cannot be started or the output files cannot be created.
        """
        copies: list[BinaryIO | None] = [None, None]
        if output_dir is not None:
            directory = rank_dir(output_dir, slot.rank, slot.size)
            os.makedirs(directory, exist_ok=True)
            copies = [open(os.path.join(directory, name), "wb", buffering=0) for name in ("stdout", "stderr")]
        try:
            process = subprocess.Popen(
                list(command),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError:
            for copy in copies:
                if copy is not None:
                    copy.close()
            raise
        if process.stdout is None or process.stderr is None:  # pragma: no cover - PIPE always gives both
            raise OSError("subprocess did not create the output pipes")
        forwarders = [
            StreamForwarder(process.stdout, slot.rank, "stdout", stdout, copies[0], timestamp).start(),
            StreamForwarder(process.stderr, slot.rank, "stderr", stderr, copies[1], timestamp).start(),
        ]
        worker = cls(slot, process, forwarders)
        worker._waiter = threading.Thread(
            target=worker._wait, args=(events,), name=f"hora-rank{slot.rank}-waiter", daemon=True
        )
        worker._waiter.start()
        return worker

    def _wait(self, events: queue.SimpleQueue[Event]) -> None:
        returncode = self._process.wait()
        self.exit_time = time.monotonic()
        self.returncode = returncode
        events.put(("exit", self.slot.rank))

    @property
    def running(self) -> bool:
        """True until the waiter has recorded the rank's exit."""
        return self.returncode is None

    @property
    def stderr_tail(self) -> list[str]:
        """The last lines (up to ``output.TAIL_LINES``) the rank wrote to stderr."""
        return list(self._forwarders[1].tail)

    def signal_group(self, signum: int) -> None:
        """Sends a signal to the rank's process group (the rank and what it started).

        Does nothing when the group is gone. The rank may have exited while its
        children live on; they are signalled too.

        Args:
            signum: the signal, e.g. ``signal.SIGTERM``.
        """
        self.signals_sent.append(signum)
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    def join_output(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds in all for the rank's output to be drained.

        Args:
            timeout: seconds; a process the rank left behind may keep a pipe open.
        """
        deadline = time.monotonic() + timeout
        for forwarder in self._forwarders:
            forwarder.join(max(0.0, deadline - time.monotonic()))
