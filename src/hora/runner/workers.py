"""One rank's process, on this machine or on another host over ssh: start it, watch it, signal it.

Each rank starts in a session of its own (``start_new_session=True``), so the rank
and every process it starts form one process group that ``signal_group`` reaches as
a whole, and a Ctrl-C in the terminal reaches only ``horarun``, which decides what
the ranks get. Its stdout and stderr are binary pipes drained by ``StreamForwarder``
threads; its stdin is ``/dev/null``.

A waiter thread per rank blocks in ``wait()`` and, when the rank exits, records the
exit status and the time, then posts the rank number to the job's event queue.

A rank on another host runs under ``hora.runner.remote`` there, started by a local
``ssh`` process (``RemoteLaunch``). The spec (command, environment with the job secret,
working directory) goes down ssh's stdin, which then stays open as the rank's lifeline:
``signal_group`` writes ``TERM``/``KILL`` into it, and if ``horarun`` dies the pipe closes
and the supervisor stops the rank. The supervisor's control lines on stderr give the
rank's remote pid and how it ended (exit code or signal); an ssh that ends without them
lost its connection (exit status 255 and ssh's own message).

Invariant: only the waiter thread reaps the process; other threads read
``returncode`` and ``exit_time`` after the waiter set them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any, BinaryIO

from hora.runner import cpu_binding
from hora.runner.hosts import SlotInfo
from hora.runner.lifeline import Lifeline
from hora.runner.output import Sink, StreamForwarder, rank_dir
from hora.runner.settings import LaunchSettings, rank_env, remote_env
from hora.runner.ssh import SshSettings, remote_python_command
from hora.runner.tracebacks import LastTraceback

# Events posted to a job's queue: ("exit", rank or event id) by waiters, ("signal", signum) by
# handlers (and, in an elastic job, ("hosts", HostUpdateResult) by its discovery thread).
Event = tuple[str, int]

_MARKER_WAIT = 2.0  # seconds to wait, after ssh exits, for the last control line
_POLL = 0.1  # seconds; a signal delivered to another thread does not wake a blocked get
REAP_TIMEOUT = 10.0  # seconds to wait for SIGKILLed workers to be reaped
_SSH_KILL_DELAY = 3.0  # seconds after KILL before the local ssh itself is killed


@dataclasses.dataclass(frozen=True)
class RemoteLaunch:
    """How to start a rank on another host.

    Attributes:
        ssh_command: the ``ssh`` argument list that runs ``hora.runner.remote`` there.
        env: the variables the rank gets on top of the remote login environment.
        cwd: the working directory there.
        grace: seconds between SIGTERM and SIGKILL when the launcher vanishes.
    """

    ssh_command: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    grace: float

    def spec(self, command: Sequence[str]) -> bytes:
        """The JSON line ``hora.runner.remote`` reads first."""
        data = {"command": list(command), "env": dict(self.env), "cwd": self.cwd, "grace": self.grace}
        return json.dumps(data).encode() + b"\n"


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
        remote: True for a rank on another host.
        remote_pid: its pid there, once its supervisor reported it.
        lost: a remote rank's ssh ended without a word from the supervisor (the
            connection or the host was lost).
    """

    def __init__(
        self,
        slot: SlotInfo,
        process: subprocess.Popen[bytes],
        forwarders: list[StreamForwarder],
        remote: bool = False,
    ) -> None:
        self.slot = slot
        self.local_pid = process.pid
        self.returncode: int | None = None
        self.exit_time: float | None = None
        self.signals_sent: list[int] = []
        self.event_id = slot.rank
        self.remote = remote
        self.remote_pid: int | None = None
        self.lost = False
        self._remote_status: dict[str, Any] = {}
        self._status_seen = threading.Event()
        self._process = process
        self._forwarders = forwarders
        self._waiter: threading.Thread | None = None
        self._stdin_lock = threading.Lock()

    @property
    def pid(self) -> int:
        """The rank's pid: on its own host (the remote pid once known)."""
        return self.remote_pid if self.remote_pid is not None else self.local_pid

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
        remote: RemoteLaunch | None = None,
        event_id: int | None = None,
    ) -> Worker:
        """Starts one rank, here or (``remote``) on another host over ssh.

        Args:
            slot: where the rank runs.
            command: the program and its arguments.
            env: the rank's complete environment.
            events: the job's queue; ``("exit", rank)`` is posted when the rank exits.
            stdout: where the rank's prefixed stdout lines go.
            stderr: where the rank's prefixed stderr lines go.
            output_dir: the ``--output-filename`` directory, or None.
            timestamp: prefix forwarded lines with the local time.
            remote: how to start it on another host; None runs ``command`` here
                with ``env`` as its whole environment.
            event_id: the number its exit event carries; ``slot.rank`` when None (an
                elastic job's workers change rank, so its driver numbers them itself).

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
            # A rank here binds itself to its cores (--bind-to) in the child; a remote one's
            # supervisor does that on its host.
            process = subprocess.Popen(
                list(remote.ssh_command) if remote is not None else list(command),
                env=dict(env),
                stdin=subprocess.PIPE if remote is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=None if remote is not None else cpu_binding.preexec(env),
            )
        except OSError:
            for copy in copies:
                if copy is not None:
                    copy.close()
            raise
        if process.stdout is None or process.stderr is None:  # pragma: no cover - PIPE always gives both
            raise OSError("subprocess did not create the output pipes")
        worker = cls(slot, process, [], remote=remote is not None)
        worker.event_id = slot.rank if event_id is None else event_id
        worker._forwarders = [
            StreamForwarder(process.stdout, slot.rank, "stdout", stdout, copies[0], timestamp).start(),
            StreamForwarder(
                process.stderr,
                slot.rank,
                "stderr",
                stderr,
                copies[1],
                timestamp,
                control=worker._on_control if remote is not None else None,
            ).start(),
        ]
        if remote is not None:
            worker._write(remote.spec(command))
        worker._waiter = threading.Thread(
            target=worker._wait, args=(events,), name=f"hora-rank{slot.rank}-waiter", daemon=True
        )
        worker._waiter.start()
        return worker

    def _on_control(self, data: dict[str, Any]) -> None:
        if isinstance(data.get("pid"), int):
            self.remote_pid = data["pid"]
        if "exit" in data or "signal" in data:
            self._remote_status = data
            self._status_seen.set()

    def _write(self, data: bytes) -> bool:
        """Writes to a remote rank's supervisor; False when the pipe is gone."""
        stdin: IO[bytes] | None = self._process.stdin
        if stdin is None:
            return False
        with self._stdin_lock:
            try:
                stdin.write(data)
                stdin.flush()
            except (OSError, ValueError):
                return False
        return True

    def _wait(self, events: queue.SimpleQueue[Event]) -> None:
        returncode = self._process.wait()
        exit_time = time.monotonic()
        if self.remote:
            # The supervisor's last control line may still be in the pipe.
            self._status_seen.wait(_MARKER_WAIT)
            status = self._remote_status
            if isinstance(status.get("signal"), int):
                returncode = -status["signal"]
            elif isinstance(status.get("exit"), int):
                returncode = status["exit"]
            else:
                self.lost = True
            if self._process.stdin is not None:
                with self._stdin_lock:
                    try:
                        self._process.stdin.close()
                    except OSError:
                        pass
        self.exit_time = exit_time
        self.returncode = returncode
        events.put(("exit", self.event_id))

    @property
    def running(self) -> bool:
        """True until the waiter has recorded the rank's exit."""
        return self.returncode is None

    @property
    def stderr_tail(self) -> list[str]:
        """The last lines (up to ``output.TAIL_LINES``) the rank wrote to stderr."""
        return list(self._forwarders[1].tail)

    @property
    def stderr_traceback(self) -> LastTraceback | None:
        """The last Python traceback the rank wrote to stderr, whole but bounded, or None."""
        catcher = self._forwarders[1].traceback
        return None if catcher is None else catcher.snapshot()

    def signal_group(self, signum: int) -> None:
        """Sends a signal to the rank's process group (the rank and what it started).

        Does nothing when the group is gone. The rank may have exited while its
        children live on; they are signalled too.

        Args:
            signum: the signal, e.g. ``signal.SIGTERM``.
        """
        self.signals_sent.append(signum)
        if self.remote:
            self._signal_remote(signum)
            return
        try:
            os.killpg(self.local_pid, signum)
        except ProcessLookupError:
            pass

    def kill_leftovers(self) -> None:
        """SIGKILLs what is left of an exited local rank's process group (its children).

        Not recorded in ``signals_sent``: the rank itself had ended. A remote rank's
        supervisor cleans up its host itself.
        """
        if self.remote or self.running:
            return
        try:
            os.killpg(self.local_pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _signal_remote(self, signum: int) -> None:
        word = {int(signal.SIGTERM): b"TERM\n", int(signal.SIGKILL): b"KILL\n"}.get(signum)
        delivered = word is not None and self._write(word)
        if signum == signal.SIGKILL or not delivered:
            # The supervisor gets the KILL, and stdin's end of file as a second word. If ssh
            # is still there a while later the host or the network is gone: end ssh here.
            timer = threading.Timer(_SSH_KILL_DELAY if delivered else 0.0, self._kill_ssh)
            timer.daemon = True
            timer.start()

    def _kill_ssh(self) -> None:
        if self.running:
            try:
                os.killpg(self.local_pid, signal.SIGKILL)
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


def launch(
    slot: SlotInfo,
    settings: LaunchSettings,
    base_env: Mapping[str, str],
    rendezvous: tuple[str, int],
    secret: bytes,
    ssh: SshSettings | None,
    events: queue.SimpleQueue[Event],
    stdout: Sink,
    stderr: Sink,
    grace: float,
    lifeline: Lifeline | None,
    event_id: int | None = None,
) -> Worker:
    """Starts the rank of ``slot`` as ``horarun`` and the elastic driver do: here with its
    whole environment (and watched by the lifeline), or, given ``ssh``, on its host over
    ssh with the rank's environment sent there (``RemoteLaunch``).

    Args:
        rendezvous: the address and port the rank reaches the rendezvous server at.
        secret: the job secret.
        grace: seconds between SIGTERM and SIGKILL when a remote rank is stopped.
        event_id: see ``Worker.start``.

    Raises:
        OSError: the command (or ssh) cannot be started.
    """
    remote: RemoteLaunch | None = None
    if ssh is not None:
        remote = RemoteLaunch(
            ssh_command=tuple(ssh.command(slot.hostname, remote_python_command([], base_env))),
            env=remote_env(base_env, settings, slot, rendezvous, secret),
            cwd=os.getcwd(),
            grace=grace,
        )
        env = dict(base_env)  # for ssh itself
    else:
        env = rank_env(base_env, settings, slot, rendezvous, secret)
    worker = Worker.start(
        slot,
        settings.command,
        env,
        events,
        stdout,
        stderr,
        settings.output_filename,
        settings.prefix_timestamp,
        remote,
        event_id=event_id,
    )
    if remote is None and lifeline is not None:
        lifeline.watch(worker.local_pid)  # its group: start_new_session made it the leader
    return worker


def stop_workers(
    workers: Sequence[Worker], events: queue.SimpleQueue[Event], grace: float, noun: str, stderr: Sink
) -> None:
    """SIGTERM to every worker's group, SIGKILL after ``grace`` seconds; waits until all are reaped.

    Exited workers are signalled too: their children may live on. A signal event that
    arrives meanwhile (a second Ctrl-C) cuts the grace period short.

    Args:
        workers: the workers to stop.
        events: the job's queue, which their waiters post to.
        grace: seconds between SIGTERM and SIGKILL.
        noun: what the launcher calls them in its note ("rank", "worker").
        stderr: where that note goes.
    """
    for worker in workers:
        worker.signal_group(signal.SIGTERM)
    grace_end = time.monotonic() + grace
    while any(worker.running for worker in workers):
        remaining = grace_end - time.monotonic()
        if remaining <= 0:
            break
        try:
            kind, value = events.get(timeout=min(_POLL, remaining))
        except queue.Empty:
            continue
        if kind == "signal":
            stderr.line(f"horarun: received {signal_name(value)} again: killing every {noun} now")
            break
    kill_workers(workers, events)


def kill_workers(workers: Sequence[Worker], events: queue.SimpleQueue[Event]) -> None:
    """SIGKILL to every worker's group; waits up to ``REAP_TIMEOUT`` until all are reaped."""
    for worker in workers:
        worker.signal_group(signal.SIGKILL)
    reap_end = time.monotonic() + REAP_TIMEOUT
    while any(worker.running for worker in workers) and time.monotonic() < reap_end:
        try:
            events.get(timeout=_POLL)
        except queue.Empty:
            continue
