"""The libraries ``hora-bench`` measures, behind one small interface (``Backend``).

Like ``worker``, this file imports only the standard library and NumPy at module level
(it also runs in peers' interpreters, where hora may not be installed); each backend
imports its framework when it is built. Every backend runs allreduce and broadcast in
place, with a fixed tensor name where the library negotiates by name (hora, Horovod), so
a response cache can work as it would in training.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np


class Unsupported(Exception):
    """A backend cannot run this collective with these parameters (the same on every rank)."""


class Case:
    """One collective at one size on one backend: ``fill`` the input, ``run`` it, read ``output``."""

    def __init__(self, fill: Callable[[float], None], run: Callable[[], None], output: Callable[[], np.ndarray]) -> None:
        self.fill = fill
        self.run = run
        self.output = output


# ----- backends -----


class Backend:
    """What the loop needs from a library: rank, size, barrier, a max over ranks, cases."""

    name = ""
    version = ""
    rank = 0
    size = 1

    def barrier(self) -> None:
        raise NotImplementedError

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def case(self, collective: str, per_rank: int, dtype: str, op: str, root: int) -> Case:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


def _numpy_dtype(dtype: str) -> Any:
    if dtype == "bfloat16":
        try:
            return importlib.import_module("ml_dtypes").bfloat16
        except ImportError:
            raise Unsupported("bfloat16 arrays need ml_dtypes (pip install ml_dtypes)") from None
    return np.dtype(dtype)


def _horovod_call(hvd: Any, collective: str, buf: Any, red: Any, root: int, name: str, out: list[Any]) -> Callable[[], Any]:
    """One collective through Horovod's API (hora's or Horovod's own); results land in ``out[0]``."""
    calls: dict[str, Callable[[], Any]] = {
        "allreduce": lambda: hvd.allreduce_(buf, op=red, name=name),
        "broadcast": lambda: hvd.broadcast_(buf, root, name=name),
        "allgather": lambda: out.__setitem__(0, hvd.allgather(buf, name=name)),
        "alltoall": lambda: out.__setitem__(0, hvd.alltoall(buf, name=name)),
        "reducescatter": lambda: out.__setitem__(0, hvd.reducescatter(buf, name=name, op=red)),
    }
    return calls[collective]


class HoraBackend(Backend):
    def __init__(self) -> None:
        import hora
        import hora.numpy as hvd

        hvd.init()
        self.hvd = hvd
        self.name, self.version = "hora", hora.__version__
        self.rank, self.size = hvd.rank(), hvd.size()
        self.ops = {"sum": hvd.Sum, "avg": hvd.Average, "min": hvd.Min, "max": hvd.Max, "prod": hvd.Product}

    def barrier(self) -> None:
        self.hvd.barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(self.hvd.allreduce(values, op=self.hvd.Max, name="bench.times"))

    def case(self, collective: str, per_rank: int, dtype: str, op: str, root: int) -> Case:
        if collective == "reducescatter" and op not in ("sum", "avg"):
            raise Unsupported(f"hora's reducescatter has no '{op}' reduction (only sum and avg, as Horovod's)")
        buf = np.zeros(per_rank, dtype=_numpy_dtype(dtype))
        out: list[np.ndarray] = [buf]
        call = _horovod_call(self.hvd, collective, buf, self.ops[op], root, f"bench.{collective}.{buf.nbytes}", out)
        return Case(lambda v: buf.fill(v), call, lambda: np.asarray(out[0], dtype=np.float64))

    def shutdown(self) -> None:
        self.hvd.shutdown()


class _TorchTensors:
    """Shared by the torch and Horovod backends: tensors of a dtype, read back as float64."""

    def __init__(self) -> None:
        self.torch: Any = importlib.import_module("torch")
        self.torch.set_num_threads(1)

    def zeros(self, count: int, dtype: str) -> Any:
        return self.torch.zeros(count, dtype=getattr(self.torch, dtype))

    def numpy(self, tensor: Any) -> np.ndarray:
        return np.asarray(tensor.double().numpy())


class TorchBackend(Backend):
    def __init__(self) -> None:
        self.t = _TorchTensors()
        self.dist: Any = importlib.import_module("torch.distributed")
        self.dist.init_process_group("gloo")
        self.name, self.version = "torch-gloo", str(self.t.torch.__version__)
        self.rank, self.size = self.dist.get_rank(), self.dist.get_world_size()
        r = self.dist.ReduceOp
        self.ops = {"sum": r.SUM, "avg": r.AVG, "min": r.MIN, "max": r.MAX, "prod": r.PRODUCT}

    def barrier(self) -> None:
        self.dist.barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        tensor = self.t.torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        self.dist.all_reduce(tensor, op=self.dist.ReduceOp.MAX)
        return np.asarray(tensor.numpy())

    def case(self, collective: str, per_rank: int, dtype: str, op: str, root: int) -> Case:
        dist, red, n = self.dist, self.ops[op], self.size
        buf = self.t.zeros(per_rank, dtype)
        out = {
            "allreduce": buf,
            "broadcast": buf,
            "allgather": self.t.zeros(per_rank * n, dtype),
            "alltoall": self.t.zeros(per_rank, dtype),
            "reducescatter": self.t.zeros(per_rank // n, dtype),
        }[collective]
        # torch >= 2.12 names them *_single and deprecates the *_tensor spellings.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        calls: dict[str, Callable[[], Any]] = {
            "allreduce": lambda: dist.all_reduce(buf, op=red),
            "broadcast": lambda: dist.broadcast(buf, src=root),
            "allgather": lambda: gather(out, buf),
            "alltoall": lambda: dist.all_to_all_single(out, buf),
            "reducescatter": lambda: scatter(out, buf, op=red),
        }
        call = calls[collective]
        return Case(lambda v: buf.fill_(v), lambda: call(), lambda: self.t.numpy(out))

    def shutdown(self) -> None:
        self.dist.destroy_process_group()


