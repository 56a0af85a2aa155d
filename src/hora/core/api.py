"""The framework-neutral public API: start-up, topology, handles, process sets, objects.

Every framework binding re-exports these. The running job lives in one place, the
``_context`` holder below: ``init()`` puts a ``Runtime`` there and ``shutdown()``
takes it away, so ``init()`` after ``shutdown()`` starts afresh.
"""

from __future__ import annotations

import atexit
import gc
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import cloudpickle
import numpy as np

from hora import logs

from hora.core import ops
from hora.collectives.reduce import DataType
from hora.config import Config
from hora.engine.engine import CALLED_SHUTDOWN
from hora.engine.messages import RequestType
from hora.engine.handles import Handle
from hora.engine.waiting import machine_cpus
from hora.errors import CollectiveMismatchError, HoraInternalError
from hora.core import mpi_comm
from hora.core.process_sets import ProcessSet, global_process_set
from hora.core import membership as world_membership
from hora.core.membership import Membership
from hora.core.runtime import Runtime

log = logging.getLogger(__name__)

NOT_INITIALIZED = "hora has not been initialized; use hvd.init()."


class _Context:
    """Holds the running job of this process (the only process-wide state hora keeps)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.runtime: Runtime | None = None
        self.generation = 0  # of the next runtime; every rank of a job counts alike
        self.membership: Membership | None = None  # under horarun's elastic driver
        self.membership_generation: int | None = None  # the last world joined
        self.dynamic = False
        self.sets: list[ProcessSet] = []
        self.set_calls = 0
        self.atexit_registered = False
        # Called with (timestamp, HostUpdateResult value) of each change of hosts that rank 0's
        # membership watcher receives; kept across resets (hora.elastic.run registers its state).
        self.host_listeners: list[Callable[[float, int], None]] = []


_context = _Context()


def current() -> Runtime:
    """Returns the running job's runtime.

    Raises:
        ValueError: ``init()`` has not been called (or ``shutdown()`` has).
    """
    runtime = _context.runtime
    if runtime is None:
        raise ValueError(NOT_INITIALIZED)
    return runtime


def init(comm: Sequence[int] | Any | None = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Starts hora: connects to the other ranks and starts the engine thread.

    Idempotent while running (as Horovod, a later call only binds the ``ProcessSet``
    objects it names to the sets registered already); after ``shutdown()`` it starts a
    new runtime.

    Args:
        comm: None for all ranks; a list that names every rank; or an mpi4py
            communicator: the whole MPI world, or a sub-communicator whose ranks then
            form a job of their own (``hora.core.mpi_comm``).
        process_sets: ``ProcessSet`` objects to register, or ``"dynamic"`` to allow
            ``add_process_set``/``remove_process_set`` later. As Horovod registers them:
            first the groups the ranks' communicator-defined sets describe (gathered
            over ``comm``, which must then be an mpi4py communicator), then the sets
            given by ranks, each distinct group once (ids 1, 2, ... in that order).

    Raises:
        ValueError: bad arguments or configuration, naming the problem; also a set
            that duplicates another in ``process_sets`` (or the global set): hora
            stays initialized, with that object left unregistered, as Horovod.
        NotImplementedError: communicator-defined sets without an mpi4py ``comm``.
        HoraInternalError: the other ranks could not be reached, naming them.
    """
    mpi_world = mpi_comm.as_comm(comm)
    if comm is not None and mpi_world is None and (not isinstance(comm, Iterable) or isinstance(comm, (str, bytes))):
        raise ValueError(
            f"hora.init(comm={comm!r}): expected a list of rank integers or an mpi4py.MPI.Comm object"
        )
    sets = _listed_sets(process_sets)
    with _context.lock:
        if _context.runtime is not None:
            if _context.runtime.pid == os.getpid():
                running = _context.runtime
                if sets:
                    _bind_listed(running, sets)
                return
            _forget_runtime()  # a forked child: its copy of the parent's runtime is unusable
        config = Config.from_env()
        membership: Membership | None = None
        generation = _context.generation
        if config.elastic_generation is not None:  # horarun's elastic driver places this worker
            last = _context.membership_generation
            generation = config.elastic_generation if last is None else last + 1
            membership = world_membership.join(config, generation, announce=last is not None)
            _context.membership_generation = membership.generation  # the next init() asks for the one after
            config = membership.config
        if mpi_world is not None:
            config = mpi_comm.job_over(config, mpi_world)
        elif comm is not None and sorted(int(r) for r in comm) != list(range(config.topology.size)):
            raise ValueError(
                f"hora.init(comm={list(comm)}): a list must name every rank of the job; "
                "use process_sets= for collectives among a subset of ranks, or pass an mpi4py "
                "sub-communicator to run a job over its ranks"
            )
        if any(ps.ranks is None for ps in sets) and (mpi_world is None or mpi_comm.world_comm(config) is None):
            raise NotImplementedError(_BY_COMM_NEEDS)
        dynamic = config.dynamic_process_sets or process_sets == "dynamic"
        logs.configure(config.log_level, config.log_hide_time)
        ignored = config.extras.unsupported()
        if ignored and config.topology.rank == 0:
            log.warning(
                "%s %s set but hora has no such feature yet; the setting has no effect",
                ", ".join(ignored),
                "is" if len(ignored) == 1 else "are",
                extra=logs.at(config.topology.rank),
            )
        runtime = Runtime(config, generation)
        _context.generation = generation + 1
        _context.runtime = runtime
        _context.membership = membership
        if membership is not None:
            try:
                membership.watch(_deliver_host_update)
            except BaseException:
                shutdown()  # the runtime is up: take it down again, as a failed set below does
                raise
        _context.dynamic = dynamic
        _context.set_calls = 0
        global_process_set._bind(runtime, 0)
        global_process_set.mpi_comm = mpi_world
        if not _context.atexit_registered:
            atexit.register(_shutdown_at_exit)
            _context.atexit_registered = True
        try:
            adding = [_submit_set(runtime, ranks) for ranks in _new_groups(runtime, sets)]
        except BaseException:
            shutdown()
            raise
    # The sets' collectives are waited for without the lock (see add_process_set).
    try:
        for handle in adding:
            _await_set(handle)
    except BaseException:
        shutdown()
        raise
    with _context.lock:
        if _context.runtime is not runtime:
            raise HoraInternalError("hora.init: hora shut down while it registered the process sets")
        _bind_listed(runtime, sets)


