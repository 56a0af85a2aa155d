"""How TensorFlow tensors reach hora's core and how results come back.

Every collective of ``hora.tensorflow`` is a Python function on *eager* tensors (a
"kernel"). Eagerly it is called at once. Inside ``tf.function`` (and so in Keras'
``model.fit``) and TF1 graphs it becomes one ``tf.py_function`` op, which TensorFlow
runs with eager tensors in the same process. The kernels hand their tensors to the
core through ``TensorflowAdapter`` and ``hora.core.binding``, the path every binding shares.

Memory, per direction:

* In: ``EagerTensor._numpy()`` is a view of the tensor's own buffer (CPU tensors), so
  the core reads the tensor in place. (``.numpy()`` would copy; a GPU tensor is
  copied to the host.)
* Out: hora writes results into NumPy buffers aligned to 64 bytes, and TensorFlow
  adopts them through DLPack without a copy. Results the engine allocates itself
  (allgather, alltoall, reducescatter) are adopted the same way when aligned, and
  copied once otherwise. bfloat16 travels as uint16 and is bit-cast back (no copy).

XLA cannot compile a py_function: ``check_not_xla`` raises at trace time with the fix.

Names. Ranks match collectives by name, so every rank must give one collective the
same name. Eagerly, collectives run in program order, and an unnamed one is numbered
when it is called (``binding.full_name``). In a graph the order is TensorFlow's: inside
``tf.function`` its automatic control dependencies run stateful ops (py_functions are)
in program order, but a TF1 graph under ``Session.run`` or a ``wrap_function`` graph
runs independent ops in any order, on several threads, and the order differs between
ranks. So in a graph an unnamed collective's key is drawn when the op is *built*
(``draw_key``), once per op, and the kernel uses it on every run:

* The key is a name unique in the *root* graph: the outermost graph of the nest of
  function graphs being built (a ``tf.function``'s own graph, also for the ``tf.cond``
  branches, loop bodies and nested ``tf.function`` s traced inside it), or a TF1 graph
  (also for the ``tf.cond`` and ``tf.while_loop`` branches built in it, whose own graph
  names carry a process-wide counter that ranks need not have advanced alike).
  ``Graph.unique_name`` draws it (``<name scope>/Hora<Op>``, then ``_1``, ``_2``, ...),
  so it depends only on the ops built before it in that graph, which are the same on
  every rank: every rank traces the same program. A retrace builds a new root graph
  and draws the same keys again, whichever rank retraces (one rank may retrace alone,
  e.g. for a smaller last batch) and however often.
* A ``tf.function`` root prefixes its function's name (``train_step/...``), so the
  collectives of two functions have different names (TF1 graphs have no name).
* An op built in the root graph itself is named exactly its key, so TensorFlow's
  messages and hora's name the same node.

A TF1 graph's requests also carry the graph's number (``scope_of``): a refusal sent
while one graph was built, for an op the other ranks never ran, must not meet the op of
the same name in a later graph.

A name is reused by its op on every run; that is what lets the response cache skip
negotiation from the second step on. One op must not run twice at once (a
``tf.function`` called from two threads at once, or overlapping iterations of a loop
body): the second run's name is in flight and is refused.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf  # type: ignore[import-untyped]

from hora.core import binding, ops
from hora.core.api import current
from hora.collectives.reduce import data_type_of
from hora.core.ops import RequestType
from hora.errors import CollectiveMismatchError
from hora.core.process_sets import ProcessSet

Kernel = Callable[..., Any]

log = logging.getLogger(__name__)

XLA_MESSAGE = (
    "hora.tensorflow.{what} cannot run inside a function compiled by XLA: hora's collectives run in Python "
    "(as tf.py_function ops), which XLA cannot compile. Turn XLA off for this step: "
    "tf.function(..., jit_compile=False), or model.compile(..., jit_compile=False) in Keras "
    "(Keras 3 turns XLA on by itself when it sees a GPU)."
)


# The two classes below take TensorFlow's error arguments (node_def, op, message, ...):
# autograph re-raises an error of a tf.function's trace by calling its class with them.


class MismatchError(CollectiveMismatchError, tf.errors.FailedPreconditionError):  # type: ignore[misc]
    """Eagerly, a collective the ranks disagree about: hora's ``CollectiveMismatchError``
    and the ``tf.errors.FailedPreconditionError`` Horovod's TensorFlow ops raise for it.
    (Inside a graph TensorFlow turns any Python error of an op into ``UnknownError``.)"""

    def __init__(self, node_def: Any, op: Any, message: str, *args: Any) -> None:
        CollectiveMismatchError.__init__(self, message)
        tf.errors.FailedPreconditionError.__init__(self, node_def, op, message, *args)


class InvalidArgument(ValueError, tf.errors.InvalidArgumentError):  # type: ignore[misc]
    """A collective's arguments refused on this rank: the ``ValueError`` hora raises and
    the ``tf.errors.InvalidArgumentError`` Horovod's TensorFlow ops raise. Eagerly, and
    for membership of a process set also while a graph is built (inside a graph TensorFlow
    makes every ``ValueError`` of an op one already)."""

    def __init__(self, node_def: Any, op: Any, message: str, *args: Any) -> None:
        ValueError.__init__(self, message)
        tf.errors.InvalidArgumentError.__init__(self, node_def, op, message, *args)


def view(tensor: Any) -> ops.Tensor:
    """A zero-copy ``ops.Tensor`` over an eager tensor's memory.

    Raises:
        ValueError: hora does not move this dtype.
    """
    try:
        array = tensor._numpy()  # the tensor's own buffer, no copy (CPU)
    except AttributeError:
        array = np.asarray(tensor)
    if not isinstance(array, np.ndarray):
        array = np.asarray(array)
    return ops.from_numpy(array)


def wrap(array: np.ndarray, shape: Sequence[int], dtype: Any) -> Any:
    """A TensorFlow tensor of ``dtype`` over ``array`` (flat wire storage), reshaped.

    No copy when the buffer is aligned; one copy otherwise.
    """
    array = array.reshape(tuple(shape))
    if dtype == tf.bfloat16:
        return tf.bitcast(_adopt(array.view(np.uint16)), tf.bfloat16)
    return _adopt(array)


def _adopt(array: np.ndarray) -> Any:
    if array.flags.c_contiguous and array.ctypes.data % binding.ALIGNMENT == 0:
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)


class TensorflowAdapter:
    """Eager TensorFlow tensors as the core moves them (``binding.Adapter``): read in
    place, results written into aligned buffers TensorFlow adopts (see Memory)."""

    def stage(self, tensor: Any, writable: bool, what: str) -> tuple[ops.Tensor, Callable[[], Any]]:
        if writable:  # TensorFlow tensors are immutable: hora.tensorflow never asks
            raise ValueError(f"{what}: TensorFlow tensors cannot be written in place")
        try:
            return view(tensor), lambda: tensor
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{what}: {exc}") from None

    def output(self, tensor: Any, wire: ops.Tensor) -> tuple[np.ndarray, Callable[[], Any]]:
        out = binding.aligned_empty(wire.data.size, wire.data.dtype)
        return out, lambda: wrap(out, wire.shape, tensor.dtype)

    def wrap(self, array: np.ndarray, like: Any) -> Any:
        return wrap(array, array.shape, like.dtype)

    def splits(self, splits: Any) -> np.ndarray | None:
        # An empty splits tensor stands for "split evenly" (a py_function takes no None).
        array = np.asarray(splits).reshape(-1)
        return array if array.size else None

    def alltoall_result(self, output: Any, received: np.ndarray, splits_given: bool) -> list[Any]:
        return [output, tf.constant(np.asarray(received, dtype=np.int32))]


ADAPTER = TensorflowAdapter()


def check_dtype(tensor: Any, what: str) -> None:
    """Raises ValueError for a dtype hora cannot move (a check ``check_traced`` runs while tracing)."""
    try:
        data_type_of(np.dtype(tensor.dtype.as_numpy_dtype))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"hora.tensorflow.{what}: {exc}") from None


def check_member(process_set: ProcessSet, what: str) -> None:
    """Raises ``InvalidArgument`` (a ValueError, as Horovod's ops raise
    ``tf.errors.InvalidArgumentError``) at once, also while tracing, when this rank may
    not use the set."""
    try:
        ops.set_id(current(), process_set, f"hora.tensorflow.{what}")
    except ValueError as exc:
        raise InvalidArgument(None, None, str(exc)) from None


def check_not_xla(what: str) -> None:
    """Raises RuntimeError when the function being traced will be compiled by XLA."""
    from tensorflow.python.framework import ops as tf_ops  # type: ignore[import-untyped]
    from tensorflow.python.ops import control_flow_util  # type: ignore[import-untyped]

    if control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph()):
        raise RuntimeError(XLA_MESSAGE.format(what=what))


def scoped_name(name: str | None, ignore_name_scope: bool) -> str | None:
    """Prefixes a given name with the current name scope, as Horovod's TF ops do."""
    if name is None or ignore_name_scope:
        return name
    scope = tf.get_current_name_scope()
    return f"{scope}/{name}" if scope else name


