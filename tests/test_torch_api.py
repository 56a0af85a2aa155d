"""hora.torch's surface against horovod.torch 0.28.1, and single-process behaviour (no launcher)."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch

import hora.torch as hvd
from hora.core.process_sets import global_process_set
from hora.torch import tensors as tt

N = inspect.Parameter.empty
PS = global_process_set
NONE = hvd.Compression.none
AR = [("average", None), ("name", None), ("op", None), ("prescale_factor", 1.0), ("postscale_factor", 1.0), ("process_set", PS)]
RS = [("op", hvd.Average), ("process_set", PS), ("prescale_factor", 1.0), ("postscale_factor", 1.0)]

# horovod.torch 0.28.1: parameters in positional order, with defaults (N: required).
HOROVOD = {
    "allreduce": [("tensor", N), ("average", None), ("name", None), ("compression", NONE), *AR[2:]],
    "allreduce_async": [("tensor", N), *AR],
    "allreduce_": [("tensor", N), *AR],
    "allreduce_async_": [("tensor", N), *AR],
    "grouped_allreduce": [("tensors", N), ("average", None), ("name", None), ("compression", NONE), *AR[2:]],
    "grouped_allreduce_async": [("tensors", N), *AR],
    "grouped_allreduce_": [("tensors", N), *AR],
    "grouped_allreduce_async_": [("tensors", N), *AR],
    "sparse_allreduce_async": [("tensor", N), ("name", N), ("op", N), ("process_set", PS)],
    "allgather": [("tensor", N), ("name", None), ("process_set", PS)],
    "allgather_async": [("tensor", N), ("name", None), ("process_set", PS)],
    "grouped_allgather": [("tensors", N), ("name", None), ("process_set", PS)],
    "grouped_allgather_async": [("tensors", N), ("name", None), ("process_set", PS)],
    "broadcast": [("tensor", N), ("root_rank", N), ("name", None), ("process_set", PS)],
    "broadcast_async": [("tensor", N), ("root_rank", N), ("name", None), ("process_set", PS)],
    "broadcast_": [("tensor", N), ("root_rank", N), ("name", None), ("process_set", PS)],
    "broadcast_async_": [("tensor", N), ("root_rank", N), ("name", None), ("process_set", PS)],
    "alltoall": [("tensor", N), ("splits", None), ("name", None), ("process_set", PS)],
    "alltoall_async": [("tensor", N), ("splits", None), ("name", None), ("process_set", PS)],
    "reducescatter": [("tensor", N), ("name", None), ("compression", NONE), *RS],
    "reducescatter_async": [("tensor", N), ("name", None), *RS],
    "grouped_reducescatter": [("tensors", N), ("name", None), ("compression", NONE), *RS],
    "grouped_reducescatter_async": [("tensors", N), ("name", None), *RS],
    "poll": [("handle", N)],
    "synchronize": [("handle", N)],
    "join": [("device", -1)],
    "barrier": [("process_set", PS)],
    "init": [("comm", None), ("process_sets", None)],
    "start_timeline": [("file_path", N), ("mark_cycles", False)],
    "DistributedOptimizer": [
        ("optimizer", N), ("named_parameters", None), ("compression", NONE), ("backward_passes_per_step", 1),
        ("op", hvd.Average), ("gradient_predivide_factor", 1.0), ("num_groups", 0), ("groups", None),
        ("sparse_as_dense", False), ("process_set", PS),
    ],
    # hora adds a trailing process_set to these four (after Horovod's parameters).
    "broadcast_parameters": [("params", N), ("root_rank", N)],
    "broadcast_optimizer_state": [("optimizer", N), ("root_rank", N), ("model", None)],
    "broadcast_object": [("obj", N), ("root_rank", 0), ("name", None), ("process_set", PS)],
    "allgather_object": [("obj", N), ("name", None)],
}
EXTRA_TRAILING = {"broadcast_parameters", "broadcast_optimizer_state", "allgather_object"}


@pytest.mark.parametrize("name", sorted(HOROVOD))
def test_signatures_match_horovod(name):
    params = list(inspect.signature(getattr(hvd, name)).parameters.values())
    want = HOROVOD[name]
    got = [(p.name, p.default) for p in params[: len(want)]]
    assert [g[0] for g in got] == [w[0] for w in want]
    for (pname, default), (_, expected) in zip(got, want):
        assert default is expected or default == expected, f"{name}({pname}=...): {default!r} != {expected!r}"
    extra = params[len(want) :]
    if name == "DistributedOptimizer":  # hora's keyword-only addition (docs/sharding.md)
        assert [(p.name, p.kind, p.default) for p in extra] == [("shard_optimizer_state", inspect.Parameter.KEYWORD_ONLY, False)]
        return
    assert not extra or (name in EXTRA_TRAILING and [p.name for p in extra] == ["process_set"])


def test_sync_batch_norm_signature():
    params = inspect.signature(hvd.SyncBatchNorm.__init__).parameters
    assert [(p.name, p.default) for p in list(params.values())[1:6]] == [
        ("num_features", N), ("eps", 1e-5), ("momentum", 0.1), ("affine", True), ("track_running_stats", True)
    ]


def test_exports():
    assert not hasattr(hvd, "is_homogeneous") and not hasattr(hvd, "gpu_available")  # as in Horovod: mpi_ops
    assert callable(hvd.mpi_ops.is_homogeneous)
    # The framework's own answer; False for a framework without a check or not installed.
    assert hvd.mpi_ops.gpu_available("torch") is torch.cuda.is_available()
    assert hvd.mpi_ops.gpu_available("mxnet") is False and hvd.mpi_ops.gpu_available("no_such_framework") is False
    assert callable(hvd.elastic.run) and hvd.elastic.TorchState and hvd.elastic.ElasticSampler  # as in Horovod
    for name in ["init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank", "local_rank",
                 "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
                 "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
                 "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "HorovodInternalError",
                 "HoraInternalError", "Compression", "SyncBatchNorm", "DistributedOptimizer"]:  # fmt: skip
        assert hasattr(hvd, name), name
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert hvd.HorovodInternalError is hvd.HoraInternalError and issubclass(hvd.HoraInternalError, RuntimeError)
    assert set(hvd.__all__) <= set(dir(hvd))
    assert hvd.Compression.fp16.compress(torch.ones(2))[0].dtype == torch.float16



def test_before_init_raises(fresh):
    with pytest.raises(ValueError, match=r"hora has not been initialized; use hvd.init\(\)"):
        hvd.allreduce(torch.ones(2))
    with pytest.raises(ValueError, match=r"hora has not been initialized"):
        hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))


def test_one_process(fresh, tmp_path):
    hvd.init()
    assert (hvd.rank(), hvd.size()) == (0, 1)
    t = torch.arange(6.0).reshape(2, 3)
    pointer = t.data_ptr()
    assert hvd.allreduce_(t, None, "x", hvd.Sum) is t and t.data_ptr() == pointer
    x = torch.ones(3, requires_grad=True)
    (hvd.allreduce(x) * 2).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]
    timeline = tmp_path / "timeline.json"
    hvd.start_timeline(str(timeline))
    hvd.allreduce(torch.ones(2), name="traced")
    hvd.stop_timeline()
    assert "allreduce.traced" in timeline.read_text()
    assert hvd.join() == 0
    # At size 1 DistributedOptimizer steps like the optimizer it wraps.
    model = torch.nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    before = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert torch.allclose(model.weight, before - 0.5)
    assert repr(opt).startswith("DistributedOptimizer(SGD (")
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(opt)
    # hvd.Adasum at size 1 is the plain optimizer too.
    assert type(hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)).__name__ == "_DistributedOptimizer"


def test_cpu_tensors_are_viewed_not_copied():
    for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.int8, torch.float16):
        t = torch.zeros(4, 3, dtype=dtype)
        staged = tt.stage(t, writable=True, what="test")
        assert staged.host.data_ptr() == t.data_ptr() and not staged.staged
        assert staged.wire.data.ctypes.data == t.data_ptr()
        assert staged.wire.shape == (4, 3)
    bf = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    view = tt.numpy_view(bf)
    assert view.dtype == np.uint16 and tt.from_numpy(view.copy(), torch.bfloat16).tolist() == [1.5, -2.0]
    # Out of place, a non-contiguous tensor is copied; in place it is refused.
    strided = torch.zeros(4, 4)[:, 1]
    assert tt.stage(strided, writable=False, what="test").host.is_contiguous()
    with pytest.raises(ValueError, match=r"^Tensor is required to be contiguous\.$"):
        tt.stage(strided, writable=True, what="test")
    # A lazily negated view is resolved out of place and refused in place.
    negated = torch.ones(3)._neg_view()
    assert tt.stage(negated, writable=False, what="test").host.tolist() == [-1.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="lazy negation"):
        tt.stage(negated, writable=True, what="test")


def test_the_negation_bit_is_read_as_is_neg_reads_it():
    # Read holding the GIL (torch's dispatch keys), or with is_neg where a torch lacks them.
    negated = torch.ones(3)._neg_view()
    tensors = [
        torch.ones(3),
        negated,
        negated.detach(),
        negated.data,
        torch.zeros(2, dtype=torch.complex64).conj().imag,
        torch.zeros(2, dtype=torch.complex64).conj().real,
        negated.resolve_neg(),
    ]
    assert [tt._is_neg(t) for t in tensors] == [t.is_neg() for t in tensors] == [
        False, True, True, True, True, False, False
    ]  # fmt: skip
    assert tt._is_neg is not torch.Tensor.is_neg  # this torch has the keys


def test_unsupported_dtypes_name_the_type():
    with pytest.raises(ValueError, match=r"^Tensor type torch\.ComplexFloatTensor is not supported\. hora moves"):
        tt.stage(torch.zeros(2, dtype=torch.complex64), writable=False, what="test")
    for dtype in (torch.uint16, torch.uint64, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="is not supported"):
            tt.wire_type(torch.zeros(1, dtype=dtype))


def test_wrapped_optimizer_warnings_free_with_schedulers(fresh):
    hvd.init()
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schedulers = [
            torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=5),
            torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0),
        ]
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        for _ in range(3):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            opt.zero_grad()
            for scheduler in schedulers:
                scheduler.step()
            plateau.step(1.0)
    assert opt.param_groups[0]["lr"] == opt.optimizer.param_groups[0]["lr"]