_BY_COMM_NEEDS = (
    "Process sets defined by MPI communicators need hvd.init(comm=<an mpi4py communicator>) "
    "(the job's, such as MPI.COMM_WORLD) in a job MPI started (mpirun)"
)


def _listed_sets(process_sets: Sequence[ProcessSet] | str | None) -> list[ProcessSet]:
    """The ``ProcessSet`` objects ``init`` was given, the global set left out.

    Raises:
        ValueError: neither a list of ``ProcessSet`` nor ``"dynamic"``.
    """
    if process_sets is None or process_sets == "dynamic":
        return []
    if isinstance(process_sets, str):
        raise ValueError(f"process_sets={process_sets!r}: expected a list of ProcessSet or 'dynamic'")
    sets = list(process_sets)
    for process_set in sets:
        if not isinstance(process_set, ProcessSet):
            raise ValueError(f"process_sets must hold ProcessSet objects; got {process_set!r}")
    return [process_set for process_set in sets if process_set is not global_process_set]


def _new_groups(runtime: Runtime, sets: list[ProcessSet]) -> list[tuple[int, ...]]:
    """The groups of ranks ``init`` registers for ``sets``, in Horovod's order, each once
    and none registered already (the global set is). Every rank computes the same list:
    the communicator-defined groups are gathered over MPI, and every rank is given the
    same rank-defined sets."""
    by_comm = [ps.mpi_comm for ps in sets if ps.ranks is None]
    groups = mpi_comm.gather_sets(by_comm, mpi_comm.world_comm(runtime.config)) if by_comm else []
    groups += [tuple(ps.ranks) for ps in sets if ps.ranks is not None]
    fresh: list[tuple[int, ...]] = []
    for ranks in groups:
        if ranks not in fresh and runtime.engine.sets.find(ranks) is None:
            fresh.append(ranks)
    return fresh


