"""The runtime: everything ``init()`` builds and ``shutdown()`` tears down.

A ``Runtime`` owns the connections to the other ranks, the engine thread, and the
table of outstanding handles. Nothing about a running job lives anywhere else, so a
second ``init()`` after ``shutdown()`` builds a fresh one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from hora.core.bootstrap import advertise, open_rendezvous, topology_from_hosts
from hora.collectives.reduce import DataType
from hora.config import Config
from hora.engine.autotune import MAX_STAGING_BYTES
from hora.engine.engine import CALLED_SHUTDOWN, Engine, check_interpreter
from hora.engine.handles import Handle
from hora.engine.messages import Request, RequestType
from hora.engine.queue import Entry
from hora.errors import HoraInternalError
from hora.transport import netif
from hora.transport.local import connect_domain, sharing_everywhere
from hora.transport.mesh import Mesh, build_mesh

log = logging.getLogger(__name__)

Finish = Callable[[Any], Any]


class _ThreadState(threading.local):
    """What each thread has open with the runtime.

    Attributes:
        pending: the entries of this thread's open ``batch()``, or None.
        scope: the scope of this thread's requests (``in_scope``; 0: none).

    The defaults are class attributes, so a thread that never set one reads it without
    the AttributeError a bare ``threading.local`` raises and ``getattr`` swallows (1 us
    a read, twice on every tensor's path).
    """

    pending: list[Entry] | None = None
    scope: int = 0


class Runtime:
    """One initialized hora job, as seen from this process.

    Args:
        config: the validated configuration.
        generation: counts this process's initializations; every rank of a job counts
            alike, so rendezvous keys of different generations never collide.

    Raises:
        HoraInternalError: the other ranks could not be reached; names them.
        RuntimeError: a free-threaded interpreter with the GIL off (see ``check_interpreter``).
    """

    def __init__(self, config: Config, generation: int) -> None:
        check_interpreter()
        self.config = config
        self.topology = config.topology
        self.pid = os.getpid()
        mesh, secret = _connect(config, generation) if self.topology.size > 1 else (None, b"")
        self.hosts: list[str] = mesh.hosts if mesh is not None else [self.topology.hostname]
        if mesh is not None and not config.exact_cross:
            # mpirun and torchrun-style launchers do not say which ranks share a host: the
            # ranks' host names do.
            local_rank, local_size, cross_rank, cross_size = topology_from_hosts(mesh.hosts, self.topology.rank)
            self.topology = dataclasses.replace(
                self.topology, local_rank=local_rank, local_size=local_size, cross_rank=cross_rank, cross_size=cross_size
            )
        domain = None
        sharing = None
        if mesh is not None and config.shared_memory:
            # Autotune may try staging sizes up to its largest: map that much from the start.
            reserve = MAX_STAGING_BYTES if config.autotune and config.shm_staging_bytes is None else 0
            domain = connect_domain(mesh, secret, generation, config.shm_staging_bytes, reserve)
            sharing = sharing_everywhere(mesh, domain)
        self.engine = Engine(config, mesh, domain, sharing)
        self.engine.start()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._handles: dict[int, tuple[Handle | list[Handle], Finish]] = {}
        self._threads = _ThreadState()
        self._unnamed: dict[tuple[str, int], int] = {}
        self._scopes: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._scope_numbers = itertools.count(1)  # not len(_scopes): collected scopes leave it

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def size(self) -> int:
        return self.topology.size

    def next_id(self) -> int:
        """Reserves the next handle id."""
        with self._lock:
            return next(self._ids)

    def count_unnamed(self, op: str, set_id: int) -> int:
        """Numbers the unnamed ``op`` collectives this rank submits in one process set."""
        with self._lock:
            count = self._unnamed.get((op, set_id), 0) + 1
            self._unnamed[(op, set_id)] = count
            return count

    def scope_number(self, scope: Any) -> int:
        """Numbers ``scope`` (a TF1 graph), from 1, in the order this rank first asks;
        held weakly. Ranks that build the same graphs in the same order number them alike.
        """
        with self._lock:
            number = self._scopes.get(scope)
            if number is None:
                number = self._scopes[scope] = next(self._scope_numbers)
            return number

    @contextlib.contextmanager
    def in_scope(self, number: int) -> Iterator[None]:
        """Marks the requests and refusals this thread makes inside the block as coming
        from scope ``number`` (``Request.scope``)."""
        outer = self._threads.scope
        self._threads.scope = number
        try:
            yield
        finally:
            self._threads.scope = outer

    def submit(
        self,
        kind: RequestType,
        name: str,
        dtype: DataType,
        data: np.ndarray | None,
        output: np.ndarray | None,
        shape: Sequence[int] = (),
        process_set_id: int = 0,
        reduce_op: int = 0,
        root_rank: int = 0,
        prescale: float = 1.0,
        postscale: float = 1.0,
        splits: Sequence[int] = (),
        group: str = "",
        group_size: int = 0,
    ) -> Handle:
        """Queues one tensor for the engine and returns its handle.

        Raises:
            ValueError: a tensor of this name is already in flight.
            HoraInternalError: the job has failed or shut down.
        """
        self.check_process()
        request = Request(
            rank=self.topology.rank,
            type=kind,
            name=name,
            process_set_id=process_set_id,
            dtype=int(dtype),
            shape=shape if type(shape) is tuple else tuple(int(d) for d in shape),  # ops pass tuples of ints
            reduce_op=reduce_op,
            root_rank=root_rank,
            prescale=float(prescale),
            postscale=float(postscale),
            splits=tuple(int(s) for s in splits) if splits else (),
            group=group,
            group_size=group_size,
            scope=self._threads.scope,
        )
        handle = Handle(name, self.engine.drive)
        entry = Entry(request, dtype, data, output, handle)
        pending: list[Entry] | None = self._threads.pending
        if pending is None:
            self.engine.submit(entry)
        else:
            pending.append(entry)
        return handle

    def refuse(
        self, kind: RequestType, names: Sequence[str], process_set_id: int, error: str, group: tuple[str, int] = ("", 0)
    ) -> None:
        """Tells the coordinator that this rank refused the collectives ``names`` (its own
        checks failed with ``error``), so that every rank of the set fails them, naming
        this rank, instead of waiting for this one. Names already in flight here (the
        refusal was for that very reason) and a failed runtime are left alone. The names
        stay free here: the program may retry at once.
        """
        entries = []
        for name in names:
            request = Request(
                rank=self.rank, type=kind, name=name, process_set_id=process_set_id,
                group=group[0], group_size=group[1], error=error, scope=self._threads.scope,
            )  # fmt: skip
            entries.append(Entry(request, DataType.UINT8, None, None, Handle(name)))
        if any(self.engine.queue.peek(process_set_id, name) is not None for name in names):
            return  # the refusal was for a name in flight: the coordinator has that one
        try:
            self.engine.refuse(entries)
        except HoraInternalError:
            pass  # no job left to tell

    def caller_drives(self) -> contextlib.AbstractContextManager[None]:
        """A block whose collectives this thread submits and waits for at once (``Engine.caller_drives``)."""
        return self.engine.caller_drives()

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Queues every tensor this thread submits inside the block at once, when it ends.

        One lock and one engine wake-up for a whole group, and all or nothing: when the
        block raises, or any of its tensors cannot be queued, none of them is.

        Raises:
            ValueError: a tensor's name is already in flight (see ``TensorQueue.add_many``).
            HoraInternalError: the job has failed or shut down.
        """
        pending: list[Entry] = []
        self._threads.pending = pending
        try:
            yield
        finally:
            self._threads.pending = None
        self.engine.submit_many(pending)

    def register(self, handle_id: int, handles: Handle | list[Handle], finish: Finish) -> int:
        """Files handles under an id for ``poll``/``synchronize``; returns the id."""
        with self._lock:
            self._handles[handle_id] = (handles, finish)
        return handle_id

    def poll(self, handle_id: int) -> bool:
        """True when the collective behind the id has finished.

        Raises:
            ValueError: no outstanding collective has this id.
        """
        with self._lock:
            found = self._handles.get(handle_id)
        if found is None:
            raise ValueError(f"handle {handle_id} is not an outstanding hora operation")
        handles = found[0]
        return all(h.done() for h in handles) if isinstance(handles, list) else handles.done()

    def synchronize(self, handle_id: int) -> Any:
        """Waits for the collective behind the id and returns its result.

        Returns None for an unknown id, as Horovod does.

        Raises:
            HoraInternalError: the job failed while this collective was in flight.
            CollectiveMismatchError: the ranks disagreed about this collective.
        """
        with self._lock:
            found = self._handles.get(handle_id)
        if found is None:
            return None
        handles, finish = found
        try:
            result = [h.wait() for h in handles] if isinstance(handles, list) else handles.wait()
        finally:
            with self._lock:
                self._handles.pop(handle_id, None)
        return finish(result)

    def check_process(self) -> None:
        """Refuses use from a forked child, whose copy of the engine thread is dead."""
        if os.getpid() != self.pid:
            raise RuntimeError(
                f"hora was initialized in process {self.pid}, and this process ({os.getpid()}) is a fork of it: "
                "a forked child does not inherit hora's engine thread. Call hvd.init() in the child "
                "(or fork before hvd.init())."
            )

    def shutdown(self, how: str = CALLED_SHUTDOWN, lost: bool = False) -> int:
        """Leaves the job: this rank's unfinished collectives fail, the others go on.

        On rank 0 this returns once every rank has left (rank 0 coordinates them),
        unless ``lost``: then rank 0 fails the job at once (``Engine.stop``).

        Args:
            how: what the others are told of this rank (see ``Engine.stop``).
            lost: the rank is leaving because its program failed.

        Returns:
            The shared segments still mapped until the cycle collector runs (``Engine.stop``).
        """
        if os.getpid() == self.pid:
            return self.engine.stop(how, lost)
        return 0

    @property
    def failure(self) -> str | None:
        return self.engine.failure


def _connect(config: Config, generation: int) -> tuple[Mesh, bytes]:
    """Meets the other ranks through the rendezvous and connects to every one of them.

    Returns:
        The mesh, and the job secret (from the environment, or from rank 0 through MPI).

    The rendezvous is ``horarun``'s, or (under mpirun, srun or torchrun-style variables)
    one that rank 0 runs until the mesh is complete (``hora.core.bootstrap``). The address
    this rank listens on and advertises is ``netif.choose_bind_address``'s choice.
    """
    topology = config.topology
    rendezvous = open_rendezvous(config)
    try:
        client = rendezvous.client
        try:
            bind = netif.choose_bind_address(
                netif.split_names(config.iface), client.host, client.local_address()
            )
        except ValueError as exc:
            raise HoraInternalError(f"hora.init: rank {topology.rank} on {topology.hostname}: {exc}") from None
        advertise(config, client, generation, bind)
        mesh = build_mesh(
            topology.rank,
            topology.size,
            topology.hostname,
            rendezvous.secret,
            client,
            generation,
            config.start_timeout,
            bind,
        )
        if config.socket_buffer_bytes:
            mesh.size_buffers(config.socket_buffer_bytes)  # HORA_SOCKET_BUFFER_BYTES
        return mesh, rendezvous.secret
    finally:
        # Once rank 0's mesh is complete every rank is done with the rendezvous.
        rendezvous.close()