def _control_flow_graphs() -> tuple[type, ...]:
    """The classes of the function graphs ``tf.cond`` and ``tf.while_loop`` build (TF 2's control flow)."""
    try:
        from tensorflow.python.ops import control_flow_v2_func_graphs as graphs
    except ImportError:  # pragma: no cover - every TensorFlow 2 has it
        return ()
    return (graphs.CondBranchFuncGraph, graphs.WhileBodyFuncGraph, graphs.WhileCondFuncGraph)


def _root(graph: Any) -> Any:
    """The root graph of ``graph`` for names (see the module's "Names"): the outermost of
    its nest of function graphs, and past that the TF1 graph that holds a ``tf.cond`` or
    ``tf.while_loop`` branch (built once with it; a branch graph's own name carries a
    process-wide counter, which ranks may have advanced differently), but not the TF1
    graph around a ``tf.function``'s graph (which may retrace on one rank alone)."""
    branches = _control_flow_graphs()
    while graph.building_function:
        outer = getattr(graph, "outer_graph", None)
        if outer is None or not (outer.building_function or isinstance(graph, branches)):
            break
        graph = outer
    return graph


def draw_key(what: str) -> tuple[str, str]:
    """Draws the key of a collective op about to be built in the default graph.

    See the module's "Names": a name unique in the root graph, prefixed with the root
    function's name. Call once per op, while building it.

    Returns:
        The key, and the name to build the op under: exactly the key when the op is
        built in the root graph itself (a trailing ``/`` tells TensorFlow to take the
        name as it is), else ``Hora<Op>`` for TensorFlow to make unique in its graph.
    """
    from tensorflow.python.framework import ops as tf_ops

    graph = tf_ops.get_default_graph()
    root = _root(graph)
    base = f"Hora{_camel(what)}"
    reserved = root.unique_name(base)  # marks it used: no later op or key of the root takes it
    prefix = f"{root.name}/" if root.building_function else ""
    return prefix + reserved, (f"{reserved}/" if graph is root else base)


