"""Allreduces a 16 MiB tensor; prints the result and the kind of collectives the job runs.

Run by tests/test_collectives.py under horarun, in a mount namespace whose /dev/shm is
smaller than the ranks' segments.
"""

import numpy as np

import hora.numpy as hvd
from hora.core.api import current

hvd.init()
x = np.full(4 << 20, float(hvd.rank() + 1), np.float32)
hvd.allreduce_(x, op=hvd.Sum, name="x")
algorithm = current().engine.stats().algorithm
print(f"rank {hvd.rank()}: {float(x.min())} {float(x.max())} {algorithm}", flush=True)
hvd.shutdown()
