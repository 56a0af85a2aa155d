"""Horovod's basics are declared once (hora.core.basics) and every binding offers them as the same objects."""

from __future__ import annotations

import importlib

import pytest

from hora.core import basics

BINDINGS = ["hora.numpy", "hora.torch", "hora.torch.mpi_ops"]


def _check(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in basics.__all__:
        assert name in module.__all__, f"{module_name} does not export {name}"
        assert getattr(module, name) is getattr(basics, name), f"{module_name}.{name} is not hora.core.basics.{name}"
    assert len(module.__all__) == len(set(module.__all__)), f"{module_name}.__all__ repeats names"
    assert all(hasattr(module, name) for name in module.__all__)


@pytest.mark.parametrize("module_name", BINDINGS)
def test_every_binding_offers_the_basics(module_name: str) -> None:
    _check(module_name)


@pytest.mark.framework
def test_tensorflow_offers_the_basics() -> None:
    _check("hora.tensorflow")
    _check("hora.tensorflow.mpi_ops")  # Horovod's module of that name
    import hora.tensorflow as hvd
    from hora.tensorflow import mpi_ops

    assert mpi_ops.allgather is hvd.allgather and mpi_ops.join is hvd.join and mpi_ops.rank_op is hvd.rank_op


def test_horovod_common_modules_hold_the_same_objects() -> None:
    """``from horovod.common.<module> import ...`` lines work with ``hora`` for ``horovod``."""
    from hora import elastic, errors
    from hora.common import elastic as common_elastic
    from hora.common import exceptions, process_sets

    assert exceptions.HorovodInternalError is errors.HoraInternalError is basics.HorovodInternalError
    assert exceptions.HostsUpdatedInterrupt is basics.HostsUpdatedInterrupt
    assert exceptions.HorovodVersionMismatchError is errors.HoraVersionMismatchError
    assert process_sets.ProcessSet is basics.ProcessSet and process_sets.global_process_set is basics.global_process_set
    assert process_sets.add_process_set is basics.add_process_set
    assert process_sets.remove_process_set is basics.remove_process_set
    assert (common_elastic.State, common_elastic.ObjectState, common_elastic.run_fn) == (
        elastic.State, elastic.ObjectState, elastic.run_fn,
    )  # fmt: skip
    for module in (exceptions, process_sets, common_elastic):
        assert all(hasattr(module, name) for name in module.__all__)


def test_torch_elastic_has_horovods_submodules() -> None:
    """``horovod.torch.elastic.sampler`` and ``.state`` (Horovod's docs import the sampler from there)."""
    import hora.torch as hvd
    from hora.torch.elastic.sampler import ElasticSampler
    from hora.torch.elastic.state import ModelStateHandler, TorchState, get_handler_registry

    assert hvd.elastic.ElasticSampler is ElasticSampler and hvd.elastic.TorchState is TorchState
    assert (ModelStateHandler in [handler for _, handler in get_handler_registry()])
