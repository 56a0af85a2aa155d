"""Broadcasting a Gluon model's parameters, and Python objects, between ranks."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import mxnet as mx

from hora.core.api import allgather_object, broadcast_object, synchronize
from hora.core import binding
from hora.core.process_sets import ProcessSet, global_process_set
from hora.mxnet.tensors import ADAPTER

__all__ = ["allgather_object", "broadcast_object", "broadcast_parameters"]


def _broadcast_after_init(param: Any, root_rank: int, name: str, process_set: ProcessSet) -> None:
    """Makes a deferred parameter broadcast its value from ``root_rank`` as soon as it is initialised.

    Gluon initialises such a parameter when the first batch gives it its shape, which
    every rank does at the same point of its program, so the broadcasts meet.
    """
    initialise = param._init_impl

    def init_then_broadcast(self: Any, *args: Any, **kwargs: Any) -> None:
        initialise(*args, **kwargs)
        synchronize(binding.broadcast_async(ADAPTER, self.data(), root_rank, name, process_set, True))

    param._init_impl = types.MethodType(init_then_broadcast, param)


def broadcast_parameters(
    params: Any, root_rank: int = 0, prefix: str | None = None, process_set: ProcessSet = global_process_set
) -> None:
    """Overwrites parameters on every rank with ``root_rank``'s, in place.

    Typical use, once after building the model (and after loading a checkpoint on
    rank 0)::

        hvd.broadcast_parameters(net.collect_params(), root_rank=0)

    A Gluon parameter whose initialisation is deferred (its shape is known only after
    the first batch) is broadcast right after Gluon initialises it, as in Horovod.

    Args:
        params: a Gluon ``ParameterDict`` (``block.collect_params()``) or a dict of
            ``Parameter`` or NDArray values (``module.get_params()``'s), broadcast in
            sorted name order.
        root_rank: the rank whose values every rank receives (a global rank).
        prefix: put before every name; two ``broadcast_parameters`` in flight at once
            need different prefixes.
        process_set: the ranks taking part (an addition to Horovod's signature).

    Raises:
        ValueError: ``params`` is neither a dict nor a ``ParameterDict``, or ``prefix``
            is not a string.
    """
    if process_set.size() == 1:
        return
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError(f"broadcast_parameters: prefix must be a string or None; got {type(prefix).__name__}")
    if not isinstance(params, (Mapping, mx.gluon.ParameterDict)):
        raise ValueError(f"invalid params of type: {type(params)}")
    prefix = prefix or ""
    handles = []
    for key, value in sorted(params.items()):
        name = prefix + str(key)
        if isinstance(value, mx.gluon.Parameter):
            try:
                value = value.data()
            except mx.gluon.parameter.DeferredInitializationError:
                _broadcast_after_init(value, root_rank, name, process_set)
                continue
        handles.append(binding.broadcast_async(ADAPTER, value, root_rank, name, process_set, True))
    for handle in handles:
        synchronize(handle)
