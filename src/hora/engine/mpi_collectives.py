"""MPI as the data plane (``HORA_TRANSPORT=mpi``): collectives through mpi4py's communicators.

For clusters whose MPI is tuned for their network. Negotiation stays hora's (rank 0's
coordinator over TCP), so every rank still runs the same collectives in the same
order; only the data moves through MPI: ``Allreduce``, ``Reduce_scatter``,
``Allgatherv``, ``Bcast`` and ``Alltoallv`` on each process set's communicator, and
Adasum's pairwise exchanges through ``Isend``/``Irecv``.

MPI has no float16 or bfloat16 arithmetic: those reduce in float32 and round back.
Bools reduce as bytes (``MAX`` is or, ``MIN`` is and).

Failures: every MPI call of the data plane runs on one thread of its own (``MpiThread``,
blocking calls: MPI's own algorithms, faster here than its non-blocking ones), while the
engine waits for it looking every ``LOOK_SECONDS`` at what every hora wait watches
(``hora.transport.tcp.Watch``): an ABORT on the control link, a lost rank 0, the stall
clock, a held-back signal. So a rank lost or frozen mid-collective fails the job with
hora's error, as far as MPI allows: MPI cannot cancel a collective, so the call stays
blocked in MPI, and the process calls ``MPI_Abort`` when it exits (``mpirun`` then ends
every rank) instead of waiting for ever in ``MPI_Finalize``.
"""

from __future__ import annotations

import _thread
import atexit
import logging
import os
import queue
import select
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hora.collectives import adasum
from hora.collectives.reduce import Reducer, bf16_to_f32, f32_to_bf16
from hora.collectives.ring import Bounds
from hora.errors import HoraInternalError
from hora.transport.tcp import Patience, Watch

log = logging.getLogger(__name__)