def _bind_listed(runtime: Runtime, sets: list[ProcessSet]) -> None:
    """Binds each of ``init``'s ``ProcessSet`` objects to the registered set of its ranks
    (holding ``_context.lock``).

    Raises:
        ValueError: a set no registration holds, or one that repeats an earlier entry
            or the global set: as Horovod, that object is left unregistered (the
            others stay bound, hora stays up) and the first such entry is named.
        NotImplementedError: a communicator-defined set in a job MPI does not describe.
    """
    seen = {0}
    duplicate: tuple[int, ProcessSet] | None = None
    for index, process_set in enumerate(sets):
        if process_set.ranks is None:
            world = mpi_comm.world_comm(runtime.config)
            if world is None:
                raise NotImplementedError(_BY_COMM_NEEDS)
            process_set.ranks = list(mpi_comm.ranks_of(process_set.mpi_comm, world))
        set_id = runtime.engine.sets.find(tuple(process_set.ranks))
        if set_id is None:
            raise ValueError(
                f"hora.init: {process_set} is not registered: the first init() of this job registers the sets "
                "(add_process_set() adds one in dynamic mode)"
            )
        if set_id in seen:
            process_set._unbind()
            duplicate = duplicate or (index, process_set)
            continue
        seen.add(set_id)
        process_set._bind(runtime, set_id)
        if process_set not in _context.sets:
            _context.sets.append(process_set)
    if duplicate is not None:
        index, process_set = duplicate
        raise ValueError(
            f"hora.init: process_sets entry number {index} is a duplicate: {process_set} (hora is initialized; "
            "that entry is not registered)"
        )


def _forget_runtime() -> None:
    for process_set in _context.sets:
        process_set._unbind()
    _context.sets.clear()
    global_process_set._unbind()
    _context.runtime = None
    if _context.membership is not None:
        _context.membership.close()
        _context.membership = None


def shutdown() -> None:
    """Stops hora on this rank; registered to run at exit.

    Collectives that need this rank then fail on the others with ``HoraInternalError``
    naming it; collectives among the remaining ranks go on (Horovod instead shuts the
    whole job down). On rank 0, which coordinates the job, this returns once every
    other rank has shut down too.
    """
    _shutdown(CALLED_SHUTDOWN)


def _shutdown(how: str, lost: bool = False) -> None:
    with _context.lock:
        runtime = _context.runtime
        if runtime is None:
            return
        _forget_runtime()
    left_mapped = runtime.shutdown(how, lost)
    del runtime
    if left_mapped and how == CALLED_SHUTDOWN:
        # The engine's objects form reference cycles that hold views into the shared
        # segments: collect them now, so a reset (shutdown() then init(), as elastic
        # training does) unmaps the old segments and closes their descriptors at once
        # instead of at some later collection. At exit the process ends anyway.
        gc.collect()


def _shutdown_at_exit() -> None:
    """``shutdown()`` as the interpreter exits, telling the others why this rank left: an
    uncaught exception (the interpreter keeps it in ``sys.last_value`` before running
    exit handlers) makes it a lost rank, not one that shut down."""
    error = getattr(sys, "last_value", None)
    if isinstance(error, BaseException) and not isinstance(error, SystemExit):
        detail = f"{type(error).__name__}: {error}"
        detail = detail if len(detail) <= 200 else detail[:197] + "..."
        _shutdown(f"was lost: it exited after an uncaught {detail}", lost=True)
    else:
        _shutdown("has shut down (its program ended)")


def host_updates() -> list[tuple[float, int]]:
    """The changes of hosts horarun's elastic driver published since the last call.

    Returns:
        (timestamp, ``HostUpdateResult`` value) of each, oldest first: on rank 0 of an
        elastic job under horarun; empty on the other ranks, in other jobs and before
        ``init()``.

    Raises:
        HoraInternalError: the driver cannot be reached.
    """
    membership = _context.membership
    return [] if membership is None else membership.host_updates()


def add_host_listener(listener: Callable[[float, int], None]) -> None:
    """Registers ``listener`` for the changes of hosts horarun's elastic driver publishes:
    on rank 0 of an elastic job it is called, on a thread of hora's, with (timestamp,
    ``HostUpdateResult`` value) as each change comes (Horovod's worker notification
    listeners). Elsewhere it is never called."""
    _context.host_listeners.append(listener)


