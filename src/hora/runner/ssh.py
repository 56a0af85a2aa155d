"""Reaching other hosts over ssh: the command line, a probe of each host, and errors in plain words.

``horarun`` starts every remote rank as ``ssh [options] HOST <python> -m hora.runner.remote``
(``hora.runner.remote`` supervises the rank there). The options are fixed and safe for
a program to use: no terminal (``-T``), never a password prompt (``BatchMode=yes``), a
connect timeout, keep-alives so a host that vanishes is noticed within seconds, quiet
(``LogLevel=ERROR``); then ``-p``/``-i`` from ``--ssh-port``/``--ssh-identity-file``,
then ``HORA_SSH_OPTIONS`` (e.g. ``-F ~/.ssh/cluster_config``). Host keys are checked as
the user's ssh configuration says: hora never turns host key checking off.

Before a job starts, ``probe_hosts`` runs ``hora.runner.remote --probe`` on every remote
host at once. It proves that ssh works without a prompt, that the same Python path
exists there with hora importable, and reports the host's name, Python and hora
versions, clock, interfaces and the address the ssh connection came in on
(``SSH_CONNECTION``): the address at which that host reaches this machine. Any failure
becomes one line naming the host and the fix (``describe_failure``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from hora import config

CONNECT_TIMEOUT = 10  # seconds ssh waits for a connection
PROBE_TIMEOUT = 30.0  # seconds a whole probe may take
# ssh reports errors of its own with exit status 255.
SSH_FAILED = 255


@dataclasses.dataclass(frozen=True)
class SshSettings:
    """How ``horarun`` reaches remote hosts.

    Attributes:
        port: ``-p/--ssh-port``, or None for ssh's default.
        identity_file: ``-i/--ssh-identity-file``, or None.
        options: further ssh arguments (``HORA_SSH_OPTIONS``).
        connect_timeout: seconds ssh waits for a connection.
    """

    port: int | None = None
    identity_file: str | None = None
    options: tuple[str, ...] = ()
    connect_timeout: int = CONNECT_TIMEOUT

    @classmethod
    def from_env(
        cls, port: int | None, identity_file: str | None, environ: Mapping[str, str] | None = None
    ) -> SshSettings:
        """Settings from the flags and ``HORA_SSH_OPTIONS``.

        Raises:
            ValueError: ``HORA_SSH_OPTIONS`` is not valid shell quoting, or the identity
                file does not exist (named, with the flag).
        """
        if identity_file is not None and not os.path.isfile(identity_file):
            raise ValueError(f"-i/--ssh-identity-file: {identity_file!r} is not a file: give the path of a private key")
        return cls(port, identity_file, tuple(config.ssh_options(environ)))

    def command(self, host: str, remote: str) -> list[str]:
        """Returns the ``ssh`` argument list that runs ``remote`` (a shell command) on ``host``."""
        argv = [
            "ssh",
            "-T",
            "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={self.connect_timeout}",
            "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=3",
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file is not None:
            argv += ["-i", self.identity_file, "-o", "IdentitiesOnly=yes"]
        argv += list(self.options)
        return argv + ["--", host, remote]

    def flags(self) -> str:
        """The ssh flags in use, as a person would type them, for messages."""
        parts = []
        if self.port is not None:
            parts.append(f"-p {self.port}")
        if self.identity_file is not None:
            parts.append(f"-i {self.identity_file}")
        return " ".join(parts + [shlex.quote(option) for option in self.options])


def remote_python_command(
    args: Sequence[str], environ: Mapping[str, str] | None = None, module: str = "hora.runner.remote"
) -> str:
    """The shell command that runs ``<this python> -m <module> ARGS`` on a remote host.

    ``PYTHONPATH`` (not secret) goes on the command line, so a hora that is importable
    here only through it is importable there too; everything else the rank needs
    travels on the supervisor's stdin, out of sight of ``ps``.
    """
    env = os.environ if environ is None else environ
    prefix = ""
    if env.get("PYTHONPATH"):
        prefix = f"PYTHONPATH={shlex.quote(env['PYTHONPATH'])} "
    words = " ".join(shlex.quote(arg) for arg in args)
    return f"exec env {prefix}{shlex.quote(sys.executable)} -m {module} {words}".rstrip()


@dataclasses.dataclass(frozen=True)
class HostInfo:
    """What a probe of one host found.

    Attributes:
        host: the host as the user named it.
        hostname: the host's own name.
        python: its Python version (``3.11.7``).
        executable: the Python that ran the probe.
        hora: its hora version.
        launcher_address: the address the host sees this machine's ssh connection
            come from (None for this machine itself).
        host_address: the host's address that the ssh connection reached.
        clock_offset: the host's clock minus this machine's, in seconds (the probe's
            round trip halved is taken off).
        round_trip: seconds the probe took.
        interfaces: the host's interfaces and their IPv4 addresses.
    """

    host: str
    hostname: str
    python: str
    executable: str
    hora: str
    launcher_address: str | None
    host_address: str | None
    clock_offset: float
    round_trip: float
    interfaces: tuple[tuple[str, str | None], ...]


def describe_failure(host: str, returncode: int, stderr: str, ssh: SshSettings) -> str:
    """Turns a failed ssh command into one line that names the host and the fix.

    Args:
        host: the host as the user named it.
        returncode: the exit status of ``ssh``.
        stderr: what ssh and the remote command wrote to stderr.
        ssh: the settings used.

    Returns:
        e.g. ``"host node3: cannot connect over ssh (port 22): connection refused; ..."``.
    """
    text = stderr.strip()
    lowered = text.lower()
    port = ssh.port if ssh.port is not None else 22
    last = text.splitlines()[-1].strip() if text else f"exit status {returncode}"
    if returncode == SSH_FAILED or lowered.startswith("ssh:"):
        if "could not resolve hostname" in lowered or "name or service not known" in lowered:
            return f"host {host}: unknown host (the name does not resolve): fix the name in -H/--hosts or --hostfile"
        if "connection refused" in lowered:
            return (
                f"host {host}: cannot connect over ssh (port {port}): connection refused: check that sshd runs "
                "there, or give the right port with -p/--ssh-port"
            )
        if "timed out" in lowered:
            return (
                f"host {host}: cannot connect over ssh (port {port}): timed out: the host is down or a firewall "
                "drops the connection; check that `ssh HOST true` works from this machine"
            )
        if "no route to host" in lowered or "network is unreachable" in lowered:
            return f"host {host}: unreachable: no route to it (is it up, is the name right?)"
        if "host key verification failed" in lowered or "remote host identification has changed" in lowered:
            return (
                f"host {host}: ssh host key verification failed: add the host's key to known_hosts "
                f"(run `ssh {host} true` once and check the fingerprint)"
            )
        if "permission denied" in lowered:
            return (
                f"host {host}: ssh refused the login (permission denied): set up key-based login "
                "(ssh-copy-id) or give the key with -i/--ssh-identity-file"
            )
        return f"host {host}: ssh failed: {last}"
    if returncode == 127 or ("no such file or directory" in lowered and sys.executable in text):
        return (
            f"host {host}: {sys.executable} does not exist there: install Python and hora at the same path on "
            "every host (a shared virtualenv or the same image)"
        )
    if "no module named" in lowered:
        return (
            f"host {host}: hora is not installed for {sys.executable} there: pip install the same hora on every "
            "host (or share the virtualenv)"
        )
    return f"host {host}: the remote check failed: {last}"


def probe(host: str, ssh: SshSettings, timeout: float = PROBE_TIMEOUT) -> HostInfo | str:
    """Runs ``hora.runner.remote --probe`` on ``host`` over ssh.

    Returns:
        What the probe found, or one line that says what is wrong (``describe_failure``).
    """
    command = ssh.command(host, remote_python_command(["--probe"]))
    started = time.time()
    try:
        result = subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, errors="replace"
        )
    except FileNotFoundError:
        return "ssh is not installed on this machine: install an OpenSSH client (apt-get install openssh-client)"
    except subprocess.TimeoutExpired:
        return f"host {host}: the ssh check did not finish within {timeout:g} s: check that `ssh {host} true` works"
    finished = time.time()
    if result.returncode != 0:
        return describe_failure(host, result.returncode, result.stderr, ssh)
    return parse_probe(host, result.stdout, started, finished) or describe_failure(host, 1, result.stderr, ssh)


def parse_probe(host: str, stdout: str, started: float, finished: float) -> HostInfo | None:
    """Reads the JSON line ``--probe`` prints; None when there is none."""
    for line in reversed(stdout.splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if not isinstance(data, dict) or "hora" not in data:
            continue
        connection = str(data.get("ssh_connection") or "").split()
        round_trip = finished - started
        return HostInfo(
            host=host,
            hostname=str(data.get("hostname", "")),
            python=str(data.get("python", "")),
            executable=str(data.get("executable", "")),
            hora=str(data.get("hora", "")),
            launcher_address=connection[0] if len(connection) == 4 else None,
            host_address=connection[2] if len(connection) == 4 else None,
            clock_offset=float(data.get("time", finished)) - (started + finished) / 2,
            round_trip=round_trip,
            interfaces=tuple(
                (str(name), None if address is None else str(address)) for name, address in data.get("interfaces", [])
            ),
        )
    return None


def probe_hosts(hosts: Sequence[str], ssh: SshSettings, timeout: float = PROBE_TIMEOUT) -> dict[str, HostInfo | str]:
    """Probes every host at once.

    Returns:
        host -> what its probe found, or the one-line error.
    """
    if not hosts:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        futures = {host: pool.submit(probe, host, ssh, timeout) for host in hosts}
        return {host: future.result() for host, future in futures.items()}
