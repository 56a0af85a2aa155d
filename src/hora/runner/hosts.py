"""Hosts, their slots, and which rank runs where.

``horarun`` takes its hosts from ``-H/--hosts`` (``"h1:2,h2:4"``; a host without
``:N`` has one slot) or from ``--hostfile`` (one ``host slots=N`` per line, ``#``
comments, blank lines ignored). Without either, the job runs on ``localhost:<np>``.

Ranks fill the slots in order: every slot of the first host, then the second host's,
and so on, until ``np`` ranks are placed; hosts left without a rank take no part.
For each rank this module computes the topology Horovod defines:

``local_rank`` / ``local_size``
    the rank's index among the ranks on its host, and how many there are.
``cross_rank`` / ``cross_size``
    the index of the rank's host among the hosts that have a rank with the same
    ``local_rank``, and how many such hosts there are.

Host names are kept as written: two different names are two hosts, even when both
name this machine (``-H localhost:2,127.0.0.1:2`` runs a two-host job on one
machine, which exercises the cross-host code paths).

``is_local_host`` tells which hosts are this machine; ranks on any other host are
started over ssh (``hora.runner.placement``, ``hora.runner.ssh``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from collections.abc import Sequence

LOCALHOST = "localhost"


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """One host and the number of ranks it may run.

    Attributes:
        name: the host name or address, as the user wrote it.
        slots: how many ranks the host may run (>= 1).
    """

    name: str
    slots: int

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """Where one rank runs and its place in the job's topology.

    Invariants: ``0 <= rank < size``, ``0 <= local_rank < local_size``,
    ``0 <= cross_rank < cross_size``.
    """

    hostname: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def _parse_slots(text: str, where: str, entry: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{where}: {entry!r} is not valid: the slot count must be an integer >= 1")
    return int(text)


def parse_host(entry: str, where: str = "-H/--hosts") -> HostSpec:
    """Parses one ``HOST``, ``HOST:SLOTS`` or ``[IPV6]:SLOTS`` entry.

    Args:
        entry: the text of the entry.
        where: where the entry came from, for error messages.

    Returns:
        The host and its slots (1 when no count is given).

    Raises:
        ValueError: the entry is empty or its slot count is not an integer >= 1.
    """
    text = entry.strip()
    if text.startswith("["):
        address, bracket, rest = text[1:].partition("]")
        if not bracket or not address or (rest and not rest.startswith(":")):
            raise ValueError(f"{where}: {entry!r} is not valid: expected [ADDRESS] or [ADDRESS]:SLOTS")
        return HostSpec(address, _parse_slots(rest[1:], where, entry) if rest else 1)
    if text.count(":") > 1:
        raise ValueError(f"{where}: {entry!r} is not valid: write an IPv6 address in brackets, as [ADDRESS]:SLOTS")
    name, colon, slots = text.partition(":")
    if not name:
        raise ValueError(f"{where}: {entry!r} is not valid: expected HOST or HOST:SLOTS")
    return HostSpec(name, _parse_slots(slots, where, entry) if colon else 1)


def parse_hosts(text: str) -> list[HostSpec]:
    """Parses the value of ``-H/--hosts``, e.g. ``"h1:2,h2:4"``.

    Args:
        text: comma-separated host entries.

    Returns:
        The hosts, in the order given.

    Raises:
        ValueError: an entry is malformed, a host is listed twice, or no host is given.
    """
    hosts = [parse_host(entry) for entry in text.split(",") if entry.strip()]
    if not hosts:
        raise ValueError(f"-H/--hosts: {text!r} names no host: expected HOST[:SLOTS],HOST[:SLOTS],...")
    _check_unique(hosts, "-H/--hosts")
    return hosts


def parse_hostfile(path: str) -> list[HostSpec]:
    """Reads a host file: one ``host slots=N`` (or just ``host``) per line.

    Args:
        path: the file's path. ``#`` starts a comment; blank lines are ignored.

    Returns:
        The hosts, in file order.

    Raises:
        ValueError: the file cannot be read, a line is malformed (named by line
            number), a host is listed twice, or the file names no host.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as exc:
        raise ValueError(f"--hostfile: cannot read {path!r}: {exc.strerror or exc}") from None
    hosts = []
    for number, raw in enumerate(lines, start=1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--hostfile {path}, line {number}"
        slots = 1
        for word in words[1:]:
            key, equals, value = word.partition("=")
            if key != "slots" or not equals:
                raise ValueError(f"{where}: {raw.strip()!r} is not valid: expected 'HOST slots=N'")
            slots = _parse_slots(value, where, raw.strip())
        host = parse_host(words[0], where)
        hosts.append(host if len(words) == 1 else HostSpec(host.name, slots))
    if not hosts:
        raise ValueError(f"--hostfile: {path!r} names no host: expected lines of 'HOST slots=N'")
    _check_unique(hosts, f"--hostfile {path}")
    return hosts


def _check_unique(hosts: Sequence[HostSpec], where: str) -> None:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise ValueError(f"{where}: host {host.name!r} is listed twice: list each host once with its total slots")
        seen.add(host.name)


def assign_slots(hosts: Sequence[HostSpec], num_proc: int) -> list[SlotInfo]:
    """Places ``num_proc`` ranks on the hosts' slots, in order, and computes the topology.

    Args:
        hosts: the hosts, in the order their slots are filled.
        num_proc: the number of ranks (>= 1).

    Returns:
        One ``SlotInfo`` per rank, indexed by rank.

    Raises:
        ValueError: ``num_proc`` is below 1 or exceeds the total number of slots.

    Example: ``assign_slots(parse_hosts("a:2,b:2"), 3)`` places ranks 0 and 1 on
    ``a`` (local ranks 0, 1; local size 2) and rank 2 on ``b`` (local rank 0, local
    size 1). Local rank 0 exists on both hosts, so ranks 0 and 2 have cross ranks 0
    and 1 of cross size 2; rank 1 has cross rank 0 of cross size 1.
    """
    if num_proc < 1:
        raise ValueError(f"-np {num_proc} is not valid: expected at least 1 process")
    total = sum(host.slots for host in hosts)
    if num_proc > total:
        listed = ",".join(str(host) for host in hosts)
        raise ValueError(
            f"-np {num_proc} exceeds the {total} slot{'s' if total != 1 else ''} of the hosts ({listed}): "
            f"lower -np to {total} or give the hosts more slots (-H host:N or 'host slots=N' in the host file)"
        )
    placed: list[tuple[str, int]] = []  # (host, local rank) by rank
    local_sizes: dict[str, int] = {}
    for host in hosts:
        count = min(host.slots, num_proc - len(placed))
        if count == 0:
            break
        local_sizes[host.name] = count
        placed.extend((host.name, local_rank) for local_rank in range(count))
    # Hosts in order (dicts keep insertion order) that hold a rank with each local rank.
    cross_hosts: dict[int, list[str]] = {}
    for name, size in local_sizes.items():
        for local_rank in range(size):
            cross_hosts.setdefault(local_rank, []).append(name)
    return [
        SlotInfo(
            hostname=name,
            rank=rank,
            size=num_proc,
            local_rank=local_rank,
            local_size=local_sizes[name],
            cross_rank=cross_hosts[local_rank].index(name),
            cross_size=len(cross_hosts[local_rank]),
        )
        for rank, (name, local_rank) in enumerate(placed)
    ]


def is_local_host(name: str) -> bool:
    """Tells whether a host name or address names this machine.

    Args:
        name: a host name or an IPv4/IPv6 address.

    Returns:
        True for ``localhost``, loopback addresses, this machine's host name and
        fully qualified name, and any name that resolves to an address this
        machine can bind; False otherwise (including names that do not resolve).
    """
    lowered = name.lower()
    if lowered == LOCALHOST or lowered == socket.gethostname().lower():
        return True
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        address = str(sockaddr[0]).split("%", 1)[0]
        try:
            if ipaddress.ip_address(address).is_loopback:
                return True
        except ValueError:
            continue
        if _can_bind(family, sockaddr):
            return True
    return lowered == socket.getfqdn().lower()


def _can_bind(family: int, sockaddr: tuple[object, ...]) -> bool:
    # Only an address of one of this machine's interfaces can be bound.
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((sockaddr[0], 0, *sockaddr[2:]))
    except OSError:
        return False
    return True


def plan(num_proc: int, hosts: str | None = None, hostfile: str | None = None) -> list[SlotInfo]:
    """Turns the host options into one ``SlotInfo`` per rank.

    Args:
        num_proc: the number of ranks.
        hosts: the ``-H/--hosts`` value, or None.
        hostfile: the ``--hostfile`` path, or None.

    Returns:
        The assignment, indexed by rank.

    Raises:
        ValueError: both ``hosts`` and ``hostfile`` are given, the hosts are
            malformed, or they have fewer slots than ``num_proc``.
    """
    if hosts is not None and hostfile is not None:
        raise ValueError("-H/--hosts and --hostfile are exclusive: give one of them")
    if hosts is not None:
        specs = parse_hosts(hosts)
    elif hostfile is not None:
        specs = parse_hostfile(hostfile)
    else:
        specs = [HostSpec(LOCALHOST, max(num_proc, 1))]
    return assign_slots(specs, num_proc)
