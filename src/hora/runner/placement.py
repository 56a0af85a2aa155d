"""Which hosts are this machine, which are reached over ssh, and where their ranks find the launcher.

A job whose hosts are all this machine keeps everything on loopback: the rendezvous
server listens on ``127.0.0.1`` and no rank opens a port anyone else can reach.

A job with another host first probes every remote host over ssh (``ssh.probe_hosts``:
reachable without a prompt, same Python path, same hora version), then:

* the rendezvous server listens on every interface (it lets in only holders of the
  job secret);
* the ranks of a remote host reach it at the address that host's ssh connection came
  from (``SSH_CONNECTION``), which is, by construction, an address of this machine the
  host can reach; when ssh does not tell, the kernel's route to the host decides;
* the ranks on this machine reach it at the address the first remote host sees, so
  the address they in turn advertise is one the other hosts can reach, never loopback.

Every problem found here is one line that names the host and the fix; nothing has
been started when one is raised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from hora.runner.hosts import SlotInfo
from hora.runner.ssh import HostInfo, SshSettings, probe_hosts
from hora.transport import netif
from hora.version import __version__

LOOPBACK = "127.0.0.1"
ANY = "0.0.0.0"


class HostsError(ValueError):
    """Some hosts cannot take part; ``lines`` holds one line per problem."""

    def __init__(self, lines: Sequence[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = list(lines)


@dataclasses.dataclass(frozen=True)
class Placement:
    """How the job's hosts are reached.

    Attributes:
        remote_hosts: the hosts reached over ssh.
        server_bind: the address the rendezvous server listens on.
        rendezvous_addr: host -> the address its ranks reach the rendezvous server at.
        ssh: how remote hosts are reached (None when every host is this machine).
        probes: host -> what its probe found.
    """

    remote_hosts: frozenset[str]
    server_bind: str
    rendezvous_addr: Mapping[str, str]
    ssh: SshSettings | None = None
    probes: Mapping[str, HostInfo] = dataclasses.field(default_factory=dict)

    @classmethod
    def all_local(cls, hosts: Sequence[str]) -> Placement:
        return cls(frozenset(), LOOPBACK, {host: LOOPBACK for host in hosts})

    def is_remote(self, host: str) -> bool:
        return host in self.remote_hosts


def plan_placement(
    slots: Sequence[SlotInfo],
    ssh: SshSettings,
    is_local: Callable[[str], bool],
    probe: Callable[[Sequence[str], SshSettings], Mapping[str, HostInfo | str]] = probe_hosts,
) -> Placement:
    """Works out how to reach every host that runs a rank.

    Args:
        slots: the ranks' places.
        ssh: how to reach remote hosts.
        is_local: tells whether a host name names this machine.
        probe: probes remote hosts (``ssh.probe_hosts``; injectable for tests).

    Returns:
        The placement.

    Raises:
        HostsError: a host cannot be reached, runs another hora version, or no address
            of this machine reaches it; one line per host.
    """
    hosts = list(dict.fromkeys(slot.hostname for slot in slots))
    remote = [host for host in hosts if not is_local(host)]
    if not remote:
        return Placement.all_local(hosts)
    found = probe(remote, ssh)
    problems: list[str] = []
    infos: dict[str, HostInfo] = {}
    for host in remote:
        info = found[host]
        if isinstance(info, str):
            problems.append(info)
            continue
        if info.hora != __version__:
            problems.append(
                f"host {host}: runs hora {info.hora}, this machine runs hora {__version__}: install the same "
                "version on every host"
            )
            continue
        infos[host] = info
    if problems:
        raise HostsError(problems)
    addresses: dict[str, str] = {}
    for host in remote:
        address = infos[host].launcher_address
        if address is None or netif.is_loopback_address(address):
            address = netif.route_source(host)
        if address is None or netif.is_loopback_address(address):
            problems.append(
                f"host {host}: no address of this machine reaches it (ssh did not say where it came from and "
                "there is no route): check the host's name"
            )
            continue
        addresses[host] = address
    if problems:
        raise HostsError(problems)
    first = addresses[remote[0]]
    for host in hosts:
        addresses.setdefault(host, first)
    return Placement(frozenset(remote), ANY, addresses, ssh, infos)
