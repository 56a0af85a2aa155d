"""How an MXNet NDArray can reach hora's core: the cost of each way, one process.

The table of docs/mxnet.md ("How NDArrays are staged, measured"): for one float32 NDArray
(100 MB by default), the best time over ``--repeat`` runs of

* ``asnumpy``: MXNet's copy to a new NumPy array;
* ``setitem``: writing a NumPy array back with ``nd[:] = array`` (and waiting for it);
* ``dlpack``: ``to_dlpack_for_read`` into ``np.from_dlpack`` (zero-copy, read-only on NumPy 1.x);
* ``from_numpy``: ``mx.nd.from_numpy(array, zero_copy=True)`` (NumPy to NDArray, zero-copy);
* ``hora view``: what ``hora.mxnet`` uses, ``tensors.numpy_view`` (the engine wait, then a
  view of the NDArray's own memory; zero-copy both ways).

Run it with MXNet's environment, and report the machine beside the numbers:

    .venv-mxnet/bin/python benchmarks/mxnet_staging.py --mb 100
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import hora.mxnet  # noqa: F401  (first: restores the NumPy aliases mxnet reads)

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

from hora.mxnet import tensors  # noqa: E402


class _DLPack:
    """Hands MXNet's DLPack capsule to ``np.from_dlpack`` (which wants ``__dlpack__``)."""

    def __init__(self, capsule: object) -> None:
        self.capsule = capsule

    def __dlpack__(self, stream: object = None) -> object:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


def best(fn: Callable[[], object], repeat: int) -> float:
    """The best time of ``repeat`` calls, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=100, help="the NDArray's size in MB")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    count = args.mb * 1_000_000 // 4
    array = mx.nd.ones((count,), dtype="float32")
    array.wait_to_read()
    host = np.ones(count, dtype=np.float32)
    ways = {
        "asnumpy": lambda: array.asnumpy(),
        "setitem": lambda: (array.__setitem__(slice(None), host), array.wait_to_read()),
        "dlpack": lambda: np.from_dlpack(_DLPack(array.to_dlpack_for_read())),
        "from_numpy": lambda: mx.nd.from_numpy(np.empty(count, dtype=np.float32), zero_copy=True),
        "hora view": lambda: tensors.numpy_view(array, writable=True),
    }
    print(f"MXNet {mx.__version__}, NumPy {np.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; a {args.mb} MB float32 NDArray, best of {args.repeat}")  # fmt: skip
    for name, fn in ways.items():
        seconds = best(fn, args.repeat)
        print(f"  {name:<11} {seconds * 1e3:10.3f} ms")


if __name__ == "__main__":
    main()
