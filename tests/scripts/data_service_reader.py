"""A training job that reads a few batches from a compute job's data service and then keeps
reading on a thread, as a Keras ``fit`` can leave an iterator prefetching until garbage
collection: its dispatchers stop (``tf_data_service`` ends) and rank 0 shuts the compute job
down while the compute job's workers are fetching for it.

Usage: data_service_reader.py CONFIG (horarun -np 2).
"""

import sys
import threading
import time
from collections.abc import Iterator

import tensorflow as tf

import hora.tensorflow as hvd
from hora.tensorflow.data.compute_service import TfDataServiceConfig, tf_data_service


def _read_on(iterator: Iterator[tf.Tensor]) -> None:
    try:
        for _ in iterator:
            pass
    except Exception:  # noqa: BLE001 -- the data service going away ends the reading
        pass


def _read(iterator: Iterator[tf.Tensor]) -> None:
    """Reads 20 batches, then goes on reading on a thread of its own."""
    for _ in range(20):
        next(iterator)
    threading.Thread(target=_read_on, args=(iterator,), daemon=True).start()
    time.sleep(1)


hvd.init()
config = TfDataServiceConfig.read(sys.argv[1], wait_for_file_creation=True)
dataset = tf.data.Dataset.range(1 << 40).shuffle(100).batch(32)
if config.dispatcher_side == "compute":
    _read(iter(dataset.send_to_data_service(config, hvd.rank(), hvd.size()).prefetch(8)))
else:
    with tf_data_service(config, hvd.rank()) as address:
        _read(iter(dataset.apply(tf.data.experimental.service.distribute("distributed_epoch", address)).prefetch(8)))
        hvd.barrier()
hvd.barrier()
if hvd.rank() == 0:
    config.compute_client().shutdown()
    print("shut the compute job down", flush=True)
hvd.shutdown()