def initialized_mpi(purpose: str) -> Any:
    """mpi4py's MPI module, with MPI initialised.

    A program may turn mpi4py's own initialisation off (``mpi4py.rc.initialize = False``,
    as Horovod's tests do, Horovod initialising MPI itself); hora then initialises MPI as
    Horovod does (``MPI_Init_thread``, ``MPI_THREAD_MULTIPLE``) and finalises it at exit,
    after its own shutdown (exit handlers run last-registered first, and ``init()``
    registers hora's shutdown once its runtime is up).

    Args:
        purpose: what needs MPI, for the error message.

    Raises:
        HoraInternalError: mpi4py is missing, or MPI was finalised already.
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise HoraInternalError(f"{purpose} needs mpi4py ({exc}): pip install 'hora[mpi]'") from None
    if MPI.Is_finalized():
        raise HoraInternalError(f"{purpose}: MPI was finalised already (MPI.Finalize() ran before hora.init())")
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        atexit.register(_finalize, MPI)
    return MPI


def _finalize(mpi: Any) -> None:
    if not mpi.Is_finalized():
        mpi.Finalize()


def load_mpi() -> Any:
    """Imports mpi4py's MPI module and checks that the engine thread may call it.

    Raises:
        HoraInternalError: mpi4py is missing, or MPI was initialised without thread
            support (the engine thread makes the calls).
    """
    MPI = initialized_mpi("HORA_TRANSPORT=mpi")
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise HoraInternalError(
            "HORA_TRANSPORT=mpi: MPI was initialised without thread support, but hora's engine thread makes the "
            "MPI calls: let mpi4py initialise MPI (its default asks for MPI_THREAD_MULTIPLE)"
        )
    return MPI


_OPS: dict[np.ufunc, str] = {np.add: "SUM", np.minimum: "MIN", np.maximum: "MAX", np.multiply: "PROD"}
_BOOL_OPS: dict[np.ufunc, str] = {np.logical_or: "MAX", np.logical_and: "MIN"}  # on bytes 0 and 1


LOOK_SECONDS = 1e-3  # how often a wait for MPI looks at the watch


class MpiThread:
    """The one thread that makes the data plane's MPI calls, so the engine can watch
    while MPI blocks (started on first use; a daemon).

    Args:
        mpi: mpi4py's MPI module.
    """

    def __init__(self, mpi: Any) -> None:
        self._mpi = mpi
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], _thread.LockType, list[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._abandoned = False

    def run(self, call: Callable[[], Any], watch: Watch | None, peers: Sequence[int]) -> Any:
        """Runs ``call`` on the MPI thread and waits for it, watching ``watch``.

        Raises:
            Exception: what ``call`` raises, or what the watch raises (an abort, a lost
                rank 0, a stall past the shutdown time, a signal's handler once the wait
                stopped progressing): the call is then abandoned inside MPI.
        """
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="hora-mpi", daemon=True)
            self._thread.start()
        done = _thread.allocate_lock()
        done.acquire()
        box: list[Any] = [None, None]  # result, exception
        self._jobs.put((call, done, box))
        if not done.acquire(timeout=LOOK_SECONDS):
            try:
                self._watch_until(done, watch, peers)
            except BaseException:
                self._abandon()
                raise
        if box[1] is not None:
            raise box[1]
        return box[0]

    @staticmethod
    def _watch_until(done: _thread.LockType, watch: Watch | None, peers: Sequence[int]) -> None:
        patience = Patience(watch)
        masks: dict[int, int] = {}
        if watch is not None:
            watch.register(masks)
        poller = select.poll()
        for fd, mask in masks.items():
            poller.register(fd, mask)
        while not done.acquire(timeout=LOOK_SECONDS):
            if watch is not None:
                for fd, events in poller.poll(0):
                    if watch.service(fd, events, {}) == "closed":
                        poller.unregister(fd)
            patience.check(lambda: list(peers))

    def _serve(self) -> None:
        while True:
            call, done, box = self._jobs.get()
            try:
                box[0] = call()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box[1] = exc
            done.release()

    def _abandon(self) -> None:
        """A call stays blocked in MPI: at exit, end the MPI job rather than wait in
        ``MPI_Finalize`` for ever (handlers run last-registered first, before mpi4py's)."""
        if not self._abandoned:
            self._abandoned = True
            atexit.register(_abort, self._mpi)


def _abort(mpi: Any) -> None:
    log.error("an MPI collective was abandoned mid-way (the job failed): calling MPI_Abort")
    sys.stdout.flush()
    sys.stderr.flush()
    if mpi.Query_thread() == mpi.THREAD_MULTIPLE:
        mpi.COMM_WORLD.Abort(1)
    os._exit(1)


class MpiChannel:
    """A ``collectives.channel.Channel`` over an MPI communicator (for Adasum).

    Args:
        comm: the set's communicator (ranks in set order).
        mpi: mpi4py's MPI module.
        worker: the thread that makes the MPI calls.
        peers: the set's other global ranks (named when it stalls).
        watch: what the waits keep an eye on.
    """

    def __init__(self, comm: Any, mpi: Any, worker: MpiThread, peers: Sequence[int] = (), watch: Watch | None = None) -> None:
        self._comm = comm
        self._mpi = mpi
        self._worker = worker
        self._peers = list(peers)
        self._watch = watch

    def _run(self, call: Callable[[], Any]) -> Any:
        return self._worker.run(call, self._watch, self._peers)

    @property
    def rank(self) -> int:
        return int(self._comm.Get_rank())

    @property
    def size(self) -> int:
        return int(self._comm.Get_size())

    def exchange(self, sends: Sequence[tuple[int, np.ndarray]], recvs: Sequence[tuple[int, np.ndarray]]) -> None:
        def call() -> None:
            requests = [self._comm.Irecv(_bytes(buffer), source=peer) for peer, buffer in recvs if buffer.size]
            requests += [self._comm.Isend(_bytes(buffer), dest=peer) for peer, buffer in sends if buffer.size]
            self._mpi.Request.Waitall(requests)

        self._run(call)


def _bytes(buffer: np.ndarray) -> np.ndarray:
    return buffer.view(np.uint8)


def _movable(buffer: np.ndarray) -> np.ndarray:
    """A view MPI can move element by element (it has no float16 or bool of NumPy's kind)."""
    if buffer.dtype == np.float16 or buffer.dtype == np.bool_:
        return buffer.view(np.uint16 if buffer.dtype == np.float16 else np.uint8)
    return buffer


class MpiCollectives(MpiChannel):
    """One process set's collectives on its MPI communicator (also its channel, for Adasum);
    arguments as ``MpiChannel``'s."""

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
        self._run(lambda: self._comm.Allreduce(self._mpi.IN_PLACE, wide, op=op))
        self._narrow(wide, buffer, reduce)
        if postscale is not None:
            postscale(buffer)

    def allreduce_packed(self, inputs: Sequence[np.ndarray | None], outputs: Sequence[np.ndarray | None],
                         lengths: list[int], dtype: np.dtype[np.generic], reduce: Reducer,
                         prescale: Callable[[np.ndarray], None] | None, postscale: Callable[[np.ndarray], None]) -> bool:
        return False  # MPI reduces one buffer: the caller packs

    def adasum(self, buffer: np.ndarray, tensors: Bounds) -> None:
        adasum.allreduce(self, buffer, tensors)

    def reduce_scatter(self, data: np.ndarray, bounds: Bounds, reduce: Reducer, output: np.ndarray) -> None:
        wide_in, op = self._reducing(data, reduce)
        wide_out, _ = self._reducing(output, reduce)
        counts = [length for _, length in bounds]
        self._run(lambda: self._comm.Reduce_scatter(wide_in, wide_out, recvcounts=counts, op=op))
        self._narrow(wide_out, output, reduce)

    def allgather(self, buffer: np.ndarray, bounds: Bounds) -> None:
        counts = [length for _, length in bounds]
        displacements = [offset for offset, _ in bounds]
        self._run(lambda: self._comm.Allgatherv(self._mpi.IN_PLACE, [_movable(buffer), (counts, displacements)]))

    def broadcast(self, buffer: np.ndarray, root: int) -> None:
        self._run(lambda: self._comm.Bcast(_movable(buffer), root=root))

    def alltoall(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray, recv_counts: list[int]) -> None:
        send_displacements = np.concatenate(([0], np.cumsum(send_counts)[:-1])).astype(int).tolist()
        recv_displacements = np.concatenate(([0], np.cumsum(recv_counts)[:-1])).astype(int).tolist()
        self._run(
            lambda: self._comm.Alltoallv(
                [_movable(send), (send_counts, send_displacements)],
                [_movable(recv), (recv_counts, recv_displacements)],
            )
        )


class MpiWorld:
    """The job's MPI communicators, one per process set, made on first use.

    They are never freed (``MPI_Comm_free`` is collective, and a rank that shuts down
    early must not wait for the others); ``MPI_Finalize`` at exit releases them.

    Args:
        rank: this rank (must be MPI's rank in ``comm``).
        size: the job's size (must be ``comm``'s).
        comm: the communicator the job runs over (``init(comm=...)``); None: ``COMM_WORLD``.

    Raises:
        HoraInternalError: MPI is unusable, or its ranks are not hora's (the job was
            not started by mpirun with one rank per process).
    """

    def __init__(self, rank: int, size: int, comm: Any = None) -> None:
        self._mpi = load_mpi()
        world = self._mpi.COMM_WORLD if comm is None else comm
        if (world.Get_rank(), world.Get_size()) != (rank, size):
            raise HoraInternalError(
                f"HORA_TRANSPORT=mpi: hora's rank {rank} of {size} is MPI's rank {world.Get_rank()} of "
                f"{world.Get_size()}: start the job with mpirun (or horarun --mpi), one MPI rank per hora rank"
            )
        self._world = world.Dup()  # collective: every rank builds its engine at init()
        self._comms: dict[tuple[int, ...], Any] = {tuple(range(size)): self._world}
        self._worker = MpiThread(self._mpi)

    def collectives(self, ranks: tuple[int, ...], watch: Watch | None = None) -> MpiCollectives:
        """The collectives of the set with these global ranks, their waits watching ``watch``.

        The first call for a set creates its communicator, collectively over the set's
        ranks; they all make it while executing the set's first response, in order.
        """
        comm = self._comms.get(ranks)
        me = self._world.Get_rank()
        peers = [r for r in ranks if r != me]
        if comm is None:

            def create() -> Any:
                group = self._world.Get_group().Incl(list(ranks))
                try:
                    return self._world.Create_group(group)
                finally:
                    group.Free()

            comm = self._comms[ranks] = self._worker.run(create, watch, peers)
        return MpiCollectives(comm, self._mpi, self._worker, peers, watch)
