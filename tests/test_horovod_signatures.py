"""Every public call keeps Horovod 0.28.1's parameters, in Horovod's order.

A Horovod program may pass any argument by position, so hora's parameters must begin with
Horovod's, name for name (hora may add parameters after them). The tables are Horovod's
own signatures, read from its source; a hora parameter renamed, dropped or moved fails
here. Found this way: ``HorovodAllreduce.apply`` without ``average``, and
``BestModelCheckpoint`` with ``save_weights_only`` after ``mode``.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

TORCH = {
    "allreduce": ["tensor", "average", "name", "compression", "op", "prescale_factor", "postscale_factor",
                  "process_set"],
    "allreduce_async": ["tensor", "average", "name", "op", "prescale_factor", "postscale_factor", "process_set"],
    "allreduce_": ["tensor", "average", "name", "op", "prescale_factor", "postscale_factor", "process_set"],
    "allreduce_async_": ["tensor", "average", "name", "op", "prescale_factor", "postscale_factor", "process_set"],
    "grouped_allreduce": ["tensors", "average", "name", "compression", "op", "prescale_factor", "postscale_factor",
                          "process_set"],
    "grouped_allreduce_async": ["tensors", "average", "name", "op", "prescale_factor", "postscale_factor",
                                "process_set"],
    "grouped_allreduce_": ["tensors", "average", "name", "op", "prescale_factor", "postscale_factor", "process_set"],
    "grouped_allreduce_async_": ["tensors", "average", "name", "op", "prescale_factor", "postscale_factor",
                                 "process_set"],
    "sparse_allreduce_async": ["tensor", "name", "op", "process_set"],
    "allgather": ["tensor", "name", "process_set"],
    "allgather_async": ["tensor", "name", "process_set"],
    "grouped_allgather": ["tensors", "name", "process_set"],
    "grouped_allgather_async": ["tensors", "name", "process_set"],
    "broadcast": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_async": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_async_": ["tensor", "root_rank", "name", "process_set"],
    "alltoall": ["tensor", "splits", "name", "process_set"],
    "alltoall_async": ["tensor", "splits", "name", "process_set"],
    "reducescatter": ["tensor", "name", "compression", "op", "process_set", "prescale_factor", "postscale_factor"],
    "reducescatter_async": ["tensor", "name", "op", "process_set", "prescale_factor", "postscale_factor"],
    "grouped_reducescatter": ["tensors", "name", "compression", "op", "process_set", "prescale_factor",
                              "postscale_factor"],
    "grouped_reducescatter_async": ["tensors", "name", "op", "process_set", "prescale_factor", "postscale_factor"],
    "join": ["device"],
    "barrier": ["process_set"],
    "poll": ["handle"],
    "synchronize": ["handle"],
    "mpi_ops.HorovodAllreduce.forward": ["ctx", "tensor", "average", "name", "op", "prescale_factor",
                                         "postscale_factor", "process_set"],
    "mpi_ops.HorovodGroupedAllreduce.forward": ["ctx", "average", "name", "op", "prescale_factor",
                                                "postscale_factor", "process_set", "*tensors"],
    "mpi_ops.HorovodAllgather.forward": ["ctx", "tensor", "name", "process_set"],
    "mpi_ops.HorovodBroadcast.forward": ["ctx", "tensor", "root_rank", "name", "process_set"],
    "mpi_ops.HorovodAlltoall.forward": ["ctx", "tensor", "splits", "name", "process_set"],
    "mpi_ops.HorovodReducescatter.forward": ["ctx", "tensor", "name", "op", "process_set", "prescale_factor",
                                             "postscale_factor"],
    "broadcast_parameters": ["params", "root_rank"],
    "broadcast_optimizer_state": ["optimizer", "root_rank", "model"],
    "broadcast_object": ["obj", "root_rank", "name", "process_set"],
    "allgather_object": ["obj", "name"],
    "DistributedOptimizer": ["optimizer", "named_parameters", "compression", "backward_passes_per_step", "op",
                             "gradient_predivide_factor", "num_groups", "groups", "sparse_as_dense", "process_set"],
    "SyncBatchNorm": ["num_features", "eps", "momentum", "affine", "track_running_stats"],
    "elastic.TorchState": ["model", "optimizer", "**kwargs"],
    "elastic.ElasticSampler": ["dataset", "shuffle", "seed"],
    "add_process_set": ["process_set"],
    "remove_process_set": ["process_set"],
}  # fmt: skip

RUN = {
    "run": ["func", "args", "kwargs", "num_proc", "min_num_proc", "max_num_proc", "slots", "reset_limit",
            "cooldown_range", "hosts", "hostfile", "host_discovery_script", "start_timeout", "ssh_port",
            "ssh_identity_file", "disable_cache", "output_filename", "verbose", "use_gloo", "use_mpi", "mpi_args",
            "network_interface", "network_interfaces", "executable", "np", "min_np", "max_np"],
}  # fmt: skip

TENSORFLOW = {
    "allreduce": ["tensor", "average", "device_dense", "device_sparse", "compression", "op", "prescale_factor",
                  "postscale_factor", "name", "process_set", "ignore_name_scope"],
    "grouped_allreduce": ["tensors", "average", "device_dense", "device_sparse", "compression", "op",
                          "prescale_factor", "postscale_factor", "process_set", "ignore_name_scope", "name"],
    "allgather": ["tensor", "name", "ignore_name_scope", "process_set"],
    "grouped_allgather": ["tensors", "name", "ignore_name_scope", "process_set"],
    "broadcast": ["tensor", "root_rank", "name", "ignore_name_scope", "process_set"],
    "broadcast_": ["variables", "root_rank", "name", "process_set"],
    "alltoall": ["tensor", "splits", "name", "ignore_name_scope", "process_set"],
    "reducescatter": ["tensor", "device_dense", "compression", "op", "name", "process_set", "ignore_name_scope",
                      "prescale_factor", "postscale_factor"],
    "grouped_reducescatter": ["tensors", "device_dense", "compression", "op", "process_set", "prescale_factor",
                              "postscale_factor"],
    "size_op": ["process_set_id", "name"],
    "local_size_op": ["name"],
    "process_set_included_op": ["process_set_id", "name"],
    "rank_op": ["name"],
    "local_rank_op": ["name"],
    "broadcast_variables": ["variables", "root_rank", "process_set", "inplace"],
    "broadcast_object": ["obj", "root_rank", "session", "name", "process_set"],
    "broadcast_object_fn": ["root_rank", "session", "name", "process_set"],
    "allgather_object": ["obj", "session", "name", "process_set"],
    "broadcast_global_variables": ["root_rank"],
    "DistributedGradientTape": ["gradtape", "device_dense", "device_sparse", "compression", "sparse_as_dense", "op",
                                "gradient_predivide_factor", "num_groups", "groups", "process_set",
                                "scale_local_gradients"],
    "DistributedOptimizer": ["optimizer", "name", "use_locking", "device_dense", "device_sparse", "compression",
                             "sparse_as_dense", "backward_passes_per_step", "op", "gradient_predivide_factor",
                             "average_aggregated_gradients", "num_groups", "groups", "process_set",
                             "scale_local_gradients"],
    "PartialDistributedGradientTape": ["gradtape", "device_dense", "device_sparse", "compression", "sparse_as_dense",
                                       "op", "gradient_predivide_factor", "num_groups", "groups", "process_set",
                                       "local_layers", "scale_local_gradients"],
    "BroadcastGlobalVariablesHook": ["root_rank", "device"],
    "elastic.TensorFlowKerasState": ["model", "optimizer", "backend", "**kwargs"],
    "elastic.TensorFlowState": ["variables", "session", "**kwargs"],
    "SyncBatchNormalization": ["fused", "**kwargs"],
}  # fmt: skip

KERAS = {
    "DistributedOptimizer": ["optimizer", "name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
                             "gradient_predivide_factor", "op", "backward_passes_per_step",
                             "average_aggregated_gradients", "num_groups", "groups", "process_set",
                             "scale_local_gradients"],
    "broadcast_global_variables": ["root_rank"],
    "allreduce": ["value", "name", "average", "prescale_factor", "postscale_factor", "op", "compression"],
    "allgather": ["value", "name"],
    "broadcast": ["value", "root_rank", "name"],
    "reducescatter": ["value", "name", "op"],
    "load_model": ["filepath", "custom_optimizers", "custom_objects", "compression", "legacy_opts"],
    "callbacks.BroadcastGlobalVariablesCallback": ["root_rank", "device", "local_variables"],
    "callbacks.MetricAverageCallback": ["device"],
    "callbacks.LearningRateScheduleCallback": ["initial_lr", "multiplier", "start_epoch", "end_epoch", "staircase",
                                               "momentum_correction", "steps_per_epoch"],
    "callbacks.LearningRateWarmupCallback": ["initial_lr", "warmup_epochs", "momentum_correction", "steps_per_epoch",
                                             "verbose"],
    "callbacks.BestModelCheckpoint": ["monitor", "verbose", "save_weights_only", "mode", "save_freq"],
    "elastic.KerasState": ["model", "optimizer", "**kwargs"],
    "elastic.CommitStateCallback": ["state", "batches_per_commit"],
    "elastic.UpdateBatchStateCallback": ["state"],
    "elastic.UpdateEpochStateCallback": ["state"],
}  # fmt: skip
# horovod.keras differs from horovod.tensorflow.keras in two signatures.
STANDALONE_KERAS = {
    **KERAS,
    "DistributedOptimizer": ["optimizer", "name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
                             "gradient_predivide_factor", "op", "num_groups", "groups"],
    "callbacks.BestModelCheckpoint": ["monitor", "verbose", "mode", "save_freq"],
}  # fmt: skip


def _parameters(module: Any, dotted: str) -> list[str]:
    """The parameter names of ``module.<dotted>`` (a class: its constructor's), ``*``/``**`` marked."""
    target = module
    for part in dotted.split("."):
        target = getattr(target, part)
    names = []
    for parameter in inspect.signature(target).parameters.values():
        prefix = {parameter.VAR_POSITIONAL: "*", parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
        names.append(prefix + parameter.name)
    return names


def _check(module_name: str, table: dict[str, list[str]]) -> list[str]:
    module = importlib.import_module(module_name)
    problems = []
    for dotted, horovods in table.items():
        mine = _parameters(module, dotted)
        if mine[: len(horovods)] != horovods and not (horovods[-1:] == ["**kwargs"] and mine[-1:] == ["**kwargs"]
                                                       and mine[: len(horovods) - 1] == horovods[:-1]):  # fmt: skip
            problems.append(f"{module_name}.{dotted}: Horovod's {horovods}, hora's {mine}")
    return problems


def test_torch_and_run_take_horovods_parameters_in_order() -> None:
    assert _check("hora.torch", TORCH) + _check("hora", RUN) == []


@pytest.mark.framework
def test_tensorflow_and_keras_take_horovods_parameters_in_order() -> None:
    problems = _check("hora.tensorflow", TENSORFLOW)
    problems += _check("hora.tensorflow.keras", KERAS) + _check("hora.keras", STANDALONE_KERAS)
    assert problems == []
