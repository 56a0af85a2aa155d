"""Torch tensors as hora moves them: zero-copy views of CPU memory, host staging for the rest.

A CPU tensor is handed to the core as a flat NumPy view of its own storage
(``numpy_view``), so the in-place collectives write straight into the tensor
and the out-of-place ones read it without a copy. bfloat16, which NumPy lacks,
travels as its raw 16 bits (a ``uint16`` view) under the core's BFLOAT16 code.

Tensors on another device (CUDA, XPU, MPS, ...) are staged through host memory:
copied to a CPU tensor when the collective is submitted and copied back when
``synchronize`` returns, both on the calling thread. hora has no GPU data plane yet,
so this costs two device-host copies per collective; it is correct, not fast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from hora.core import ops
from hora.collectives.reduce import DataType

_WIRE: dict[torch.dtype, DataType] = {
    torch.uint8: DataType.UINT8,
    torch.int8: DataType.INT8,
    torch.int16: DataType.INT16,
    torch.int32: DataType.INT32,
    torch.int64: DataType.INT64,
    torch.float16: DataType.FLOAT16,
    torch.float32: DataType.FLOAT32,
    torch.float64: DataType.FLOAT64,
    torch.bool: DataType.BOOL,
    torch.bfloat16: DataType.BFLOAT16,
}

_CPU = torch.device("cpu")


def _negative_bit_reader() -> Callable[[torch.Tensor], bool]:
    """How to read a tensor's lazy-negation bit without letting go of the GIL.

    ``Tensor.is_neg`` lets go of the GIL, like most of torch's methods: with the engine
    thread running Python (a burst of asynchronous calls), taking it back costs the
    caller 17-35 us a call here, against 0.1 us alone. The bit is one of the tensor's
    dispatch keys, which torch's ``_dispatch_keys`` reads holding the GIL (0.6-0.8 us
    either way). It is not a public API: where a torch lacks it, ``is_neg`` it is.
    """
    keys = getattr(torch._C, "_dispatch_keys", None)
    negative = getattr(getattr(torch._C, "DispatchKey", None), "Negative", None)
    if keys is None or negative is None:
        return torch.Tensor.is_neg

    def is_neg(tensor: torch.Tensor) -> bool:
        return bool(keys(tensor).has(negative))

    return is_neg


_is_neg = _negative_bit_reader()


@dataclasses.dataclass
class Staged:
    """A tensor prepared for a collective.

    Attributes:
        tensor: the caller's tensor.
        host: a CPU tensor holding the data the collective reads (and, for in-place
            collectives, writes): the caller's own storage for a contiguous CPU tensor.
        wire: the flat NumPy view of ``host`` the core moves.
    """

    tensor: torch.Tensor
    host: torch.Tensor
    wire: ops.Tensor

    @property
    def staged(self) -> bool:
        """True when ``host`` is a copy (a tensor on another device), not the tensor's own memory."""
        return not self.tensor.is_cpu


def wire_type(tensor: torch.Tensor) -> DataType:
    """Returns the core's type code for the tensor's dtype.

    Raises:
        ValueError: ``Tensor type ... is not supported.`` (with what is).
    """
    code = _WIRE.get(tensor.dtype)
    if code is None:
        supported = ", ".join(str(d) for d in _WIRE)
        raise ValueError(f"Tensor type {_type_name(tensor)} is not supported. hora moves {supported}.")
    return code


def _type_name(tensor: torch.Tensor) -> str:
    try:
        return tensor.type()
    except (TypeError, RuntimeError):  # dtypes without a legacy tensor type name
        return str(tensor.dtype)


# The storage type of each torch dtype hora moves, as NumPy spells it (bfloat16: uint16).
_TYPESTR: dict[torch.dtype, str] = {dtype: code.storage.str for dtype, code in _WIRE.items()}


class _Memory:
    """A contiguous CPU tensor's elements as NumPy reads them (``__array_interface__``).

    An array made from it keeps it, and so the tensor, alive (its ``base``).
    """

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, tensor: torch.Tensor, typestr: str, count: int) -> None:
        self.tensor = tensor
        self.__array_interface__ = {"data": (tensor.data_ptr(), False), "shape": (count,), "typestr": typestr, "version": 3}


def numpy_view(host: torch.Tensor) -> np.ndarray:
    """A flat NumPy view of a contiguous CPU tensor's elements (bfloat16 as uint16); no copy.

    Made from the tensor's address, not with ``tensor.numpy()``: torch lets go of the GIL
    in ``numpy()``, and while another thread runs Python (the engine's) taking it back costs
    ~100 us, against 1.3 us for this.

    Raises:
        ValueError: the tensor is not a contiguous CPU tensor (its address would not be
            host memory, or a view of it not its elements in order; ``numpy()`` refused both).
    """
    if not host.is_cpu or not host.is_contiguous():
        raise ValueError(f"hora internal error: a NumPy view of a non-contiguous or {host.device} tensor")
    typestr, count = _TYPESTR[host.dtype], host.numel()
    if count == 0:
        return np.empty(0, dtype=typestr)  # no address to view
    return np.asarray(_Memory(host, typestr, count))


def stage(tensor: torch.Tensor, *, writable: bool, what: str) -> Staged:
    """Prepares ``tensor`` for a collective.

    Args:
        tensor: the caller's tensor (any device; gradients are not tracked here).
        writable: the collective writes its result into the tensor (the ``_`` variants),
            so the tensor must be contiguous: a copy would not update it.
        what: the operation, for messages.

    Raises:
        ValueError: a sparse, meta or non-contiguous (in-place) tensor, or an
            unsupported dtype.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what} needs a torch.Tensor; got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        hint = ""
        if tensor.is_sparse:
            hint = " (use sparse_allreduce_async, or sparse_as_dense=True in DistributedOptimizer)"
        raise ValueError(f"{what}: {tensor.layout} tensors are not supported; pass a dense tensor{hint}")
    dtype = wire_type(tensor)
    if tensor.is_meta:  # the flags, not ``device.type`` (a device object per call, 0.45 us)
        raise ValueError(f"{what}: a tensor on the meta device has no data to send")
    if writable and not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    # Most of torch's methods let go of the GIL (detach, is_neg, resolve_neg, contiguous,
    # numpy): while the engine thread runs Python, each costs this thread a wait to take
    # it back (20-140 us here with another thread busy, against 0.5 us), so only the calls
    # that do something are made, and the negation bit is read holding it (``_is_neg``).
    # No lazy conjugation to resolve: hora's types are real, and only complex tensors
    # carry the conjugate bit.
    host = tensor.detach() if tensor.requires_grad else tensor
    if not host.is_cpu:
        # Staged through host memory (hora has no device data plane yet).
        host = host.to(_CPU).contiguous()
    elif writable:
        if _is_neg(host):  # a real view of a conjugated complex tensor's imaginary part, say
            raise ValueError(
                f"{what}: in-place collectives need a tensor without a lazy negation; call resolve_neg() first"
            )
    else:
        if _is_neg(host):
            host = host.resolve_neg()
        if not host.is_contiguous():
            host = host.contiguous()
    return Staged(tensor, host, ops.Tensor(numpy_view(host), tuple(host.shape), dtype))


def from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Wraps a result array from the core as a CPU tensor of ``dtype``; no copy."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_device(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Moves a CPU result to the device of ``like`` (a no-op for CPU tensors)."""
    return result if like.is_cpu else result.to(like.device)


def write_back(staged: Staged) -> torch.Tensor:
    """Completes an in-place collective: copies a staged result back to the tensor's device."""
    if staged.staged:
        staged.tensor.data.copy_(staged.host)
    return staged.tensor
