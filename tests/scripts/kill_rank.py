"""Rank 1 kills itself mid-allreduce; the others print the error they get and exit 1."""

import os
import signal
import sys
import time

import numpy as np

import hora.numpy as hvd

hvd.init()
x = np.ones(1 << 16, dtype=np.float32)
hvd.allreduce(x, name="warm-up")
if hvd.rank() == 1:
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    for i in range(100000):
        hvd.allreduce(x, name=f"step {i}")
except hvd.HoraInternalError as exc:
    print(f"HoraInternalError: {exc}")
    sys.exit(1)
