"""The records horarun's elastic driver and its workers exchange through the rendezvous store.

An elastic job runs as a sequence of *worlds*, numbered by generation. A worker is
identified by its *slot*: the host name the launcher gave it and its local rank on
that host when it was started (``slot_name``); the slot stays the same across
worlds, its rank may not. The keys, all under ``elastic/``:

``elastic/world/<g>``
    written by the driver: world ``g``, a ``World`` (every slot's rank, size, local
    and cross ranks; a slot that is absent has been removed from the job).
``elastic/ready/<g>/<slot>``
    written by a worker of world ``g - 1`` that reset and asks for its place in world
    ``g``. The driver publishes world ``g`` once every worker of world ``g - 1`` has
    asked or exited, so a reset that changes nothing still gets a new world.
``elastic/hosts/<i>``
    the ``i``-th change of hosts (from 0), ``"<timestamp> <HostUpdateResult>"``; rank 0
    reads those published after its world, and ``State.commit`` raises
    ``HostsUpdatedInterrupt`` on every rank.

Keys only ever gain values (no key is rewritten), so a reader never sees a torn
update. This module is the protocol only: ``hora.core.membership`` is the worker's
side, ``hora.runner.elastic.driver`` the driver's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

Place = tuple[int, int, int, int, int, int]
"""A slot's place in a world: (rank, size, local_rank, local_size, cross_rank, cross_size)."""


def slot_name(host: str, local_rank: int) -> str:
    """Names a worker's slot as Horovod's messages do: ``host[local_rank]``."""
    return f"{host}[{local_rank}]"


def world_key(generation: int) -> str:
    """The key of world ``generation``."""
    return f"elastic/world/{generation}"


def ready_key(generation: int, slot: str) -> str:
    """The key a worker writes to ask for its place in world ``generation``."""
    return f"elastic/ready/{generation}/{slot}"


def hosts_key(index: int) -> str:
    """The key of the ``index``-th change of hosts."""
    return f"elastic/hosts/{index}"


@dataclasses.dataclass(frozen=True)
class World:
    """One generation of an elastic job.

    Attributes:
        generation: its number; the first world is 0.
        places: slot name -> its place in this world.
        hosts_index: how many changes of hosts were published before it; its rank 0
            reads ``elastic/hosts/<i>`` from there on.
    """

    generation: int
    places: Mapping[str, Place]
    hosts_index: int = 0

    @property
    def size(self) -> int:
        return len(self.places)

    def encode(self) -> bytes:
        record = {"generation": self.generation, "hosts_index": self.hosts_index, "places": dict(self.places)}
        return json.dumps(record, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> World:
        """Reads a record ``encode`` wrote.

        Raises:
            ValueError: the record is not one.
        """
        try:
            record = json.loads(data)
            places = {str(slot): _place(place) for slot, place in record["places"].items()}
            return cls(int(record["generation"]), places, int(record["hosts_index"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not an elastic world record: {exc}") from None


def _place(value: object) -> Place:
    if not isinstance(value, list) or len(value) != 6:
        raise ValueError(f"a place has 6 integers, got {value!r}")
    rank, size, local_rank, local_size, cross_rank, cross_size = (int(part) for part in value)
    return rank, size, local_rank, local_size, cross_rank, cross_size


def encode_host_update(timestamp: float, result: int) -> bytes:
    """The value of a host-change key: when the driver saw it, and what changed."""
    return f"{timestamp!r} {int(result)}".encode()


def decode_host_update(data: bytes) -> tuple[float, int]:
    """Reads ``encode_host_update``'s value.

    Raises:
        ValueError: the value is not one.
    """
    timestamp, result = data.decode().split()
    return float(timestamp), int(result)
