"""MPI as the data plane (``HORA_TRANSPORT=mpi``): collectives through mpi4py's communicators.

For clusters whose MPI is tuned for their network. Negotiation stays hora's (rank 0's
coordinator over TCP), so every rank still runs the same collectives in the same
order; only the data moves through MPI: ``Allreduce``, ``Reduce_scatter``,
``Allgatherv``, ``Bcast`` and ``Alltoallv`` on each process set's communicator, and
Adasum's pairwise exchanges through ``Isend``/``Irecv``.

MPI has no float16 or bfloat16 arithmetic: those reduce in float32 and round back.
Bools reduce as bytes (``MAX`` is or, ``MIN`` is and).

Failures: a rank that dies inside an MPI call is MPI's to handle (``mpirun`` ends the
job); hora's own failure messages cover everything outside MPI calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hora.collectives import adasum
from hora.collectives.reduce import Reducer, bf16_to_f32, f32_to_bf16
from hora.collectives.ring import Bounds
from hora.errors import HoraInternalError


def load_mpi() -> Any:
    """Imports mpi4py's MPI module and checks that the engine thread may call it.

    Raises:
        HoraInternalError: mpi4py is missing, or MPI was initialised without thread
            support (the engine thread makes the calls).
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise HoraInternalError(
            f"HORA_TRANSPORT=mpi needs mpi4py ({exc}): pip install 'hora[mpi]', or unset HORA_TRANSPORT"
        ) from None
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise HoraInternalError(
            "HORA_TRANSPORT=mpi: MPI was initialised without thread support, but hora's engine thread makes the "
            "MPI calls: let mpi4py initialise MPI (its default asks for MPI_THREAD_MULTIPLE)"
        )
    return MPI


_OPS: dict[np.ufunc, str] = {np.add: "SUM", np.minimum: "MIN", np.maximum: "MAX", np.multiply: "PROD"}
_BOOL_OPS: dict[np.ufunc, str] = {np.logical_or: "MAX", np.logical_and: "MIN"}  # on bytes 0 and 1


class MpiChannel:
    """A ``collectives.channel.Channel`` over an MPI communicator (for Adasum)."""

    def __init__(self, comm: Any, mpi: Any) -> None:
        self._comm = comm
        self._mpi = mpi

    @property
    def rank(self) -> int:
        return int(self._comm.Get_rank())

    @property
    def size(self) -> int:
        return int(self._comm.Get_size())

    def exchange(self, sends: Sequence[tuple[int, np.ndarray]], recvs: Sequence[tuple[int, np.ndarray]]) -> None:
        requests = [self._comm.Irecv(_bytes(buffer), source=peer) for peer, buffer in recvs if buffer.size]
        requests += [self._comm.Isend(_bytes(buffer), dest=peer) for peer, buffer in sends if buffer.size]
        self._mpi.Request.Waitall(requests)


def _bytes(buffer: np.ndarray) -> np.ndarray:
    return buffer.view(np.uint8)


def _movable(buffer: np.ndarray) -> np.ndarray:
    """A view MPI can move element by element (it has no float16 or bool of NumPy's kind)."""
    if buffer.dtype == np.float16 or buffer.dtype == np.bool_:
        return buffer.view(np.uint16 if buffer.dtype == np.float16 else np.uint8)
    return buffer