def remove_host_listener(listener: Callable[[float, int], None]) -> None:
    """Unregisters a listener added by ``add_host_listener`` (absent: nothing happens)."""
    if listener in _context.host_listeners:
        _context.host_listeners.remove(listener)


def _deliver_host_update(timestamp: float, result: int) -> None:
    for listener in list(_context.host_listeners):
        listener(timestamp, result)


def elastic_worker() -> bool:
    """True once this process joined a world of horarun's elastic driver."""
    return _context.membership_generation is not None


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    runtime = _context.runtime
    return runtime is not None and runtime.pid == os.getpid()


def size() -> int:
    """The number of ranks in the job."""
    return current().topology.size


def local_size() -> int:
    """The number of ranks on this host."""
    return current().topology.local_size


def cross_size() -> int:
    """The number of hosts that have a rank with this rank's local rank."""
    return current().topology.cross_size


def rank() -> int:
    """This process's rank, 0 .. size()-1."""
    return current().topology.rank


def local_rank() -> int:
    """This process's rank among the ranks on its host."""
    return current().topology.local_rank


def cross_rank() -> int:
    """The index of this host among the hosts that have a rank with this local rank."""
    return current().topology.cross_rank


def gradient_overlap(config: Config | None = None, cpus: int | None = None) -> bool:
    """Whether a ``DistributedOptimizer`` starts each gradient's allreduce during backward.

    ``HORA_GRADIENT_OVERLAP`` when set. Otherwise not where every rank is on this machine
    and they have no CPU to spare (at least as many local ranks as usable CPUs): moving
    data through shared memory is CPU work, which beside backward only takes cores that
    backward needs, and a negotiation and a data phase per gradient cost more CPU than
    one for them all. Across machines, waiting on the network costs no CPU, and overlap
    hides it behind backward, as in Horovod.

    Args:
        config: a job's configuration, its topology included (default: the running job's
            configuration, with the topology ``init`` found from the ranks' hosts, which
            launchers that set no local variables leave out of the configuration).
        cpus: the CPUs this machine's ranks may use (default: ``machine_cpus()``).
    """
    if config is None:
        runtime = current()
        config, topology = runtime.config, runtime.topology
    else:
        topology = config.topology
    if config.gradient_overlap is not None:
        return config.gradient_overlap
    if topology.local_size < topology.size:
        return True
    return topology.local_size < (machine_cpus() if cpus is None else cpus)


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    hosts = current().hosts
    counts = {host: hosts.count(host) for host in hosts}
    return len(set(counts.values())) == 1


def mpi_threads_supported() -> bool:
    """True when MPI carries this job's data and was initialised for any thread's calls.

    Then other MPI code (mpi4py) may run beside hora's collectives.

    Raises:
        ValueError: MPI does not carry this job's data (Horovod's error when its MPI
            is not enabled).
    """
    if not mpi_enabled():
        raise ValueError("hora's MPI is not enabled: it is used when the job runs with horarun --mpi "
                         "(HORA_TRANSPORT=mpi)")  # fmt: skip
    from mpi4py import MPI  # initialised already: the transport runs on it

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def mpi_enabled() -> bool:
    """True when MPI carries this job's data (``horarun --mpi``, ``HORA_TRANSPORT=mpi``).

    False before ``init()``, and for a job on hora's own transport.
    """
    return is_initialized() and current().config.transport == "mpi"


def mpi_built(verbose: bool = False) -> bool:
    """True when hora can carry data over MPI on this machine: mpi4py is installed.

    Horovod answers whether it was compiled with MPI; hora needs no build, only mpi4py
    (looked up, not imported: importing it starts MPI).
    """
    return importlib.util.find_spec("mpi4py") is not None


def gloo_enabled() -> bool:
    """True when this job runs on hora's own transport, the part Horovod's Gloo plays.

    It is what ``use_gloo``/``horarun --gloo`` (and no flag) run on. False before
    ``init()``, and for a job whose data MPI carries.
    """
    return is_initialized() and current().config.transport != "mpi"


def gloo_built(verbose: bool = False) -> bool:
    """True: hora's own transport, its counterpart of Horovod's Gloo, is always there."""
    return True


def nccl_built(verbose: bool = False) -> int:
    """0: hora has no NCCL data plane (the NCCL version code otherwise)."""
    return 0


def ddl_built(verbose: bool = False) -> bool:
    return False


