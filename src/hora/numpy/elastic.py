"""Elastic training with the NumPy binding: ``hvd.elastic.run``, ``State``, ``ObjectState``.

    import hora.numpy as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(weights=np.zeros(10), epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, 5):
            ...  # collectives
            state.commit()

    train(state)

A reset re-initializes hora (``shutdown()`` then ``init()``); with no elastic driver
yet, against the same world.
"""

from __future__ import annotations

from typing import Any

from hora import elastic as _elastic
from hora.core import api
from hora.elastic import HostUpdateResult, run


def _broadcast(obj: Any) -> Any:
    return api.broadcast_object(obj, root_rank=0)


class State(_elastic.State):
    """``hora.elastic.State`` bound to this binding's ``broadcast_object`` and ``rank``,
    for subclasses that track their own objects."""

    def __init__(self) -> None:
        super().__init__(bcast_object=_broadcast, get_rank=api.rank)


class ObjectState(_elastic.ObjectState):
    """Plain picklable objects, given as keyword arguments, synchronized from rank 0
    with this binding's ``broadcast_object``.

    Args:
        **kwargs: the objects tracked, by attribute name.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(bcast_object=_broadcast, get_rank=api.rank, **kwargs)


__all__ = ["HostUpdateResult", "ObjectState", "State", "run"]
