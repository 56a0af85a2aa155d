"""Test hosts on one machine: network namespaces with veth pairs and a real OpenSSH server in each.

Used by hora's multi-host tests (``tests/test_multihost*.py``, ``tests/test_doctor*.py``)
and by hand::

    sudo python scripts/netns_hosts.py up 3        # prints the hosts and an ssh config, keeps running
    sudo python scripts/netns_hosts.py up 4 --rate 1gbit   # the same, each host's link shaped to 1 Gbit/s
    sudo python scripts/netns_hosts.py up 4 --own-hostname # gloo (torch, Horovod) binds the host's address
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

Shaped links (``Cluster(count, rate="1gbit")``, ``up N --rate 1gbit``): each host's
link is rate-limited in both directions with a token-bucket filter (``tc qdisc ... tbf``;
netem is not available on every machine this runs on): on the host's ``ethN`` (what the
host sends) and on the switch's end of the same veth pair (what the host receives), so a
host sends at most ``rate`` and receives at most ``rate`` at once, as on a full-duplex
switch port. The bridges, the root namespace's links and loopback stay unshaped. Choice
of the filter's parameters (``tbf_parameters``):

* ``burst`` = what the link carries in 1 ms (125 KB at 1 Gbit/s, 1.25 MB at 10 Gbit/s),
  at least 64 KiB. tbf refills its bucket from a timer, and a 2-core machine under load
  fires it late: a bucket smaller than the rate times that delay caps the throughput below
  the rate (at 10 Gbit/s a 64 KiB bucket is emptied in 52 us). 1 ms of burst is a 0.1%
  excursion over a 1 s transfer, invisible in the collectives' times;
* ``latency`` 50 ms: the queue may hold 50 ms of traffic (6.25 MB at 1 Gbit/s) before tbf
  drops. The host side rarely queues much (TCP small queues holds each socket to about a
  millisecond of its rate in the qdisc), but the switch side queues whatever the bridge
  forwards, several senders to one host at once included (a broadcast's root, alltoall),
  and a drop costs TCP a retransmission and a smaller window. With these values the
  benchmark's runs dropped nothing, or a handful of packets in tens of GB (``qdisc_stats``).

Host names (``Cluster(..., own_hostname=True)``): every namespace shares this machine's
host name, which ``/etc/hosts`` usually maps to a loopback address. With ``own_hostname``
each host gets an ``/etc/netns/<namespace>/hosts`` (``ip netns exec``, which starts the
host's sshd, mounts it over ``/etc/hosts``) in which that name resolves to the host's own
address, as a real host's name resolves to its address. Libraries that pick their
address from the host name need it: torch's gloo without ``GLOO_SOCKET_IFNAME``, and
Horovod 0.28.1's gloo process-set contexts, which ignore ``HOROVOD_GLOO_IFACE`` and would
bind 127.0.0.1 (its cross-host jobs then fail with "connect [127.0.0.1]: Connection refused").

TCP congestion control (``Cluster(..., congestion="cubic,reno")``, ``--congestion``): each
host namespace may use its own (``net.ipv4.tcp_congestion_control``); the first of the
comma-separated names the kernel accepts there is set (a namespace other than the first
may only pick one of ``net.ipv4.tcp_allowed_congestion_control``: reno always, cubic when
listed). Default: the machine's own. This matters on shaped links: a machine whose default
is BBR paces every socket from a kernel timer and cycles its sending rate below the
estimated bandwidth, and on a 2-core machine under load that leaves a shaped link idle for
up to 8% of a long transfer, where cubic and reno (what most clusters' hosts run) keep it full.

The rate is the frame rate: Ethernet, IP and TCP headers (66 bytes per 1,448 of payload at
the default MTU of 1,500) count against it, so TCP payload tops out at ~95.6% of the rate.
``qdisc_stats()`` reads what the filters sent, dropped and held back, for a benchmark to
report.

Needs root, ``ip`` and ``tc`` (iproute2; ``tc`` for shaped links), ``ssh``/``ssh-keygen``/``sshd``
(OpenSSH): see ``scripts/setup-system.sh``.
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
    shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)


NETNS_ETC = "/etc/netns"  # ip netns exec mounts NETNS_ETC/<namespace>/<file> over /etc/<file>


def _write_hosts_file(namespace: str, address: str) -> None:
    """An ``/etc/hosts`` for ``namespace`` in which this machine's host name resolves to ``address``."""
    directory = os.path.join(NETNS_ETC, namespace)
    os.makedirs(directory, exist_ok=True)
    names = " ".join(name for name in dict.fromkeys([socket.gethostname(), socket.getfqdn()]) if name != "localhost")
    with open(os.path.join(directory, "hosts"), "w") as handle:
        handle.write(f"127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n{address} {names}\n")


_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)", re.IGNORECASE)
_RATE_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}  # tc's units are decimal


def parse_rate(text: str) -> float:
    """A ``tc`` rate (``1gbit``, ``500mbit``, ``10Gbit``, ``100mbps``) in bits per second.

    Raises:
        ValueError: not a rate ``tc`` takes, naming the text.
    """
    match = _RATE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"rate {text!r} is not valid: expected a number and a unit such as 1gbit, 500mbit, 10gbit")
    bits = float(match.group(1)) * _RATE_SCALE[match.group(2).lower()] * (8 if match.group(3).lower() == "bps" else 1)
    if bits <= 0:
        raise ValueError(f"rate {text!r} is not valid: expected a rate above zero")
    return bits


