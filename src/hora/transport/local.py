"""Setting up shared memory among the ranks of one machine, over the mesh.

Runs once at ``init``, after the mesh is connected and before the engine starts. The
ranks of a domain (same host name, same machine) agree in two all-to-all rounds of
one status byte each, over their data links:

1. each rank created its own segment (or failed to);
2. each rank mapped every peer's segment (or failed to).

After the second round every segment is mapped everywhere, so each rank removes its
segment's name at once (the memory lives on until the last rank unmaps it).

A failure anywhere shows in every rank's statuses alike, so the whole domain falls
back to TCP together; there is never a rank that uses shared memory with a peer that
does not.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from hora import logs
from hora.transport import shm, tcp
from hora.transport.mesh import Mesh

log = logging.getLogger(__name__)


def domain_ranks(mesh: Mesh) -> list[int]:
    """The ranks sharing this rank's host name and machine, sorted (this rank included)."""
    mine = (mesh.hosts[mesh.rank], mesh.machines[mesh.rank])
    return [r for r in range(mesh.size) if (mesh.hosts[r], mesh.machines[r]) == mine]


def _all_ok(mesh: Mesh, peers: list[int], ok: bool) -> bool:
    """Exchanges one status byte with every peer; True when every rank's byte was 1."""
    mine = np.array([1 if ok else 0], dtype=np.uint8)
    theirs = {peer: np.zeros(1, dtype=np.uint8) for peer in peers}
    tcp.exchange(
        [(mesh.data[peer], mine.data) for peer in peers],
        [(mesh.data[peer], buffer.data) for peer, buffer in theirs.items()],
    )
    return ok and all(int(buffer[0]) == 1 for buffer in theirs.values())


def default_staging_bytes(local_ranks: int, cores: int) -> int:
    """Each rank's staging area when ``HORA_SHM_STAGING_MB`` is unset.

    2 MiB while every local rank has a core: the pieces of a round are still in the
    CPU's cache when the peers read them (a 256 MiB allreduce at 2 ranks took 21 ms,
    against about 50 ms with 16 MiB). 16 MiB when ranks outnumber cores: they take turns
    on the cores, so every barrier costs context switches, and fewer, larger rounds win.
    """
    return (2 if local_ranks <= cores else 16) * 1024 * 1024


def connect_domain(
    mesh: Mesh, secret: bytes, generation: int, staging_bytes: int | None, reserve_bytes: int = 0
) -> shm.Domain | None:
    """Maps the shared segments of this machine's ranks.

    Args:
        mesh: the connected mesh (its data links carry the status bytes).
        secret: the job secret (segment names derive from it).
        generation: the job's initialization count.
        staging_bytes: each rank's staging area (two halves); None for
            ``default_staging_bytes`` (every local rank computes the same).
        reserve_bytes: map a staging area at least this large, of which collectives use
            ``staging_bytes`` until told otherwise (``Domain.use_staging``: autotune
            tries other sizes).

    Returns:
        The domain, or None when this rank has no local peers or shared memory is
        unavailable to any rank of the domain (they all fall back to TCP).
    """
    ranks = domain_ranks(mesh)
    peers = [r for r in ranks if r != mesh.rank]
    if not peers:
        return None
    domain: shm.Domain | None = None
    if staging_bytes is None:
        staging_bytes = default_staging_bytes(len(ranks), os.cpu_count() or 1)
    half = max(shm.PAGE_BYTES, max(staging_bytes, reserve_bytes) // 2 // shm.PAGE_BYTES * shm.PAGE_BYTES)
    try:
        key = shm.job_key(secret)
        domain = shm.Domain(key, generation, ranks, mesh.rank, half, staging_bytes // 2) if shm.supported() else None
    except OSError as exc:
        log.warning("cannot create its shared memory segment (%s); using TCP", exc, extra=logs.at(mesh.rank))
    if not _all_ok(mesh, peers, domain is not None):
        if domain is not None:
            domain.close()
        return None
    assert domain is not None
    try:
        domain.attach()
        attached = True
    except OSError as exc:
        log.warning("cannot map a peer's shared memory (%s); using TCP", exc, extra=logs.at(mesh.rank))
        attached = False
    if not _all_ok(mesh, peers, attached):
        domain.close()
        return None
    domain.unlink()
    return domain


def sharing_everywhere(mesh: Mesh, domain: shm.Domain | None) -> list[bool]:
    """Tells every rank which ranks share memory with all their local peers.

    A rank with no local peer counts as sharing. Every rank gets the same list, so
    choices that depend on other hosts' shared memory (hierarchical allreduce) are
    made alike everywhere.

    Returns:
        By rank: True when that rank's whole domain shares memory.
    """
    ok = domain is not None or len(domain_ranks(mesh)) == 1
    mine = np.array([1 if ok else 0], dtype=np.uint8)
    theirs = {peer: np.zeros(1, dtype=np.uint8) for peer in mesh.data}
    tcp.exchange(
        [(link, mine.data) for link in mesh.data.values()],
        [(mesh.data[peer], buffer.data) for peer, buffer in theirs.items()],
    )
    return [ok if r == mesh.rank else bool(theirs[r][0]) for r in range(mesh.size)]
