"""Time fused allreduces: many tensors reduced as one group, as gradients are in training.

Run under horarun, e.g. ``horarun -np 2 python benchmarks/fused_allreduce.py``. Each case
allreduces ``count`` float32 tensors of ``size`` bytes as one group (one fused response)
in place, with Average (Horovod's default op), and rank 0 prints the median time of
``barrier; t0; grouped_allreduce_; t1`` over the timed repetitions. ``--cases 6x4,6x1M``
picks other cases: six 4-byte tensors show a group's fixed cost, six of 1 MiB the size of
a small model's gradients.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import hora.numpy as hvd
from hora.bench.plan import human_bytes, parse_size

CASES = ((16, 4 << 20), (64, 1 << 20), (256, 64 << 10))  # (tensors, bytes each)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed repetitions per case")
    parser.add_argument(
        "--cases", type=_cases, default=CASES, help="COUNTxBYTES,... e.g. 6x4,16x4M (default: %(default)s)"
    )
    args = parser.parse_args()
    hvd.init()
    for count, nbytes in args.cases:
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
            each = human_bytes(nbytes)
            print(f"{count:4d} x {each:>8} ({total:7.2f} MiB): median {statistics.median(times) * 1e3:7.3f} ms")
    hvd.shutdown()


def _cases(text: str) -> tuple[tuple[int, int], ...]:
    """Parses ``6x4,16x4M``: tensor counts and sizes (``hora-bench``'s size syntax)."""
    cases = []
    for case in text.split(","):
        count, size = case.lower().split("x")
        cases.append((int(count), parse_size(size)))
    return tuple(cases)


if __name__ == "__main__":
    main()