BURST_SECONDS = 1e-3  # the bucket holds what the link carries in this long ...
BURST_MIN = 64 * 1024  # ... but at least this many bytes
LATENCY = "50ms"  # the longest a packet may wait in the filter's queue before tbf drops it


def tbf_parameters(rate: str) -> list[str]:
    """The ``tc qdisc ... tbf`` arguments that shape a link to ``rate`` (see the module docstring)."""
    burst = max(int(parse_rate(rate) / 8 * BURST_SECONDS), BURST_MIN)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", LATENCY]


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
        rate: shape each host's links to this ``tc`` rate in both directions (``1gbit``,
            ``10gbit``), or None to leave them unshaped.
        congestion: TCP congestion control for the hosts: the first of these comma-separated
            names the kernel accepts in a host's namespace (``cubic,reno``); None keeps the
            machine's default.
        own_hostname: inside each host, this machine's host name resolves to the host's
            own address (see the module docstring).

    Raises:
        ValueError: ``rate`` is not a rate ``tc`` takes.
    """

    def __init__(
        self, count: int, subnets: int = 1, rate: str | None = None, congestion: str | None = None,
        own_hostname: bool = False,
    ) -> None:  # fmt: skip
        if rate is not None:
            parse_rate(rate)
        self.count = count
        self.subnets = subnets
        self.rate = rate
        self.congestion = congestion
        self.own_hostname = own_hostname
        self.congestion_used = ""  # what the hosts run, once up
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
            if self.rate is not None:  # what the host sends, and what the switch sends it
                run(["tc", "qdisc", "replace", "dev", f"eth{subnet}", "root", *tbf_parameters(self.rate)],
                    namespace=namespace)  # fmt: skip
                run(["tc", "qdisc", "replace", "dev", port, "root", *tbf_parameters(self.rate)], namespace=self.switch)
            addresses.append(address)
        run(["ip", "route", "add", "default", "via", f"{NET}.{third}.1"], namespace=namespace)
        self._set_congestion(namespace)
        if self.own_hostname:
            _write_hosts_file(namespace, addresses[0])
        host_dir = os.path.join(self.dir, f"host{index}")
        os.makedirs(host_dir)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(host_dir, "host_key")])
        return Host(index, namespace, addresses)

    def _set_congestion(self, namespace: str) -> None:
        key = "net.ipv4.tcp_congestion_control"
        if self.congestion is not None:
            names = [name.strip() for name in self.congestion.split(",") if name.strip()]
            if not any(run(["sysctl", "-qw", f"{key}={name}"], check=False, namespace=namespace).returncode == 0
                       for name in names):  # fmt: skip
                allowed = run(["sysctl", "-n", "net.ipv4.tcp_allowed_congestion_control"], check=False).stdout.strip()
                raise RuntimeError(
                    f"congestion control {self.congestion!r}: the kernel accepts none of these in a network namespace "
                    f"(net.ipv4.tcp_allowed_congestion_control: {allowed or '?'})"
                )
        self.congestion_used = run(["sysctl", "-n", key], namespace=namespace).stdout.strip()

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

    def qdisc_stats(self) -> dict[str, int]:
        """Totals over every shaped link's filter: ``sent`` bytes, ``dropped`` and ``overlimits`` packets.

        All zero when the links are not shaped. Counters run from ``up()``.
        """
        totals = {"sent": 0, "dropped": 0, "overlimits": 0}
        if self.rate is None:
            return totals
        places = [(host.namespace, f"eth{subnet}") for host in self.hosts for subnet in range(self.subnets)]
        places += [(self.switch, f"p{host.index}s{subnet}") for host in self.hosts for subnet in range(self.subnets)]
        for namespace, device in places:
            text = run(["tc", "-s", "qdisc", "show", "dev", device], check=False, namespace=namespace).stdout
            match = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+), overlimits (\d+)", text)
            if match:
                for key, value in zip(totals, match.groups()):
                    totals[key] += int(value)
        return totals

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
    usage = (
        "usage: netns_hosts.py up COUNT [--rate RATE] [--congestion NAMES] [--own-hostname]  (RATE as tc takes it: "
        "1gbit, 10gbit; NAMES: TCP congestion control, the first the kernel accepts, e.g. cubic,reno; "
        "--own-hostname: this machine's name resolves to each host's own address there; Ctrl-C removes the hosts)"
    )
    own_hostname = "--own-hostname" in argv
    argv = [word for word in argv if word != "--own-hostname"]
    options = dict(zip(argv[2::2], argv[3::2]))
    if (len(argv) % 2 or len(argv) < 2 or argv[0] != "up" or not argv[1].isdigit()
            or not set(options) <= {"--rate", "--congestion"}):  # fmt: skip
        print(usage, file=sys.stderr)
        return 2
    rate = options.get("--rate")
    try:
        cluster = Cluster(int(argv[1]), rate=rate, congestion=options.get("--congestion"), own_hostname=own_hostname)
    except ValueError as exc:
        print(f"netns_hosts.py: {exc}", file=sys.stderr)
        return 2
    cluster.up()
    print("hosts:", " ".join(host.address for host in cluster.hosts))
    if rate is not None:
        print(f"links: {rate} each way per host (tc {' '.join(tbf_parameters(rate))})")
    print(f"TCP congestion control: {cluster.congestion_used}")
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