class MpiCollectives(MpiChannel):
    """One process set's collectives on its MPI communicator (also its channel, for Adasum).

    Args:
        comm: the set's communicator (ranks in set order).
        mpi: mpi4py's MPI module.
    """

    @property
    def label(self) -> str:
        return "MPI"

    @property
    def reads_only(self) -> bool:
        return True  # Reduce_scatter reads its send buffer only

    def _reducing(self, buffer: np.ndarray, reduce: Reducer) -> tuple[np.ndarray, Any]:
        """The buffer MPI reduces (float32 for float16 and bfloat16) and the MPI op."""
        if buffer.dtype == np.bool_:
            return buffer.view(np.uint8), getattr(self._mpi, _BOOL_OPS[reduce.ufunc])
        op = getattr(self._mpi, _OPS[reduce.ufunc])
        if reduce.bfloat16:
            return bf16_to_f32(buffer), op
        if buffer.dtype == np.float16:
            return buffer.astype(np.float32), op
        return buffer, op

    @staticmethod
    def _narrow(wide: np.ndarray, target: np.ndarray, reduce: Reducer) -> None:
        if wide is target or wide.base is target:
            return
        if reduce.bfloat16:
            f32_to_bf16(wide, target)
        else:
            target[...] = wide

    def allreduce(
        self, buffer: np.ndarray, reduce: Reducer, postscale: Callable[[np.ndarray], None] | None = None
    ) -> None:
        wide, op = self._reducing(buffer, reduce)
        self._comm.Allreduce(self._mpi.IN_PLACE, wide, op=op)
        self._narrow(wide, buffer, reduce)
        if postscale is not None:
            postscale(buffer)

    def allreduce_packed(self, inputs: Sequence[np.ndarray | None], outputs: Sequence[np.ndarray | None],
                         lengths: list[int], dtype: np.dtype[np.generic], reduce: Reducer,
                         prescale: Callable[[np.ndarray], None], postscale: Callable[[np.ndarray], None]) -> bool:
        return False  # MPI reduces one buffer: the caller packs

    def adasum(self, buffer: np.ndarray, tensors: Bounds) -> None:
        adasum.allreduce(self, buffer, tensors)

    def reduce_scatter(self, data: np.ndarray, bounds: Bounds, reduce: Reducer, output: np.ndarray) -> None:
        wide_in, op = self._reducing(data, reduce)
        wide_out, _ = self._reducing(output, reduce)
        counts = [length for _, length in bounds]
        self._comm.Reduce_scatter(wide_in, wide_out, recvcounts=counts, op=op)
        self._narrow(wide_out, output, reduce)

    def allgather(self, buffer: np.ndarray, bounds: Bounds) -> None:
        counts = [length for _, length in bounds]
        displacements = [offset for offset, _ in bounds]
        self._comm.Allgatherv(self._mpi.IN_PLACE, [_movable(buffer), (counts, displacements)])

    def broadcast(self, buffer: np.ndarray, root: int) -> None:
        self._comm.Bcast(_movable(buffer), root=root)

    def alltoall(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray, recv_counts: list[int]) -> None:
        send_displacements = np.concatenate(([0], np.cumsum(send_counts)[:-1])).astype(int).tolist()
        recv_displacements = np.concatenate(([0], np.cumsum(recv_counts)[:-1])).astype(int).tolist()
        self._comm.Alltoallv(
            [_movable(send), (send_counts, send_displacements)],
            [_movable(recv), (recv_counts, recv_displacements)],
        )


class MpiWorld:
    """The job's MPI communicators, one per process set, made on first use.

    They are never freed (``MPI_Comm_free`` is collective, and a rank that shuts down
    early must not wait for the others); ``MPI_Finalize`` at exit releases them.

    Args:
        rank: this rank (must be MPI's rank in ``COMM_WORLD``).
        size: the job's size (must be ``COMM_WORLD``'s).

    Raises:
        HoraInternalError: MPI is unusable, or its ranks are not hora's (the job was
            not started by mpirun with one rank per process).
    """

    def __init__(self, rank: int, size: int) -> None:
        self._mpi = load_mpi()
        world = self._mpi.COMM_WORLD
        if (world.Get_rank(), world.Get_size()) != (rank, size):
            raise HoraInternalError(
                f"HORA_TRANSPORT=mpi: hora's rank {rank} of {size} is MPI's rank {world.Get_rank()} of "
                f"{world.Get_size()}: start the job with mpirun (or horarun --mpi), one MPI rank per hora rank"
            )
        self._world = world.Dup()  # collective: every rank builds its engine at init()
        self._comms: dict[tuple[int, ...], Any] = {tuple(range(size)): self._world}

    def collectives(self, ranks: tuple[int, ...]) -> MpiCollectives:
        """The collectives of the set with these global ranks.

        The first call for a set creates its communicator, collectively over the set's
        ranks; they all make it while executing the set's first response, in order.
        """
        comm = self._comms.get(ranks)
        if comm is None:
            group = self._world.Get_group().Incl(list(ranks))
            comm = self._comms[ranks] = self._world.Create_group(group)
            group.Free()
        return MpiCollectives(comm, self._mpi)
