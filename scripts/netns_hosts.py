"""Test hosts on one machine: network namespaces with veth pairs and a real OpenSSH server in each.

Used by hora's multi-host tests (``tests/test_multihost*.py``, ``tests/test_doctor*.py``)
and by hand::

    sudo python scripts/netns_hosts.py up 3        # prints the hosts and an ssh config, keeps running
    horarun -H 198.18.10.10:2,198.18.10.11:2 ...   # with HORA_SSH_OPTIONS="-F <printed config>"

Layout (``Cluster(count, subnets)``)::

    root namespace (horarun)          "switch" namespace             host namespaces
      hr<tag>0 198.18.X.1  -----veth----  bridge hb0  ----veth----  eth0 198.18.X.10 (host 0), .11, ...
      hr<tag>1 198.18.X+1.1 ----veth----  bridge hb1  ----veth----  eth1 198.18.X+1.10 ...

The bridges live in a namespace of their own, so the root namespace's firewall (which
``br_netfilter`` would apply to bridged traffic) never sees the test traffic. Addresses
come from 198.18.0.0/15 (reserved for network tests), on /24s no interface of this
machine uses. Every name carries a tag with this process's pid: resources of a run
whose process is gone are removed at the next ``up``.

Each host runs ``/usr/sbin/sshd -D`` in its namespace with its own config, host key and
log in a temporary directory, accepting only a client key generated for this run;
``ssh_config`` pins the host keys (``StrictHostKeyChecking yes``). ``down`` kills every
process left in the namespaces, deletes them, and removes the directory; it runs at
exit too.

Needs root, ``ip`` (iproute2), ``ssh``/``ssh-keygen``/``sshd`` (OpenSSH): see
``scripts/setup-system.sh``.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

PREFIX = "hora"
NET = "198.18"


def run(argv: Sequence[str], check: bool = True, namespace: str | None = None) -> subprocess.CompletedProcess[str]:
    """Runs a command (in ``namespace`` when given) and returns its result."""
    full = (["ip", "netns", "exec", namespace] if namespace else []) + list(argv)
    result = subprocess.run(full, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(namespace: str) -> list[int]:
    """The processes whose network namespace is ``namespace``."""
    result = run(["ip", "netns", "pids", namespace], check=False)
    return [int(word) for word in result.stdout.split() if word.isdigit()]


def _command_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


_SYSTEM_READY = False


def ensure_system() -> None:
    """Runs ``scripts/setup-system.sh`` once per process (installs what the tests start)."""
    global _SYSTEM_READY
    if _SYSTEM_READY:
        return
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "setup-system.sh")
    result = subprocess.run(["bash", script], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"scripts/setup-system.sh failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    _SYSTEM_READY = True


def clean_stale() -> None:
    """Removes the namespaces and links of earlier runs whose process is gone."""
    result = run(["ip", "netns", "list"], check=False)
    for line in result.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{PREFIX}(\d+)[a-z](\d+|sw)", name)
        if match and not _alive(int(match.group(1))):
            _delete_namespace(name)
    links = run(["ip", "-o", "link", "show"], check=False).stdout
    for match in re.finditer(r"\d+: (hr(\d+)[a-z]\d+)[@:]", links):
        if not _alive(int(match.group(2))):
            run(["ip", "link", "del", match.group(1)], check=False)


def _delete_namespace(name: str) -> None:
    for pid in namespace_pids(name):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    run(["ip", "netns", "del", name], check=False)


def _free_block(count: int) -> int:
    """A third octet X such that 198.18.X .. X+count-1 are unused here."""
    used = run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    candidates = list(range(0, 256 - count))
    random.shuffle(candidates)
    for third in candidates:
        if all(f"{NET}.{third + s}." not in used for s in range(count)):
            return third
    raise RuntimeError("no free /24 in 198.18.0.0/16 for the test hosts")


@dataclasses.dataclass
class Host:
    """One test host.

    Attributes:
        index: its number.
        namespace: its network namespace.
        addresses: its address on each subnet (``eth0``, ``eth1``, ...).
        sshd: its running sshd, or None once stopped.
    """

    index: int
    namespace: str
    addresses: list[str]
    sshd: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return self.addresses[0]


class Cluster:
    """``count`` hosts on ``subnets`` subnets; ``up()`` builds them, ``down()`` removes everything.

    Args:
        count: the number of hosts.
        subnets: interfaces per host (``eth0``, ``eth1``, ...), one subnet each.
    """

    def __init__(self, count: int, subnets: int = 1) -> None:
        self.count = count
        self.subnets = subnets
        self.tag = f"{PREFIX}{os.getpid()}{chr(ord('a') + random.randrange(26))}"
        self.switch = f"{self.tag}sw"
        self.hosts: list[Host] = []
        self.gateways: list[str] = []
        self.root_links: list[str] = []
        self.dir = ""
        self._up = False

    # --- set-up -----------------------------------------------------------------------------
    def up(self) -> Cluster:
        """Creates the namespaces, links, keys and sshds; waits until every sshd answers."""
        if os.geteuid() != 0:
            raise RuntimeError("network-namespace test hosts need root")
        clean_stale()
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        self.dir = tempfile.mkdtemp(prefix=f"{self.tag}-")
        self._up = True
        atexit.register(self.down)
        third = _free_block(self.subnets)
        run(["ip", "netns", "add", self.switch])
        run(["ip", "link", "set", "lo", "up"], namespace=self.switch)
        for subnet in range(self.subnets):
            net = f"{NET}.{third + subnet}"
            bridge = f"hb{subnet}"
            run(["ip", "link", "add", bridge, "type", "bridge"], namespace=self.switch)
            run(["ip", "link", "set", bridge, "up"], namespace=self.switch)
            root = f"hr{self.tag[len(PREFIX):]}{subnet}"
            self.root_links.append(root)
            run(["ip", "link", "add", root, "type", "veth", "peer", "name", f"up{subnet}", "netns", self.switch])
            run(["ip", "link", "set", f"up{subnet}", "master", bridge, "up"], namespace=self.switch)
            run(["ip", "addr", "add", f"{net}.1/24", "dev", root])
            run(["ip", "link", "set", root, "up"])
            self.gateways.append(f"{net}.1")
        self._client_key()
        for index in range(self.count):
            self.hosts.append(self._add_host(index, third))
        self._write_ssh_config()
        for host in self.hosts:
            self.start_sshd(host)
        return self

    def _add_host(self, index: int, third: int) -> Host:
        namespace = f"{self.tag}{index}"
        run(["ip", "netns", "add", namespace])
        run(["ip", "link", "set", "lo", "up"], namespace=namespace)
        addresses = []
        for subnet in range(self.subnets):
            address = f"{NET}.{third + subnet}.{10 + index}"
            port = f"p{index}s{subnet}"
            run(["ip", "link", "add", port, "type", "veth", "peer", "name", f"eth{subnet}", "netns", namespace],
                namespace=self.switch)  # fmt: skip
            run(["ip", "link", "set", port, "master", f"hb{subnet}", "up"], namespace=self.switch)
            run(["ip", "addr", "add", f"{address}/24", "dev", f"eth{subnet}"], namespace=namespace)
            run(["ip", "link", "set", f"eth{subnet}", "up"], namespace=namespace)
            addresses.append(address)
        run(["ip", "route", "add", "default", "via", f"{NET}.{third}.1"], namespace=namespace)
        host_dir = os.path.join(self.dir, f"host{index}")
        os.makedirs(host_dir)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(host_dir, "host_key")])
        return Host(index, namespace, addresses)

    def _client_key(self) -> None:
        self.key = os.path.join(self.dir, "id_ed25519")
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key])
        shutil.copy(self.key + ".pub", os.path.join(self.dir, "authorized_keys"))

    def _write_ssh_config(self) -> None:
        known = os.path.join(self.dir, "known_hosts")
        with open(known, "w") as handle:
            for host in self.hosts:
                with open(os.path.join(self.dir, f"host{host.index}", "host_key.pub")) as key:
                    public = " ".join(key.read().split()[:2])
                handle.write(f"{','.join(host.addresses)} {public}\n")
        self.ssh_config = os.path.join(self.dir, "ssh_config")
        with open(self.ssh_config, "w") as handle:
            handle.write(
                "Host *\n"
                "    User root\n"
                f"    IdentityFile {self.key}\n"
                "    IdentitiesOnly yes\n"
                f"    UserKnownHostsFile {known}\n"
                "    GlobalKnownHostsFile /dev/null\n"
                "    StrictHostKeyChecking yes\n"
                "    PasswordAuthentication no\n"
            )

    def sshd_config(self, host: Host) -> str:
        path = os.path.join(self.dir, f"host{host.index}", "sshd_config")
        listen = "".join(f"ListenAddress {address}\n" for address in host.addresses)
        with open(path, "w") as handle:
            handle.write(
                "Port 22\n"
                f"{listen}"
                f"HostKey {os.path.join(self.dir, f'host{host.index}', 'host_key')}\n"
                f"AuthorizedKeysFile {os.path.join(self.dir, 'authorized_keys')}\n"
                f"PidFile {os.path.join(self.dir, f'host{host.index}', 'sshd.pid')}\n"
                "PermitRootLogin prohibit-password\n"
                "PubkeyAuthentication yes\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "UsePAM no\n"
                "StrictModes no\n"
                "PrintMotd no\n"
                "MaxStartups 200\n"
                "MaxSessions 200\n"
                "LogLevel ERROR\n"
            )
        return path

    def start_sshd(self, host: Host, timeout: float = 10.0) -> None:
        """Starts (or restarts) the host's sshd and waits until it accepts connections."""
        config = self.sshd_config(host)
        log = os.path.join(self.dir, f"host{host.index}", "sshd.log")
        host.sshd = subprocess.Popen(
            ["ip", "netns", "exec", host.namespace, "/usr/sbin/sshd", "-D", "-f", config, "-E", log],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((host.address, 22), timeout=1):
                    return
            except OSError:
                if host.sshd.poll() is not None or time.monotonic() > deadline:
                    with open(log, errors="replace") as handle:
                        raise RuntimeError(f"sshd on test host {host.index} did not start: {handle.read()[-500:]}")
                time.sleep(0.05)

    def stop_sshd(self, host: Host) -> None:
        """Stops the host's sshd (its connections' processes are left alone)."""
        if host.sshd is not None and host.sshd.poll() is None:
            host.sshd.terminate()
            host.sshd.wait(timeout=10)
        host.sshd = None

    # --- use --------------------------------------------------------------------------------
    def ssh_options(self) -> str:
        """The value of ``HORA_SSH_OPTIONS`` that reaches these hosts."""
        return f"-F {self.ssh_config}"

    def pids(self, host: Host) -> list[int]:
        """Processes in the host's namespace other than sshd's own (the job's, if any are left)."""
        return [pid for pid in namespace_pids(host.namespace) if _command_name(pid) not in ("sshd", "")]

    def processes(self, host: Host) -> list[str]:
        """``pid command line`` of each process ``pids`` returns, for messages."""
        return [f"{pid} {_command_line(pid)}" for pid in self.pids(host)]

    def firewall(self, host: Host, allow: Sequence[int] = (22,)) -> None:
        """Drops every TCP connection to the host except to the ``allow`` ports (nftables in its namespace)."""
        ports = ", ".join(str(port) for port in allow)
        rules = (
            "table inet horatest {\n"
            "  chain input {\n"
            "    type filter hook input priority 0; policy accept;\n"
            f"    tcp dport != {{ {ports} }} ct state new drop\n"
            "  }\n"
            "}\n"
        )
        path = os.path.join(self.dir, f"host{host.index}", "firewall.nft")
        with open(path, "w") as handle:
            handle.write(rules)
        run(["nft", "-f", path], namespace=host.namespace)

    # --- tear-down --------------------------------------------------------------------------
    def down(self) -> None:
        """Kills every process in the hosts' namespaces, deletes namespaces and links, removes the keys."""
        if not self._up:
            return
        self._up = False
        for host in self.hosts:
            self.stop_sshd(host) if host.sshd is not None and host.sshd.poll() is None else None
            _delete_namespace(host.namespace)
        _delete_namespace(self.switch)
        for link in self.root_links:
            run(["ip", "link", "del", link], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2 or argv[0] != "up" or not argv[1].isdigit():
        print("usage: netns_hosts.py up COUNT  (Ctrl-C removes the hosts)", file=sys.stderr)
        return 2
    cluster = Cluster(int(argv[1])).up()
    print("hosts:", " ".join(host.address for host in cluster.hosts))
    print(f"export HORA_SSH_OPTIONS='{cluster.ssh_options()}'")
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