def scope_of(graph: Any) -> int:
    """The number of the TF1 graph ``graph`` belongs to, 0 inside a function's graph.

    Numbered when its first collective op is built (``Runtime.scope_number``), so every
    rank, building the same graphs in the same order, numbers them alike. The op's
    requests carry it (``Request.scope``): keys restart in every graph, and a refusal
    sent while one graph was built must not meet a later graph's op of the same name.
    """
    root = _root(graph)
    return 0 if root.building_function else current().scope_number(root)


def check_traced(
    checks: Callable[[], None],
    kind: RequestType,
    what: str,
    name: str | None,
    process_set: ProcessSet,
    grouped: bool,
    count: int,
) -> None:
    """While a graph is built, runs the checks of this rank's inputs to a collective op.

    A failure fails the trace here, at once, and is also sent to the coordinator under
    the names the op would have had (its key drawn as ``run`` would draw it), so the
    other ranks, which built the op, fail it on its first run instead of waiting for
    this rank. Eagerly nothing runs here: the kernel runs now, and the binding core
    checks the same things and tells the others (``ops.refusal``).

    Args:
        checks: raises what is wrong with this rank's inputs.
        kind: the collective's request type.
        what: the op as ``run`` gets it (``allreduce``, ``grouped_allgather``, ...).
        name: the name the program gave, or None.
        grouped: the op takes a list of tensors (``broadcast_`` too).
        count: how many tensors the op takes.

    Raises:
        Exception: what ``checks`` raised.
    """
    if tf.executing_eagerly():
        return
    try:
        checks()
    except Exception:
        from tensorflow.python.framework import ops as tf_ops

        key, _ = draw_key(what)
        runtime = current()
        op = what.removeprefix("grouped_")
        _, names, group = binding.call_names(
            runtime, op, name, process_set, grouped, count, key, wire_group=kind != RequestType.BROADCAST
        )
        scope = scope_of(tf_ops.get_default_graph())
        with runtime.in_scope(scope), ops.refusal(runtime, kind, names, process_set, group):
            raise


