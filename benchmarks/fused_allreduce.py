"""Time fused allreduces: many tensors reduced as one group, as gradients are in training.

Run under horarun, e.g. ``horarun -np 2 python benchmarks/fused_allreduce.py``. Each case
allreduces ``count`` float32 tensors of ``size`` bytes as one group (one fused response)
in place, with Average (Horovod's default op), and rank 0 prints the median time of
``barrier; t0; grouped_allreduce_; t1`` over the timed repetitions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import hora.numpy as hvd

CASES = ((16, 4 << 20), (64, 1 << 20), (256, 64 << 10))  # (tensors, bytes each)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed repetitions per case")
    args = parser.parse_args()
    hvd.init()
    for count, nbytes in CASES:
        tensors = [np.ones(nbytes // 4, dtype=np.float32) for _ in range(count)]
        name = f"{count}x{nbytes}"
        for _ in range(2):  # warm up: caches, staging segments, page faults
            hvd.grouped_allreduce_(tensors, name=name)
        times = []
        for _ in range(args.repeats):
            hvd.barrier()
            start = time.perf_counter()
            hvd.grouped_allreduce_(tensors, name=name)
            times.append(time.perf_counter() - start)
        if hvd.rank() == 0:
            total = count * nbytes / 2**20
            print(f"{count:4d} x {nbytes >> 10:5d} KiB ({total:5.0f} MiB): median {statistics.median(times) * 1e3:7.2f} ms")
    hvd.shutdown()


if __name__ == "__main__":
    main()
