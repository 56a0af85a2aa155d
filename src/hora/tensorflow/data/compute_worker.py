"""A compute job: ``horarun -np N python -m hora.tensorflow.data.compute_worker CONFIG``.

Starts TensorFlow's data service on ``N`` ranks (``--dispatchers`` dispatchers, each with
``N / dispatchers`` workers), runs the compute service on rank 0, writes its config to
``CONFIG`` (a path every training rank can read) and serves until the training job's rank
0 calls ``compute_config.compute_client().shutdown()``. Horovod's
``horovod.tensorflow.data.compute_worker``, with the same arguments.
"""

from __future__ import annotations

import argparse

import tensorflow as tf  # type: ignore[import-untyped]

import hora.tensorflow as hvd
from hora.core.compute_service import ComputeService, make_secret_key
from hora.tensorflow.data.compute_service import TfDataServiceConfig, compute_worker_fn


def main(dispatchers: int, dispatcher_side: str, configfile: str, timeout: int) -> None:
    """Runs this rank of the compute job.

    Raises:
        ValueError: the job's size is not a multiple of ``dispatchers``, or
            ``dispatcher_side`` is neither ``compute`` nor ``training``.
    """
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if dispatcher_side not in ("compute", "training"):
        raise ValueError(f"Unsupported dispatcher side: {dispatcher_side!r} (compute or training)")
    if dispatchers <= 0 or size % dispatchers:
        raise ValueError(f"Number of processes ({size}) must be a multiple of number of dispatchers ({dispatchers}).")
    workers_per_dispatcher = size // dispatchers

    compute = None
    try:
        compute_config = None
        if rank == 0:
            key = make_secret_key()
            compute = ComputeService(dispatchers, workers_per_dispatcher, key=key)
            compute_config = TfDataServiceConfig(
                dispatchers=dispatchers,
                workers_per_dispatcher=workers_per_dispatcher,
                dispatcher_side=dispatcher_side,
                addresses=compute.addresses(),
                key=key,
                timeout=timeout,
            )
            compute_config.write(configfile)
        with tf.device("/cpu:0"):
            compute_config = hvd.broadcast_object(compute_config, name="TfDataServiceConfig")
        compute_worker_fn(compute_config)
    finally:
        if compute is not None:
            compute.shutdown()


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hora.tensorflow.data.compute_worker", description=__doc__)
    parser.add_argument("configfile", type=str, help="The path to store the compute service config file.")
    parser.add_argument("--dispatchers", default=1, type=int, help="The number of dispatchers to support.")
    parser.add_argument(
        "--dispatcher-side",
        default="compute",
        type=str,
        dest="dispatcher_side",
        help="Where do the dispatchers run? On 'compute' side or 'training' side.",
    )
    parser.add_argument("--timeout", default=60, type=int, help="Timeout to set up workers and connect everything.")
    return parser.parse_args()


if __name__ == "__main__":
    arguments = _arguments()
    main(arguments.dispatchers, arguments.dispatcher_side, arguments.configfile, arguments.timeout)
