"""An elastic worker's place in each world of its job, and the changes of hosts it is told of.

Under ``horarun``'s elastic driver (``HORA_ELASTIC_GENERATION`` is set) ``init()`` does
not take its rank from the environment: it asks the driver for its place in the
current world (``hora.transport.worlds`` describes the records):

* the first ``init()`` of a worker joins the world it was started for, which the
  driver published before starting it;
* every later ``init()`` (a reset: ``shutdown()`` then ``init()``) writes
  ``elastic/ready/<g>/<slot>`` for the next generation ``g`` and waits for world
  ``g``, which the driver publishes once every worker of the previous world asked or
  exited. The wait is bounded (``HORA_ELASTIC_TIMEOUT`` plus the start timeout); a
  driver that went away ends it at once (its server closes the connection).

A worker whose slot the new world does not hold has been removed from the job; its
``init()`` raises ``HoraInternalError`` with Horovod's words (the driver stops it too).

Rank 0 of a world reads the host changes the driver published after that world
(``Membership.host_updates``); ``hora.elastic.State.check_host_updates`` broadcasts
rank 0's view, so every rank raises ``HostsUpdatedInterrupt`` at the same commit.
"""

from __future__ import annotations

import dataclasses

from hora.config import Config
from hora.errors import HoraInternalError
from hora.transport import worlds
from hora.transport.rendezvous import RendezvousClient, RendezvousTimeout


@dataclasses.dataclass
class Membership:
    """This worker's place in one world of an elastic job.

    Attributes:
        config: the configuration, with the topology of this world.
        world: the world joined.
        slot: this worker's slot name (``host[local_rank]`` at its start).
    """

    config: Config
    world: worlds.World
    slot: str
    _client: RendezvousClient | None = dataclasses.field(default=None, repr=False)
    _next_update: int = 0

    @property
    def generation(self) -> int:
        return self.world.generation

    def host_updates(self) -> list[tuple[float, int]]:
        """The changes of hosts published since the last call (rank 0 reads them).

        Returns:
            (timestamp, HostUpdateResult value) of each, oldest first; empty on ranks
            other than 0.

        Raises:
            HoraInternalError: the driver's rendezvous server cannot be reached.
        """
        if self.config.topology.rank != 0:
            return []
        updates: list[tuple[float, int]] = []
        try:
            if self._client is None:
                self._client = _connect(self.config)
                self._next_update = self.world.hosts_index
            while True:
                try:
                    (value,) = self._client.wait([worlds.hosts_key(self._next_update)], 0.0)
                except RendezvousTimeout:
                    return updates
                updates.append(worlds.decode_host_update(value))
                self._next_update += 1
        except (OSError, ValueError) as exc:
            raise HoraInternalError(
                f"hora.elastic: rank 0 ({self.slot}) could not read the changes of hosts from horarun's elastic "
                f"driver: {exc}"
            ) from None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def slot_of(config: Config) -> str:
    """This worker's slot: the host name and local rank it was started with."""
    return worlds.slot_name(config.topology.hostname, config.topology.local_rank)


def join(config: Config, generation: int, announce: bool) -> Membership:
    """Waits for world ``generation`` and takes this worker's place in it.

    Args:
        config: the configuration read from the environment (the worker's start place).
        generation: the world to join.
        announce: write the ready mark first (a reset); False for the world a worker
            was started for.

    Returns:
        The membership, whose ``config`` has this world's topology.

    Raises:
        HoraInternalError: the driver cannot be reached, the world did not come within
            the elastic timeout, or this worker has been removed from the job.
    """
    slot = slot_of(config)
    timeout = config.elastic_timeout + config.start_timeout
    try:
        with _connect(config) as client:
            if announce:
                client.put(worlds.ready_key(generation, slot), b"")
            (record,) = client.wait([worlds.world_key(generation)], timeout)
        world = worlds.World.decode(record)
    except RendezvousTimeout:
        raise HoraInternalError(
            f"hora.init: {slot} waited {timeout:g} s for world {generation} of the elastic job and horarun's "
            "driver did not publish it (raise --elastic-timeout if hosts take longer to come)"
        ) from None
    except (OSError, ValueError) as exc:
        raise HoraInternalError(
            f"hora.init: {slot} could not get its place in world {generation} from horarun's elastic driver at "
            f"{config.rendezvous_addr}:{config.rendezvous_port}: {exc}"
        ) from None
    place = world.places.get(slot)
    if place is None:
        raise HoraInternalError(f"hora.init: {slot} has been removed from elastic job (world {generation} has "
                                f"{world.size} ranks)")  # fmt: skip
    rank, size, local_rank, local_size, cross_rank, cross_size = place
    topology = dataclasses.replace(
        config.topology,
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_rank,
        cross_size=cross_size,
    )
    return Membership(dataclasses.replace(config, topology=topology), world, slot)


def _connect(config: Config) -> RendezvousClient:
    addr, port, secret = config.rendezvous_addr, config.rendezvous_port, config.secret
    if addr is None or port is None or secret is None:
        raise ValueError("HORA_RENDEZVOUS_ADDR, HORA_RENDEZVOUS_PORT and HORA_SECRET must be set in an elastic job")
    return RendezvousClient(addr, port, secret, config.start_timeout)