class MpiBackend(Backend):
    def __init__(self) -> None:
        mpi4py: Any = importlib.import_module("mpi4py")
        self.MPI: Any = importlib.import_module("mpi4py.MPI")
        self.comm = self.MPI.COMM_WORLD
        library = str(self.MPI.Get_library_version()).split(",")[0].strip()
        self.name, self.version = "mpi4py", f"mpi4py {mpi4py.__version__}, {library}"
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        m = self.MPI
        self.ops = {"sum": m.SUM, "min": m.MIN, "max": m.MAX, "prod": m.PROD}

    def barrier(self) -> None:
        self.comm.Barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        send = np.ascontiguousarray(values, dtype=np.float64)
        result = np.empty_like(send)
        self.comm.Allreduce(send, result, op=self.MPI.MAX)
        return result

    def case(self, collective: str, per_rank: int, dtype: str, op: str, root: int) -> Case:
        if dtype in ("float16", "bfloat16"):
            raise Unsupported(f"MPI has no {dtype} datatype")
        if collective in ("allreduce", "reducescatter") and op not in self.ops:
            raise Unsupported(f"MPI has no '{op}' reduction")
        comm, m, n = self.comm, self.MPI, self.size
        red = self.ops.get(op)
        buf = np.zeros(per_rank, dtype=dtype)
        out = {
            "allreduce": buf,
            "broadcast": buf,
            "allgather": np.zeros(per_rank * n, dtype=dtype),
            "alltoall": np.zeros(per_rank, dtype=dtype),
            "reducescatter": np.zeros(per_rank // n, dtype=dtype),
        }[collective]
        calls: dict[str, Callable[[], Any]] = {
            "allreduce": lambda: comm.Allreduce(m.IN_PLACE, buf, op=red),
            "broadcast": lambda: comm.Bcast(buf, root=root),
            "allgather": lambda: comm.Allgather(buf, out),
            "alltoall": lambda: comm.Alltoall(buf, out),
            "reducescatter": lambda: comm.Reduce_scatter_block(buf, out, op=red),
        }
        call = calls[collective]
        return Case(lambda v: buf.fill(v), lambda: call(), lambda: np.asarray(out, dtype=np.float64))


class HorovodBackend(Backend):
    def __init__(self) -> None:
        self.t = _TorchTensors()
        horovod: Any = importlib.import_module("horovod")
        self.hvd: Any = importlib.import_module("horovod.torch")
        self.hvd.init()
        transport = "mpi" if self.hvd.mpi_enabled() else "gloo"
        self.name, self.version = f"horovod-{transport}", f"horovod {horovod.__version__} ({transport})"
        self.rank, self.size = self.hvd.rank(), self.hvd.size()
        h = self.hvd
        self.ops = {"sum": h.Sum, "avg": h.Average, "min": h.Min, "max": h.Max, "prod": h.Product}

    def barrier(self) -> None:
        self.hvd.barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        tensor = self.t.torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        return np.asarray(self.hvd.allreduce(tensor, op=self.hvd.Max, name="bench.times").numpy())

    def case(self, collective: str, per_rank: int, dtype: str, op: str, root: int) -> Case:
        if collective == "reducescatter" and op not in ("sum", "avg"):
            raise Unsupported(f"Horovod's reducescatter has no '{op}' reduction (only sum and avg)")
        buf = self.t.zeros(per_rank, dtype)
        out: list[Any] = [buf]
        call = _horovod_call(self.hvd, collective, buf, self.ops[op], root, f"bench.{collective}.{per_rank}", out)
        return Case(lambda v: buf.fill_(v), call, lambda: self.t.numpy(out[0]))

    def shutdown(self) -> None:
        self.hvd.shutdown()


def make_backend(kind: str) -> Backend:
    """Builds and initialises the backend ``kind``: ``hora``, ``torch``, ``mpi`` or ``horovod``."""
    factories: dict[str, Callable[[], Backend]] = {
        "hora": HoraBackend,
        "torch": TorchBackend,
        "mpi": MpiBackend,
        "horovod": HorovodBackend,
    }
    return factories[kind]()