def run(kernel: Kernel, inputs: Sequence[Any], out_dtypes: Sequence[Any], what: str) -> list[Any]:
    """Runs ``kernel(key, *inputs)``: at once when eager, else as one py_function op.

    The kernel gets the key of its unnamed collective: None when eager (the binding
    numbers it now), else the one drawn here while the op is built (``draw_key``),
    the same on every run.

    Returns:
        The kernel's outputs as a list (static shapes are the caller's to set).
    """
    if tf.executing_eagerly():
        try:
            return list(kernel(None, *inputs))
        except CollectiveMismatchError as exc:
            raise MismatchError(None, None, str(exc)) from None
        except ValueError as exc:
            raise InvalidArgument(None, None, str(exc)) from None
    check_not_xla(what)
    key, op_name = draw_key(what)
    from tensorflow.python.framework import ops as tf_ops

    scope = scope_of(tf_ops.get_default_graph())  # not 0: a TF1 graph, run by a Session

    def body(*tensors: Any) -> Any:
        if scope:
            with current().in_scope(scope):
                return _holding_a_session_thread(key, lambda: kernel(key, *tensors))
        return kernel(key, *tensors)

    outputs = tf.py_function(body, list(inputs), list(out_dtypes), name=op_name)
    return [] if outputs is None else list(outputs)


SESSION_THREADS = 64  # the fewest inter-op threads hora asks TensorFlow for (provide_session_threads)


def provide_session_threads(environ: MutableMapping[str, str]) -> None:
    """Gives TF1 Sessions enough inter-op threads for the collectives they run at once.

    In a Session each collective holds an inter-op thread while it waits (a py_function
    cannot wait asynchronously as Horovod's C++ kernels do). TensorFlow's pool has as many
    threads as the CPUs the process may use: one under ``mpirun``'s binding to a core, so
    two independent collectives in one graph could each hold a rank's only thread,
    different ones on different ranks, and wait for each other for ever (Horovod's own
    ``test_horovod_allgather_fused_cpu`` did). Sessions and eager execution share one
    pool, sized when TensorFlow starts its runtime; so, before that, and unless
    ``TF_NUM_INTEROP_THREADS`` is set, hora sets it to ``SESSION_THREADS`` or the CPUs,
    whichever is more. A number the program gives TensorFlow itself
    (``tf.config.threading``, a Session's ``inter_op_parallelism_threads``) still wins
    over the variable. Extra threads sleep until work comes.

    Args:
        environ: the process's environment (``os.environ``), where TensorFlow reads it.
    """
    if "TF_NUM_INTEROP_THREADS" in environ:
        return
    from tensorflow.python.eager import context  # type: ignore[import-untyped]

    if getattr(context.context(), "_initialized", True):  # the runtime runs: its pool is sized
        return
    environ["TF_NUM_INTEROP_THREADS"] = str(max(SESSION_THREADS, len(os.sched_getaffinity(0))))


SESSION_WAIT_MESSAGE = (
    "hora.tensorflow: collective {key!r} has waited {seconds:g} s in a TF1 Session. While it waits it holds "
    "one of the Session's inter-op threads (at least 64 unless the program chose a number): when a graph has "
    "more independent collectives ready at once than the Session has threads, the ranks can each hold all their "
    "threads on different collectives and wait for each other for ever. Give the Session more threads "
    "(ConfigProto(inter_op_parallelism_threads=N), or TF_NUM_INTEROP_THREADS=N before the first Session, N at "
    "least the collectives that can run at once), or group the collectives (grouped_allreduce, "
    "grouped_allgather)."
)


def _holding_a_session_thread(key: str, call: Callable[[], Any]) -> Any:
    """Runs the kernel of a TF1 Session's op, warning if it waits past the stall warning
    time: in a Session a waiting collective holds an inter-op thread (docs/tensorflow.md),
    which Horovod's asynchronous C++ kernels do not."""
    config = current().config
    if config.stall_check_disable:
        return call()
    seconds = config.stall_check_time_seconds
    timer = threading.Timer(seconds, log.warning, (SESSION_WAIT_MESSAGE.format(key=key, seconds=seconds),))
    timer.daemon = True
    timer.start()
    try:
        return call()
    finally:
        timer.cancel()


def _camel(what: str) -> str:
    return "".join(part.capitalize() for part in what.split("_"))


def is_float(dtype: Any) -> bool:
    return bool(tf.as_dtype(dtype).is_floating)
