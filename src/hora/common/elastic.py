"""``horovod.common.elastic``: the framework-free part of elastic training (``hora.elastic``)."""

from hora.elastic import ObjectState, State, run_fn

__all__ = ["ObjectState", "State", "run_fn"]
