"""How TensorFlow tensors reach hora's core and how results come back.

Every collective of ``hora.tensorflow`` is a Python function on *eager* tensors (a
"kernel"). Eagerly it is called at once. Inside ``tf.function`` (and so in Keras'
``model.fit``) it becomes one ``tf.py_function`` op, which TensorFlow runs with eager
tensors in the same process. py_function ops are stateful, so ``tf.function``'s
automatic control dependencies run them in program order: every rank submits its
collectives in the same order, which is what hora's engine needs.

Memory, per direction:

* In: ``EagerTensor._numpy()`` is a view of the tensor's own buffer (CPU tensors), so
  the core reads the tensor in place. (``.numpy()`` would copy; a GPU tensor is
  copied to the host.)
* Out: hora writes results into NumPy buffers aligned to 64 bytes, and TensorFlow
  adopts them through DLPack without a copy. Results the engine allocates itself
  (allgather, alltoall, reducescatter) are adopted the same way when aligned, and
  copied once otherwise. bfloat16 travels as uint16 and is bit-cast back (no copy).

XLA cannot compile a py_function: ``check_not_xla`` raises at trace time with the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf  # type: ignore[import-untyped]

from hora import ops
from hora.api import current
from hora.collectives.reduce import data_type_of
from hora.engine.handles import Handle
from hora.process_sets import ProcessSet

ALIGNMENT = 64  # bytes; TensorFlow's kernels assume EIGEN_MAX_ALIGN_BYTES-aligned buffers
Kernel = Callable[..., Any]

XLA_MESSAGE = (
    "hora.tensorflow.{what} cannot run inside a function compiled by XLA: hora's collectives run in Python "
    "(as tf.py_function ops), which XLA cannot compile. Turn XLA off for this step: "
    "tf.function(..., jit_compile=False), or model.compile(..., jit_compile=False) in Keras "
    "(Keras 3 turns XLA on by itself when it sees a GPU)."
)


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


def empty(count: int, dtype: np.dtype[Any]) -> np.ndarray:
    """A flat uninitialised array of ``count`` elements, aligned for TensorFlow."""
    nbytes = count * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + nbytes].view(dtype)


def wrap(array: np.ndarray, shape: Sequence[int], dtype: Any) -> Any:
    """A TensorFlow tensor of ``dtype`` over ``array`` (flat wire storage), reshaped.

    No copy when the buffer is aligned; one copy otherwise.
    """
    array = array.reshape(tuple(shape))
    if dtype == tf.bfloat16:
        return tf.bitcast(_adopt(array.view(np.uint16)), tf.bfloat16)
    return _adopt(array)


def _adopt(array: np.ndarray) -> Any:
    if array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0:
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)


def check_dtype(tensor: Any, what: str) -> None:
    """Raises ValueError at once (also while tracing) for a dtype hora cannot move."""
    try:
        data_type_of(np.dtype(tensor.dtype.as_numpy_dtype))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"hora.tensorflow.{what}: {exc}") from None


def check_member(process_set: ProcessSet, what: str) -> None:
    """Raises ValueError at once (also while tracing) when this rank may not use the set."""
    ops.set_id(current(), process_set, f"hora.tensorflow.{what}")


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


def run(kernel: Kernel, inputs: Sequence[Any], out_dtypes: Sequence[Any], what: str) -> list[Any]:
    """Runs ``kernel`` on ``inputs``: at once when eager, else as one py_function op.

    Returns:
        The kernel's outputs as a list (static shapes are the caller's to set).
    """
    if tf.executing_eagerly():
        return list(kernel(*inputs))
    check_not_xla(what)
    outputs = tf.py_function(kernel, list(inputs), list(out_dtypes), name=f"Hora{_camel(what)}")
    return [] if outputs is None else list(outputs)


def _camel(what: str) -> str:
    return "".join(part.capitalize() for part in what.split("_"))


def wait_all(handles: Sequence[Handle]) -> list[Any]:
    """Waits for every handle (so none stays in flight), then raises the first error."""
    results: list[Any] = []
    error: BaseException | None = None
    for handle in handles:
        try:
            results.append(handle.wait())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others finished
            results.append(None)
            error = error or exc
    if error is not None:
        raise error
    return results


def is_float(dtype: Any) -> bool:
    return bool(tf.as_dtype(dtype).is_floating)
