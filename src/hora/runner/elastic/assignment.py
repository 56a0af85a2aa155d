"""Which rank runs on which slot of an elastic job's hosts (Horovod's ``get_host_assignments``).

Ranks fill the hosts' slots in order, up to ``--max-np``: every slot of the first host,
then the second's, and so on; the topology (local and cross ranks) is computed as
``hora.runner.hosts.assign_slots`` computes it for a fixed job. After a reset, the hosts
that ran the previous assignment come first, in their old order, so surviving workers
keep low ranks and rank 0 is a worker that holds the state to broadcast.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from hora.runner.hosts import HostSpec, SlotInfo, assign_slots
from hora.transport import worlds

NO_PREVIOUS_HOST_MESSAGE = "No hosts from previous set remaining, unable to broadcast state."
"""Horovod's message when no host of the previous assignment is left."""


def host_assignments(
    hosts: Sequence[HostSpec],
    min_np: int,
    max_np: int | None = None,
    previous: Sequence[SlotInfo] | None = None,
) -> list[SlotInfo]:
    """Assigns ranks to the hosts' slots.

    Args:
        hosts: the available hosts (none blacklisted), in a stable order.
        min_np: the fewest ranks the job may run with (``--min-np``, >= 1).
        max_np: the most ranks (``--max-np``); None for no limit.
        previous: the assignment the job ran before this reset, or None (or empty) for
            the first one. Its hosts are placed first, in the order of their lowest rank.

    Returns:
        One ``SlotInfo`` per rank, indexed by rank; ``size`` is ``min(slots, max_np)``.

    Raises:
        ValueError: the hosts have fewer than ``min_np`` slots.
        RuntimeError: ``previous`` is given and none of its hosts takes a rank now
            (Horovod's "No hosts from previous set remaining, unable to broadcast state.").
    """
    if min_np < 1:
        raise ValueError(f"--min-np {min_np} is not valid: expected an integer >= 1")
    if max_np is not None and max_np < min_np:
        raise ValueError(f"--max-np {max_np} is below --min-np {min_np}: expected --min-np <= --max-np")
    ordered = list(hosts)
    if previous:
        old = list(dict.fromkeys(slot.hostname for slot in sorted(previous, key=lambda slot: slot.rank)))
        rank_of = {name: index for index, name in enumerate(old)}
        ordered.sort(key=lambda host: rank_of.get(host.name, len(old)))  # stable: new hosts keep their order
    total = sum(host.slots for host in ordered)
    if total < min_np:
        listed = ",".join(str(host) for host in ordered) or "no host"
        raise ValueError(
            f"Requested more processes ({min_np}, --min-np) than there are available slots ({total}: {listed}): "
            "wait for more hosts or lower --min-np"
        )
    size = total if max_np is None else min(total, max_np)
    slots = assign_slots(ordered, size)
    if previous and not {slot.hostname for slot in previous} & {slot.hostname for slot in slots}:
        raise RuntimeError(NO_PREVIOUS_HOST_MESSAGE)
    return slots


def pending_slots(assignments: Sequence[SlotInfo], running: Collection[tuple[str, int]]) -> list[SlotInfo]:
    """The slots of a new assignment that need a worker started (Horovod's pending slots).

    A slot is named by its host and local rank; a worker running on it keeps running
    (and learns its new rank from the new world). Unlike Horovod, which takes the slots
    of the previous assignment as running, a slot whose worker died after the last
    world settled gets a new worker.

    Args:
        assignments: the new assignment.
        running: (host, local rank) of every worker running now.

    Returns:
        The slots of ``assignments`` without a running worker, in rank order.
    """
    return [slot for slot in assignments if (slot.hostname, slot.local_rank) not in running]


def world_of(generation: int, assignment: Sequence[SlotInfo], hosts_index: int) -> worlds.World:
    """The world record of an assignment: each slot's place (rank, size, local and cross)
    under its slot name, as every elastic driver publishes it."""
    places = {
        worlds.slot_name(slot.hostname, slot.local_rank): (
            slot.rank, slot.size, slot.local_rank, slot.local_size, slot.cross_rank, slot.cross_size
        )
        for slot in assignment
    }  # fmt: skip
    return worlds.World(generation, places, hosts_index)
