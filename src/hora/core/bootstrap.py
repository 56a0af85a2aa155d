"""How a rank finds its job's rendezvous, and which address it advertises to its peers.

``hora.core.runtime`` calls ``open_rendezvous`` at ``init()`` for a job of more than one rank:

* under ``horarun`` the launcher runs the server and every rank's environment names it;
* under ``mpirun``, ``srun`` or torchrun-style variables rank 0 runs the server itself
  (``RendezvousServer`` in its own process) at the address and port ``hora.config.launchers``
  worked out, and stops it once the job's connections are made;
* under torchrun itself, whose agent holds ``MASTER_PORT``, rank 0 runs it on a free port
  and writes that port in the agent's store, where the other ranks read it (``_AgentStore``);
* under ``mpirun`` with whatever the environment left open (no ``HORA_SECRET``, no
  address or port), rank 0 creates it: a fresh secret, a free port, its own address,
  and broadcasts them with mpi4py (``MPI.COMM_WORLD.Bcast`` of a fixed binary record,
  never a pickle); for a job over a sub-communicator (``init(comm=...)``) rank 0 of the
  communicator does it, through the communicator.

``advertise`` then publishes every rank's host, network (``netif.network_id``: the
machine and network namespace) and chosen address under ``addr/<generation>/<rank>``,
and refuses a job that spans networks while some rank would advertise a loopback
address (its peers could never reach it), naming the rank, its host and the fix. It
returns every rank's host name, from which ``hora.core.runtime`` works out the local and cross
ranks when the launcher's variables do not say them.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import struct
from collections.abc import Sequence
from typing import Any

from hora.config import Config, Topology
from hora.config.launchers import AgentStore
from hora.engine.mpi_collectives import initialized_mpi
from hora.errors import HoraInternalError
from hora.transport import auth, netif
from hora.transport.rendezvous import RendezvousClient, RendezvousTimeout
from hora.transport.rendezvous_server import RendezvousServer

log = logging.getLogger(__name__)

_RECORD = 1024  # bytes of the MPI broadcast: status, port, secret, address or error text
_HEADER = struct.Struct("<BHH")  # status (1 ok, 2 error), port, length of the secret


@dataclasses.dataclass
class Rendezvous:
    """A connected rendezvous client, and the server this rank runs, if any.

    Attributes:
        client: the connection to the job's rendezvous server.
        secret: the job secret (from the environment or from rank 0 through MPI).
        server: the server this rank runs (rank 0 without ``horarun``), else None.
        published: torchrun's agent store, where rank 0 wrote the server's port, else None.
    """

    client: RendezvousClient
    secret: bytes
    server: RendezvousServer | None
    published: _AgentStore | None = None

    def close(self) -> None:
        self.client.close()
        if self.server is not None:
            self.server.stop()
        if self.published is not None:
            # Every rank has connected (read the port) by now; a later init() of this
            # attempt must wait for the port of its own server, not find this one.
            self.published.withdraw()


def open_rendezvous(config: Config) -> Rendezvous:
    """Connects this rank to its job's rendezvous server, starting it on rank 0 if needed.

    Raises:
        HoraInternalError: the server cannot be started or reached; names the address.
    """
    topology = config.topology
    addr, port, secret = config.rendezvous_addr, config.rendezvous_port, config.secret
    server: RendezvousServer | None = None
    published: _AgentStore | None = None
    if config.mpi_bootstrap:
        addr, port, secret, server = _mpi_bootstrap(config)
    elif config.agent_store is not None:
        assert addr is not None and secret is not None  # checked by Config
        published = _AgentStore(config.agent_store, topology.rank, config.start_timeout)
        if topology.rank == 0:
            server = _serve(addr, 0, secret, f"{config.launcher} variables")
            port = published.publish(server.port)
        else:
            port, published = published.read(), None
    elif config.host_rendezvous and topology.rank == 0:
        assert addr is not None and port is not None and secret is not None  # checked by Config
        server = _serve(addr, port, secret, f"{config.launcher} variables")
    assert addr is not None and port is not None and secret is not None  # checked by Config
    try:
        client = RendezvousClient(addr, port, secret, config.start_timeout)
    except (OSError, TimeoutError) as exc:
        if server is not None:
            server.stop()
        if published is not None:
            published.withdraw()
        hosted = " (rank 0 hosts it)" if config.host_rendezvous else ""
        raise HoraInternalError(
            f"hora.init: rank {topology.rank} on {topology.hostname} could not reach the rendezvous server at "
            f"{addr}:{port}{hosted}: {exc}"
        ) from None
    return Rendezvous(client, secret, server, published)


class _AgentStore:
    """A connection to torchrun's agent store, through which rank 0 shares its rendezvous port.

    torch's own ``TCPStore`` client speaks the store's protocol; torchrun runs only where
    torch is installed, so importing it here adds no dependency to a job that lacks it.
    """

    def __init__(self, store: AgentStore, rank: int, timeout: float) -> None:
        """Connects to the agent's store.

        Raises:
            HoraInternalError: torch is missing or the store cannot be reached; names it.
        """
        self._store = store
        self._rank = rank
        self._where = f"torchrun's agent store at {store.addr}:{store.port} (MASTER_ADDR:MASTER_PORT)"
        try:
            from torch.distributed import TCPStore  # type: ignore[attr-defined]
        except ImportError:
            raise HoraInternalError(
                f"hora.init: rank {rank} runs under torchrun (TORCHELASTIC_USE_AGENT_STORE) but cannot import "
                "torch.distributed to read the rendezvous port from torchrun's store; set HORA_RENDEZVOUS_PORT "
                "to a free port instead"
            ) from None
        try:
            self._client: Any = TCPStore(
                store.addr, store.port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
            )
        except (RuntimeError, OSError) as exc:
            raise HoraInternalError(f"hora.init: rank {rank} cannot reach {self._where}: {exc}") from None

    def publish(self, port: int) -> int:
        """Writes the port rank 0's rendezvous server listens on; returns it."""
        try:
            self._client.set(self._store.key, str(port))
        except (RuntimeError, OSError) as exc:
            raise HoraInternalError(
                f"hora.init: rank 0 cannot write its rendezvous port to {self._where}: {exc}"
            ) from None
        return port

    def read(self) -> int:
        """Waits for rank 0's port (up to the start timeout).

        Raises:
            HoraInternalError: rank 0 did not publish it in time, or the store failed.
        """
        try:
            text = bytes(self._client.get(self._store.key)).decode("ascii")
        except (RuntimeError, OSError) as exc:
            raise HoraInternalError(
                f"hora.init: rank {self._rank} did not get rank 0's rendezvous port from {self._where} "
                f"(key {self._store.key}): {exc}; is rank 0 running and calling hora.init()?"
            ) from None
        return int(text)

    def withdraw(self) -> None:
        """Removes the published port; the store may be gone already (torchrun ending)."""
        try:
            self._client.delete_key(self._store.key)
        except (RuntimeError, OSError) as exc:
            log.debug("could not remove %s from %s: %s", self._store.key, self._where, exc)