def ccl_built(verbose: bool = False) -> bool:
    return False


def cuda_built(verbose: bool = False) -> bool:
    return False


def rocm_built(verbose: bool = False) -> bool:
    return False


def _framework_sees_gpu(framework: str) -> bool:
    """Whether ``framework`` (imported now) sees a GPU; False for one hora cannot ask."""
    if framework not in ("torch", "tensorflow"):
        return False  # Horovod's MXNet extension has no GPU check either
    module: Any = importlib.import_module(framework)
    if framework == "torch":
        return bool(module.cuda.is_available())
    return bool(module.config.list_physical_devices("GPU"))


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Horovod's check that its extension for ``ext_base_name`` runs with a GPU.

    hora has no GPU data plane (GPU tensors are staged through host memory), so this asks
    the framework itself, as Horovod's check does: ``"torch"``: CUDA is available;
    ``"tensorflow"``: TensorFlow lists a GPU; anything else (``"mxnet"``), or a framework
    that is not installed: False.

    Args:
        ext_base_name: ``"tensorflow"``, ``"torch"`` or ``"mxnet"``.
        verbose: print what was checked and the answer.
    """
    try:
        available = _framework_sees_gpu(ext_base_name)
    except ImportError as exc:
        available = False
        if verbose:
            print(f"Extension {ext_base_name} cannot be imported: {exc}")
    if verbose:
        print(f"Extension {ext_base_name} {'was' if available else 'was NOT'} running with GPU.")
    return available


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts recording a timeline (a Chrome trace) of every collective into ``file_path``.

    Rank 0 records (the coordinator sees every rank's requests); on other ranks this
    does nothing. Unlike Horovod, this needs no ``HOROVOD_TIMELINE=DYNAMIC``.

    Args:
        file_path: the file to write, replaced if it exists.
        mark_cycles: also mark each busy pass of the engine loop.

    Raises:
        OSError: the file cannot be created.
    """
    current().engine.set_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stops recording the timeline and closes its file (a complete JSON array)."""
    current().engine.set_timeline(None)


def poll(handle: int) -> bool:
    """True when the asynchronous collective behind ``handle`` has finished."""
    return current().poll(handle)


def synchronize(handle: int) -> Any:
    """Waits for the asynchronous collective behind ``handle`` and returns its result.

    Raises:
        HoraInternalError: the job failed (a rank was lost) while it was in flight.
        CollectiveMismatchError: the ranks disagreed about it (shape, type, op, ...).
    """
    return current().synchronize(handle)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Blocks until every rank of the set has called ``barrier``."""
    runtime = current()
    ops.barrier(runtime, process_set).wait()


def join(device: int = -1) -> int:
    """Declares that this rank has no more data; blocks until every rank has joined.

    Until then this rank takes part in other ranks' allreduces with zeros (so uneven
    amounts of data per rank do not hang the job); other collectives are refused.

    Args:
        device: accepted for Horovod compatibility; hora runs joins on the CPU.

    Returns:
        The rank that joined last, the same on every rank.
    """
    return int(ops.join(current()).wait())


def _submit_set(runtime: Runtime, ranks: Sequence[int]) -> Handle:
    """Submits the collective that registers a set of these ranks (holding
    ``_context.lock``, which keeps the ranks' numbering of these calls in step).

    Raises:
        ValueError: ranks outside the job.
    """
    if not ranks or any(r >= runtime.size for r in ranks):
        raise ValueError(
            f"ProcessSet(ranks={list(ranks)}): ranks must be non-empty and below the job size {runtime.size}"
        )
    _context.set_calls += 1
    name = f"process_set.add.{_context.set_calls}"
    return runtime.submit(RequestType.ADD_PROCESS_SET, name, DataType.UINT8, None, None, splits=list(ranks))


