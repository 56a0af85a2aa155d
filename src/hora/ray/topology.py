"""Ranks for workers that Ray placed: grouped by the node each one landed on.

Ray decides where each actor runs; the executor then asks every actor for its node
and numbers the ranks so that the workers of one node hold consecutive ranks
(nodes in the order their first worker appears). Local and cross ranks follow as
``horarun`` computes them for hosts (``hora.runner.hosts.assign_slots``), with the
node's label (``node_label``) as the host name: two Ray nodes on one machine are two
hosts to hora, as they are to Horovod, which names hosts by Ray node id.
"""

from __future__ import annotations

from collections.abc import Sequence

from hora.runner.hosts import HostSpec, SlotInfo, assign_slots

LABEL_CHARS = 16
"""Hex digits of a Ray node id kept in a node's label (64 bits: unique in practice)."""


def node_label(node_id: str) -> str:
    """The host name hora's ranks on a Ray node use: the start of the node's id.

    Args:
        node_id: the node id in hex (``ray.get_runtime_context().get_node_id()``).

    Returns:
        ``node-<first 16 hex digits>``.
    """
    return f"node-{node_id[:LABEL_CHARS]}"


def grouped_slots(node_ids: Sequence[str]) -> tuple[list[int], list[SlotInfo]]:
    """Numbers the ranks of workers by node.

    Args:
        node_ids: the node id of each worker, in the order the workers were created.

    Returns:
        ``(order, slots)``: ``order[rank]`` is the index of the worker (into
        ``node_ids``) that takes rank ``rank``, and ``slots[rank]`` its place.

    Raises:
        ValueError: no worker is given.
    """
    if not node_ids:
        raise ValueError("no worker to place: expected at least one")
    members: dict[str, list[int]] = {}
    for index, node_id in enumerate(node_ids):
        members.setdefault(node_label(node_id), []).append(index)
    order = [index for indexes in members.values() for index in indexes]
    hosts = [HostSpec(label, len(indexes)) for label, indexes in members.items()]
    return order, assign_slots(hosts, len(order))


def slots_in_order(node_ids: Sequence[str]) -> list[SlotInfo]:
    """The places of workers whose ranks are fixed already (Ray Train numbers them).

    Rank ``r`` is the worker at index ``r``; its local rank counts the workers of its
    node before it, and its cross rank the nodes before its own (in the order their
    first worker appears) that hold a worker with the same local rank (Horovod's
    ``Coordinator.finalize_registration``).

    Args:
        node_ids: the node id of each worker, by rank.

    Returns:
        One ``SlotInfo`` per rank.
    """
    labels = [node_label(node_id) for node_id in node_ids]
    counts: dict[str, int] = {}
    local_ranks = []
    for label in labels:
        local_ranks.append(counts.get(label, 0))
        counts[label] = local_ranks[-1] + 1
    holders: dict[int, list[str]] = {}  # local rank -> nodes holding it, in order
    for label, size in counts.items():
        for local_rank in range(size):
            holders.setdefault(local_rank, []).append(label)
    return [
        SlotInfo(
            hostname=label,
            rank=rank,
            size=len(labels),
            local_rank=local_rank,
            local_size=counts[label],
            cross_rank=holders[local_rank].index(label),
            cross_size=len(holders[local_rank]),
        )
        for rank, (label, local_rank) in enumerate(zip(labels, local_ranks))
    ]
