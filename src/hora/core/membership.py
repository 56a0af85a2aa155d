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

Rank 0 of a world watches for the host changes the driver publishes after that world: a
daemon thread (``Membership.watch``) blocks on the driver's rendezvous server and hands
each change, as it comes, to the registered listeners (``hora.elastic.run`` registers the
``State``, whose ``on_hosts_updated`` runs then, as Horovod's worker notification service
calls it) and keeps it for ``Membership.host_updates``.
``hora.elastic.State.check_host_updates`` broadcasts rank 0's view, so every rank raises
``HostsUpdatedInterrupt`` at the same commit.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

from hora.config import Config
from hora.errors import HoraInternalError
from hora.transport import worlds
from hora.transport.rendezvous import RendezvousClient, RendezvousTimeout

log = logging.getLogger(__name__)

WATCH_WAIT_S = 1.0  # one rendezvous WAIT of the watcher: how soon it sees close()


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
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    _unread: list[tuple[float, int]] = dataclasses.field(default_factory=list, repr=False)
    _failure: str | None = None  # why the watcher stopped before close()
    _closed: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

    @property
    def generation(self) -> int:
        return self.world.generation

    def watch(self, deliver: Callable[[float, int], None]) -> None:
        """On rank 0, starts the thread that watches for changes of hosts until ``close()``.

        Args:
            deliver: called on that thread with (timestamp, HostUpdateResult value) of
                each change as the driver publishes it; what it raises is logged.

        Raises:
            HoraInternalError: the driver's rendezvous server cannot be reached.
        """
        if self.config.topology.rank != 0:
            return
        try:
            client = _connect(self.config)
        except (OSError, ValueError) as exc:
            raise self._unreachable(exc) from None
        threading.Thread(target=self._watch, args=(client, deliver), name="hora-hosts", daemon=True).start()

    def _watch(self, client: RendezvousClient, deliver: Callable[[float, int], None]) -> None:
        index = self.world.hosts_index
        try:
            while not self._closed.is_set():
                try:
                    (value,) = client.wait([worlds.hosts_key(index)], WATCH_WAIT_S)
                except RendezvousTimeout:
                    continue
                if self._closed.is_set():
                    break  # a reset: the next world's watcher starts after what that world knows
                index += 1
                update = worlds.decode_host_update(value)
                with self._lock:
                    self._unread.append(update)
                try:
                    deliver(*update)
                except Exception:  # a listener's bug must not stop the watch
                    log.exception("hora.elastic: a listener for changes of hosts failed")
        except (OSError, ValueError) as exc:
            if not self._closed.is_set():
                self._failure = str(exc)  # the driver went away: host_updates() reports it
        finally:
            client.close()

    def host_updates(self) -> list[tuple[float, int]]:
        """The changes of hosts the watcher received since the last call.

        Returns:
            (timestamp, HostUpdateResult value) of each, oldest first; empty on ranks
            other than 0.

        Raises:
            HoraInternalError: the watcher lost the driver's rendezvous server.
        """
        with self._lock:
            updates, self._unread = self._unread, []
        if not updates and self._failure is not None:
            raise self._unreachable(self._failure)
        return updates

    def _unreachable(self, cause: object) -> HoraInternalError:
        return HoraInternalError(
            f"hora.elastic: rank 0 ({self.slot}) could not read the changes of hosts from horarun's elastic "
            f"driver: {cause}"
        )

    def close(self) -> None:
        """Stops the watcher (within ``WATCH_WAIT_S``; it is a daemon thread, so exit never waits)."""
        self._closed.set()


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