def _serve(addr: str, port: int, secret: bytes, source: str) -> RendezvousServer:
    bind = "127.0.0.1" if netif.is_loopback(addr) else "0.0.0.0"
    try:
        return RendezvousServer(secret, host=bind, port=port).start()
    except OSError as exc:
        raise HoraInternalError(
            f"hora.init: rank 0 cannot run the rendezvous server on {bind}:{port} (from the {source}): "
            f"{exc.strerror or exc}; choose a free port (HORA_RENDEZVOUS_PORT or MASTER_PORT)"
        ) from None


def advertised_address(config: Config) -> str:
    """The address rank 0 offers for its rendezvous server when no one named one.

    ``HORA_IFACE``'s address; ``127.0.0.1`` when every rank runs on this host; else the
    source address of this host's default route, or its first address that is not
    loopback.
    """
    names = netif.split_names(config.iface)
    if names:
        chosen = netif.pick_interface(names)
        if chosen is not None and chosen.address is not None:
            return chosen.address
    if config.topology.local_size == config.topology.size:
        return "127.0.0.1"
    source = netif.route_source("198.51.100.1")  # a documentation address: only the route is looked up
    if source is not None and not netif.is_loopback_address(source):
        return source
    for interface in netif.interfaces():
        if interface.address is not None and not interface.loopback:
            return interface.address
    return "127.0.0.1"


