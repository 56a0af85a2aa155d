"""Times float32 sum-allreduce per message size, the way docs/../peers.md measured the peers.

Each iteration is ``barrier; t0; allreduce; t1``; a size's time is the median over
iterations of the slowest rank. Also reports the CPU time a rank burns while blocked
in ``synchronize`` waiting for a late peer.

    horarun -np 2 python benchmarks/allreduce_sizes.py
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

import hora.numpy as hvd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4,4096,65536,1048576,16777216,67108864,268435456", help="bytes")
    parser.add_argument("--iters", type=int, default=0, help="iterations per size (0: automatic)")
    args = parser.parse_args()
    hvd.init()
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        buffer = np.zeros(max(1, nbytes // 4), dtype=np.float32)  # zeros: repeated sums never overflow
        iters = args.iters or max(5, min(1000, (64 << 20) // max(nbytes, 1)))
        for _ in range(3):
            hvd.allreduce_(buffer, op=hvd.Sum, name="warm")
        times = []
        for _ in range(iters):
            hvd.barrier()
            start = time.perf_counter()
            hvd.allreduce_(buffer, op=hvd.Sum, name="timed")
            times.append(time.perf_counter() - start)
        slowest = hvd.allreduce(np.array(times), op=hvd.Max, name="times")
        median = float(np.median(slowest))
        rows.append((nbytes, median, iters))
    if hvd.rank() == 0:
        print(f"{'bytes':>10} {'time':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}  iters")
        n = hvd.size()
        for nbytes, median, iters in rows:
            algbw = nbytes / median / 1e9
            print(f"{nbytes:>10} {median * 1e6:>8.1f}us {algbw:>11.3f} {algbw * 2 * (n - 1) / n:>11.3f}  {iters}")
    # CPU burned while blocked: rank 0 waits 5 s for the last rank.
    handle = hvd.allreduce_async(np.ones(1), name="late")
    if hvd.rank() == hvd.size() - 1:
        time.sleep(5)
    before = resource.getrusage(resource.RUSAGE_SELF)
    hvd.synchronize(handle)
    after = resource.getrusage(resource.RUSAGE_SELF)
    if hvd.rank() == 0:
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        print(f"CPU time of rank 0 blocked 5 s in synchronize: {cpu * 1000:.1f} ms")
    hvd.shutdown()


if __name__ == "__main__":
    main()
