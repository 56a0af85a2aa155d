"""The API in one process: before init, size 1 without a launcher, queries, fork."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

import hora
import hora.numpy as hvd



@pytest.mark.parametrize(
    "call",
    [hvd.rank, hvd.size, hvd.local_rank, hvd.local_size, hvd.cross_rank, hvd.cross_size,
     lambda: hvd.allreduce(np.ones(2)), lambda: hvd.barrier(), lambda: hvd.synchronize(1)],
)
def test_before_init_everything_raises_a_clear_value_error(fresh, call):
    with pytest.raises(ValueError, match=r"hora has not been initialized; use hvd.init\(\)"):
        call()


def test_size_one_without_a_launcher(fresh):
    assert not hvd.is_initialized()
    hvd.init()
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) == (0, 1, 0, 1, 0, 1)
    assert hvd.is_homogeneous()
    assert hvd.nccl_built() == 0 and isinstance(hvd.nccl_built(), int)
    assert not any(f() for f in (hvd.mpi_enabled, hvd.cuda_built, hvd.rocm_built, hvd.ddl_built, hvd.ccl_built))
    # hora's own transport is the counterpart of Horovod's Gloo; MPI needs mpi4py, and carries
    # no data here, so (as in Horovod) asking whether it supports threads is an error
    assert hvd.gloo_built() and hvd.gloo_enabled()
    assert hvd.mpi_built() == (importlib.util.find_spec("mpi4py") is not None)
    with pytest.raises(ValueError, match="MPI is not enabled"):
        hvd.mpi_threads_supported()
    assert hvd.allreduce(np.arange(3.0)).tolist() == [0.0, 1.0, 2.0]
    handle = hvd.allgather_async(np.arange(3))
    assert isinstance(handle, int)
    assert hvd.synchronize(handle).tolist() == [0, 1, 2]
    assert hvd.synchronize(handle) is None  # an unknown handle, as in Horovod
    assert hvd.join() == 0
    assert hvd.global_process_set.size() == 1 and hvd.global_process_set.rank() == 0
    assert hora.__version__


def test_size_one_reduces_buffers_past_the_ring_pipeline_threshold(fresh):
    # A buffer above the pipelined ring's threshold once took the ring path in a set of one,
    # which has no ring links (KeyError in the engine).
    hvd.init()
    big = np.arange(2_000_000, dtype=np.float32)
    assert np.array_equal(hvd.allreduce(big, op=hvd.Sum), big)
    assert [a.size for a in hvd.grouped_allreduce([big, big[:900_000]])] == [2_000_000, 900_000]


def test_fp16_compression_round_trip(fresh):
    hvd.init()
    x = np.linspace(0, 1, 5, dtype=np.float32)
    out = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert out.dtype == np.float32 and np.allclose(out, x, atol=1e-3)
    ints = np.arange(4)
    assert hvd.allreduce(ints, compression=hvd.Compression.fp16, op=hvd.Sum).dtype == ints.dtype


@pytest.mark.ranks
def test_a_forked_child_gets_a_clear_error(fresh):
    hvd.init()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            hvd.allreduce(np.ones(1))
            message = b"no error"
        except RuntimeError as exc:
            message = str(exc).encode()
        os.write(write, message[:500])
        os._exit(0)
    os.close(write)
    message = os.read(read, 1000).decode()
    os.waitpid(pid, 0)
    assert "is a fork of it" in message and "Call hvd.init() in the child" in message
    assert hvd.allreduce(np.ones(1)).tolist() == [1.0]  # the parent is unaffected


def test_dynamic_mode_is_required_to_add_sets(fresh):
    hvd.init()
    with pytest.raises(ValueError, match="HORA_DYNAMIC_PROCESS_SETS=1"):
        hvd.add_process_set([0])


def test_a_duplicate_set_raises_and_hora_stays_initialized_as_horovod(fresh):
    again = hvd.ProcessSet([0])  # the global set's ranks
    with pytest.raises(ValueError, match=r"process_sets entry number 0 is a duplicate: ProcessSet\(process_set_id=None"):
        hvd.init(process_sets=[again])
    assert hvd.is_initialized() and again.process_set_id is None
    assert hvd.allreduce(np.ones(1), name="still").tolist() == [1.0]
    with pytest.raises(ValueError, match="expected a list of rank integers or an mpi4py.MPI.Comm object"):
        hvd.init(comm=42)
    with pytest.raises(ValueError, match="a list of process ranks or an mpi4py Comm object; got float"):
        hvd.ProcessSet(1.5)


@pytest.mark.parametrize("setting, seconds", [(None, 300e-6), ("0", 0.0), ("50", 50e-6)])
def test_the_spin_after_work_is_the_machines_choice_unless_hora_spin_us_sets_it(fresh, monkeypatch, setting, seconds):
    from hora.core.api import current

    if setting is not None:
        monkeypatch.setenv("HORA_SPIN_US", setting)
    hvd.init()
    # One rank and at least one CPU: the machine's rule spins 300 us (engine.waiting.spin_after_work).
    assert current().engine._sleeper.spin.seconds == pytest.approx(seconds)
    assert hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() == [1.0, 1.0]
