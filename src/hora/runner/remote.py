"""The supervisor of one remote rank: ``python -m hora.runner.remote``, started by ``horarun`` over ssh.

``horarun`` cannot signal a process on another host, and sshd does not signal a command
whose connection dropped. This supervisor closes both gaps. It reads, on stdin:

1. one JSON line, the rank's spec: ``{"command": [...], "env": {...}, "cwd": ...,
   "grace": seconds}`` (the job secret travels here, never on a command line);
2. then control lines: ``TERM`` or ``KILL`` send that signal to the rank's process group.

It starts the rank in a process group of its own (stdout and stderr go straight to ssh,
stdin is ``/dev/null``), and when its stdin reaches end of file (``horarun`` or the ssh
connection is gone, even after a SIGKILL of ``horarun``) it sends SIGTERM to the group and
SIGKILL after the grace period, so no rank outlives its launcher. When the rank exits,
what is left of its group gets SIGTERM, then SIGKILL a second later: nothing of the job
stays behind on the host.

On stderr it writes two control lines (``hora.runner.control``), which ``horarun`` takes out
of the rank's output:
``MARKER {"pid": N, "hostname": ...}`` once the rank runs, and ``MARKER {"exit": code}`` or
``MARKER {"signal": N}`` when it ended. Its own exit status is the rank's exit code,
128 + N when signal N ended the rank, or 127 when the rank could not be started.

``python -m hora.runner.remote --probe`` instead prints one JSON line about this host
(name, Python, hora version, clock, interfaces, ``SSH_CONNECTION``): ``horarun`` and
``horarun doctor`` run it on every host before anything else.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from hora.runner import cpu_binding
from hora.runner.control import encode_marker

_LEFTOVER_GRACE = 1.0  # seconds what is left of a finished rank's group gets before SIGKILL
_MAX_SPEC = 64 * 1024 * 1024


def probe_info() -> dict[str, Any]:
    """What ``--probe`` reports about this host."""
    from hora.transport import netif
    from hora.version import __version__

    return {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "hora": __version__,
        "time": time.time(),
        "ssh_connection": os.environ.get("SSH_CONNECTION", ""),
        "interfaces": [[i.name, i.address] for i in netif.interfaces()],
    }


def _write_marker(data: dict[str, Any]) -> None:
    try:
        os.write(2, encode_marker(data))
    except OSError:
        pass


def _signal_group(pid: int, signum: int) -> bool:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _group_alive(pid: int) -> bool:
    return _signal_group(pid, 0)


class _Supervisor:
    def __init__(self, process: subprocess.Popen[bytes], grace: float) -> None:
        self.process = process
        self.grace = grace
        self.lock = threading.Lock()

    def signal(self, signum: int) -> None:
        with self.lock:
            _signal_group(self.process.pid, signum)

    def watch_stdin(self, pending: bytes) -> None:
        """Acts on control lines until stdin ends; then stops the rank."""
        buffer = pending
        while True:
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                word = line.strip()
                if word == b"TERM":
                    self.signal(signal.SIGTERM)
                elif word == b"KILL":
                    self.signal(signal.SIGKILL)
            try:
                chunk = os.read(0, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buffer += chunk
        # The launcher is gone (or closed our stdin on purpose): stop the rank.
        if self.process.poll() is None:
            self.signal(signal.SIGTERM)
            deadline = time.monotonic() + self.grace
            while self.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            self.signal(signal.SIGKILL)


def _read_spec() -> tuple[dict[str, Any], bytes]:
    data = b""
    while b"\n" not in data:
        chunk = os.read(0, 65536)
        if not chunk:
            raise ValueError("stdin closed before the rank's spec arrived")
        data += chunk
        if len(data) > _MAX_SPEC:
            raise ValueError("the rank's spec is too large")
    line, rest = data.split(b"\n", 1)
    spec = json.loads(line)
    if not isinstance(spec, dict) or not isinstance(spec.get("command"), list) or not spec["command"]:
        raise ValueError("the rank's spec names no command")
    return spec, rest


def supervise() -> int:
    """Runs one rank as the spec on stdin says; returns the supervisor's exit status."""
    host = socket.gethostname()
    try:
        spec, rest = _read_spec()
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"hora.runner.remote on {host}: {exc}\n")
        return 127
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in dict(spec.get("env") or {}).items()})
    cwd = spec.get("cwd")
    command = [str(word) for word in spec["command"]]
    if cwd:
        try:
            os.chdir(str(cwd))
        except OSError as exc:
            sys.stderr.write(
                f"horarun: cannot enter the working directory {cwd} on host {host}: {exc.strerror or exc} "
                "(every host needs the same directory; a shared file system, or run horarun from a directory "
                "that exists everywhere)\n"
            )
            _write_marker({"exit": 127})
            return 127
    try:
        bind = cpu_binding.preexec(env)
    except ValueError as exc:
        sys.stderr.write(f"horarun: cannot bind the rank on host {host}: {exc}\n")
        _write_marker({"exit": 127})
        return 127
    try:
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=bind)
    except OSError as exc:
        sys.stderr.write(f"horarun: cannot start {command[0]!r} on host {host}: {exc.strerror or exc}\n")
        _write_marker({"exit": 127})
        return 127
    supervisor = _Supervisor(process, float(spec.get("grace", 5.0)))
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda number, frame: supervisor.signal(signal.SIGTERM))
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    _write_marker({"pid": process.pid, "hostname": host})
    threading.Thread(target=supervisor.watch_stdin, args=(rest,), name="hora-remote-stdin", daemon=True).start()
    returncode = process.wait()
    # Leave nothing of the rank behind: what is left of its group gets SIGTERM, then SIGKILL.
    if _signal_group(process.pid, signal.SIGTERM):
        deadline = time.monotonic() + _LEFTOVER_GRACE
        while _group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal_group(process.pid, signal.SIGKILL)
    if returncode < 0:
        _write_marker({"signal": -returncode})
        return 128 + (-returncode)
    _write_marker({"exit": returncode})
    return returncode


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m hora.runner.remote [--probe]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--probe"]:
        print(json.dumps(probe_info()), flush=True)
        return 0
    if args:
        print("usage: python -m hora.runner.remote [--probe] (started by horarun over ssh)", file=sys.stderr)
        return 2
    return supervise()


if __name__ == "__main__":
    sys.exit(main())
