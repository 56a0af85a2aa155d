"""Network interfaces and addresses: which address a rank binds and advertises.

A rank of a job that spans hosts must listen on, and tell its peers, an address they can
reach. hora picks it in this order (``choose_bind_address``):

1. ``HORA_IFACE`` (``horarun --network-interfaces eth1,eth0``): the IPv4 address of the
   first listed interface this host has;
2. a job whose rendezvous server is on loopback runs on one host: ``127.0.0.1``;
3. otherwise the address this host uses to reach the rendezvous server (the kernel's
   route to it), which the other hosts of the job can reach too.

Everything here is read from the kernel (``SIOCGIFADDR`` and the routing table through a
connected UDP socket, which sends nothing); no command is run.
"""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Sequence

_SIOCGIFADDR = 0x8915


@dataclasses.dataclass(frozen=True)
class Interface:
    """One network interface of this host.

    Attributes:
        name: e.g. ``eth0``.
        address: its IPv4 address, or None when it has none (or is down).
    """

    name: str
    address: str | None

    @property
    def loopback(self) -> bool:
        return self.address is not None and is_loopback_address(self.address)


def interface_address(name: str) -> str | None:
    """Returns the IPv4 address of interface ``name``, or None (no such interface, no address)."""
    packed = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, packed)
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def interfaces() -> list[Interface]:
    """Returns this host's interfaces, in the kernel's order, with their IPv4 addresses."""
    return [Interface(name, interface_address(name)) for _, name in socket.if_nameindex()]


def split_names(text: str | None) -> tuple[str, ...]:
    """Splits ``"eth0, eth1"`` into ``("eth0", "eth1")``; None or empty gives ``()``."""
    return tuple(name.strip() for name in (text or "").split(",") if name.strip())


def pick_interface(names: Sequence[str]) -> Interface | None:
    """Returns the first of ``names`` that this host has with an IPv4 address, or None."""
    for name in names:
        address = interface_address(name)
        if address is not None:
            return Interface(name, address)
    return None


def is_loopback_address(address: str) -> bool:
    """True for ``127.0.0.0/8`` and ``::1``."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> str | None:
    """Returns the first IPv4 address ``host`` resolves to, or None."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    return str(infos[0][4][0]) if infos else None


def is_loopback(host: str) -> bool:
    """True when ``host`` (a name or an address) names this machine's loopback interface."""
    if host.lower() == "localhost":
        return True
    address = resolve(host)
    return address is not None and is_loopback_address(address)


def route_source(destination: str) -> str | None:
    """Returns the local address the kernel would use to send to ``destination``.

    Connecting a UDP socket sends nothing; it only picks the route and its source.

    Args:
        destination: a host name or IPv4 address.

    Returns:
        The source address, or None when the name does not resolve or no route exists.
    """
    address = resolve(destination)
    if address is None:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, 9))
        except OSError:
            return None
        return str(sock.getsockname()[0])


def network_id() -> str:
    """Names this process's network: the machine's boot id and its network namespace.

    Two processes can reach each other over loopback exactly when their ids are equal.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        namespace = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        namespace = "-"
    return f"{boot}/{namespace}"


def interface_of(address: str) -> str | None:
    """Returns the name of the interface that holds ``address``, or None."""
    for interface in interfaces():
        if interface.address == address:
            return interface.name
    return None


def choose_bind_address(iface_names: Sequence[str], rendezvous_host: str, local_address: str | None) -> str:
    """Picks the address a rank listens on and advertises (see the module docstring).

    Args:
        iface_names: ``HORA_IFACE`` split into names; empty when unset.
        rendezvous_host: the rendezvous server's address as the rank was given it.
        local_address: the address this rank's rendezvous connection comes from, or None.

    Returns:
        An IPv4 address of this host.

    Raises:
        ValueError: ``iface_names`` is not empty and this host has none of them; the
            message lists the interfaces it does have.
    """
    if iface_names:
        chosen = pick_interface(iface_names)
        if chosen is None or chosen.address is None:
            present = ", ".join(f"{i.name} ({i.address or 'no IPv4 address'})" for i in interfaces())
            raise ValueError(
                f"HORA_IFACE={','.join(iface_names)}: host {socket.gethostname()} has none of these interfaces "
                f"with an IPv4 address; it has {present} (fix --network-interfaces)"
            )
        return chosen.address
    if is_loopback(rendezvous_host):
        return "127.0.0.1"
    if local_address is not None:
        return local_address
    return route_source(rendezvous_host) or "127.0.0.1"
