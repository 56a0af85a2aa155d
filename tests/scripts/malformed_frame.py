"""Rank 1 sends rank 0 a control frame of a kind that does not exist; every rank then fails."""

import struct

import numpy as np

import hora.numpy as hvd
from hora.core.api import current

hvd.init()
hvd.allreduce(np.ones(2), name="warm-up")
if hvd.rank() == 1:
    current().engine.control.links[0].sock.send(struct.pack("<IB", 3, 99) + b"bad")
hvd.allreduce(np.ones(2), name="after")  # raises HoraInternalError on every rank