def _await_set(handle: Handle) -> int:
    """Waits for a registration (without ``_context.lock``: a ``shutdown()`` from another
    thread must not wait behind it).

    Returns:
        The new set's id.

    Raises:
        ValueError: the ranks disagreed about the set, or it exists already.
        HoraInternalError: the job failed or shut down meanwhile.
    """
    try:
        return int(handle.wait())
    except CollectiveMismatchError as exc:
        raise ValueError(str(exc)) from None


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a new process set; every rank must call it, in the same order.

    Needs dynamic mode: ``init(process_sets="dynamic")`` or HORA_DYNAMIC_PROCESS_SETS=1.

    Returns:
        The registered set, with its ``process_set_id``.

    Raises:
        ValueError: not in dynamic mode, a duplicate set, or ranks outside the job.
    """
    runtime = current()
    if not _context.dynamic:
        raise ValueError(
            "Set HORA_DYNAMIC_PROCESS_SETS=1 (or HOROVOD_DYNAMIC_PROCESS_SETS=1), or call "
            "hvd.init(process_sets='dynamic'), to add process sets after initialization."
        )
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise NotImplementedError(
            "Dynamically adding process sets defined by an MPI communicator is not implemented. "
            "Please build the process set via a list of ranks."
        )
    ranks = process_set.ranks
    with _context.lock:
        if process_set.process_set_id is not None and process_set._runtime is runtime:
            raise ValueError(f"Attempted to add a duplicate process set: {process_set!r}")
        handle = _submit_set(runtime, ranks)
    set_id = _await_set(handle)
    with _context.lock:
        if _context.runtime is not runtime:
            raise HoraInternalError(f"add_process_set({ranks}): hora shut down meanwhile")
        process_set._bind(runtime, set_id)
        _context.sets.append(process_set)
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes a process set added before; every rank must call it.

    Returns:
        True if the set was removed, False if it was not registered.
    """
    runtime = current()
    if not _context.dynamic:
        raise ValueError("Process sets can only be removed in dynamic mode (see add_process_set).")
    if process_set.process_set_id in (None, 0) or process_set._runtime is not runtime:
        return False
    with _context.lock:  # submitted under the lock, waited for without it (see add_process_set)
        _context.set_calls += 1
        handle = runtime.submit(
            RequestType.REMOVE_PROCESS_SET, f"process_set.remove.{_context.set_calls}", DataType.UINT8,
            None, None, root_rank=int(process_set.process_set_id),
        )  # fmt: skip
    try:
        removed = bool(handle.wait())
    except CollectiveMismatchError:
        return False
    with _context.lock:
        if process_set in _context.sets:
            _context.sets.remove(process_set)
        process_set._unbind()
    return removed


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Sends a picklable object from ``root_rank`` to every rank of the set.

    ``root_rank`` is a global rank (a member of the set), as in Horovod. The object
    travels as a cloudpickle, only between authenticated ranks of this job.

    Returns:
        The root's object, on every rank.
    """
    runtime = current()
    # Unnamed calls are numbered per set, so ranks holding objects of different types
    # (root: a dict, others: None) still agree on the name.
    base = ops.full_name(runtime, "broadcast_object", name, process_set)
    with ops.refusal(runtime, RequestType.BROADCAST, [f"{base}.sz"], process_set):  # e.g. an unpicklable object
        is_root = runtime.rank == root_rank  # a global rank, as in Horovod
        payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8) if is_root else np.empty(0, np.uint8)
        length = np.array([payload.size], dtype=np.int64)
        handle = ops.broadcast(runtime, ops.from_numpy(length), length, root_rank, f"{base}.sz", process_set)
    handle.wait()
    data = payload.copy() if is_root else np.empty(int(length[0]), dtype=np.uint8)
    ops.broadcast(runtime, ops.from_numpy(data), data, root_rank, f"{base}.t", process_set).wait()
    return obj if is_root else cloudpickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gathers a picklable object from every rank of the set.

    Returns:
        The objects, in rank order, on every rank.
    """
    runtime = current()
    base = ops.full_name(runtime, "allgather_object", name, process_set)
    with ops.refusal(runtime, RequestType.ALLGATHER, [f"{base}.sz"], process_set):  # e.g. an unpicklable object
        payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8).copy()
        size = np.array([payload.size], dtype=np.int64)
        handle = ops.allgather(runtime, ops.from_numpy(size), f"{base}.sz", process_set)
    lengths = handle.wait()
    data = ops.allgather(runtime, ops.from_numpy(payload), f"{base}.t", process_set).wait()
    out = []
    offset = 0
    for length in lengths.reshape(-1):
        out.append(cloudpickle.loads(data[offset : offset + int(length)].tobytes()))
        offset += int(length)
    return out