def _mpi_bootstrap(config: Config) -> tuple[str, int, bytes, RendezvousServer | None]:
    """Rank 0 fills in what the environment left open and broadcasts it through MPI."""
    topology = config.topology
    MPI = initialized_mpi("hora.init (sharing the job secret through MPI)")  # Config checked mpi4py is there
    comm = MPI.COMM_WORLD if config.mpi_comm is None else config.mpi_comm  # init(comm=...)'s, if any
    if comm.Get_size() != topology.size or comm.Get_rank() != topology.rank:
        raise HoraInternalError(
            f"hora.init: MPI.COMM_WORLD has rank {comm.Get_rank()} of {comm.Get_size()}, but the launcher's "
            f"variables say rank {topology.rank} of {topology.size}: start every rank with the same mpirun"
        )
    record = bytearray(_RECORD)
    server: RendezvousServer | None = None
    if topology.rank == 0:
        secret = config.secret or auth.new_secret()
        addr = config.rendezvous_addr or advertised_address(config)
        try:
            server = _serve(addr, config.rendezvous_port or 0, secret, "MPI bootstrap")
        except HoraInternalError as exc:
            _pack(record, 2, 0, b"", str(exc))
            comm.Bcast([record, MPI.BYTE], root=0)
            raise
        shared = b"" if config.secret is not None else secret
        _pack(record, 1, server.port, shared, addr)
    comm.Bcast([record, MPI.BYTE], root=0)
    status, port, shared, text = _unpack(record)
    if status != 1:
        raise HoraInternalError(f"hora.init: rank 0 could not start the job's rendezvous: {text}")
    secret = config.secret if config.secret is not None else shared
    return text, port, secret, server


def _pack(record: bytearray, status: int, port: int, secret: bytes, text: str) -> None:
    encoded = text.encode()[: _RECORD - _HEADER.size - len(secret) - 2]
    data = _HEADER.pack(status, port, len(secret)) + secret + struct.pack("<H", len(encoded)) + encoded
    record[: len(data)] = data


def _unpack(record: bytearray) -> tuple[int, int, bytes, str]:
    status, port, secret_length = _HEADER.unpack_from(record)
    offset = _HEADER.size
    secret = bytes(record[offset : offset + secret_length])
    offset += secret_length
    (length,) = struct.unpack_from("<H", record, offset)
    text = bytes(record[offset + 2 : offset + 2 + length]).decode(errors="replace")
    return status, port, secret, text


def advertise(config: Config, client: RendezvousClient, generation: int, bind: str) -> list[str]:
    """Publishes this rank's host and address; checks every rank's before the mesh forms.

    Returns:
        Every rank's host name, by rank.

    Raises:
        HoraInternalError: ranks did not arrive in time, or the job spans hosts and a
            rank would advertise a loopback address (named, with the fix).
    """
    topology = config.topology
    record = f"{topology.hostname}\n{netif.network_id()}\n{bind}"
    client.put(f"addr/{generation}/{topology.rank}", record.encode())
    keys = [f"addr/{generation}/{rank}" for rank in range(topology.size)]
    try:
        records = client.wait(keys, config.start_timeout)
    except RendezvousTimeout as exc:
        missing = sorted(int(key.rsplit("/", 1)[1]) for key in exc.missing)
        raise HoraInternalError(
            f"hora.init: rank(s) {', '.join(map(str, missing))} of {topology.size} did not reach the rendezvous at "
            f"{client.host}:{client.port} within {config.start_timeout:g} s (raise --start-timeout or "
            "HORA_START_TIMEOUT if they start slowly)"
        ) from None
    fields = [(record.decode(errors="replace").split("\n") + ["", ""])[:3] for record in records]
    hosts = [host for host, _, _ in fields]
    if len({network for _, network, _ in fields}) > 1:
        for rank, (host, _, address) in enumerate(fields):
            if netif.is_loopback_address(address):
                raise HoraInternalError(
                    f"hora.init: rank {rank} on host {host} would advertise the loopback address {address}, but "
                    f"the job spans the hosts {', '.join(dict.fromkeys(hosts))}: its peers could not reach it. "
                    "Give every rank a rendezvous address that is not loopback, or name the interface to use "
                    "(horarun --network-interfaces, or HORA_IFACE)"
                )
    return hosts


def topology_from_hosts(hosts: Sequence[str], rank: int) -> tuple[int, int, int, int]:
    """Horovod's local and cross ranks of ``rank``, given every rank's host name.

    Returns:
        (local_rank, local_size, cross_rank, cross_size).
    """
    host = hosts[rank]
    same = [r for r, h in enumerate(hosts) if h == host]
    local_rank, local_size = same.index(rank), len(same)
    order = list(dict.fromkeys(hosts))
    holders = [h for h in order if sum(1 for other in hosts if other == h) > local_rank]
    return local_rank, local_size, holders.index(host), len(holders)


