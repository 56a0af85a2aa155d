"""Horovod's TensorFlow data service API: the config, the dispatcher context and the workers.

A compute job (``hora.tensorflow.data.compute_worker``) provides ``dispatchers`` tf.data
dispatchers, each served by ``workers_per_dispatcher`` tf.data workers, and writes a
``TfDataServiceConfig`` (the compute service's addresses and key) to a file that the
training job reads. Dispatchers run on the compute side (default) or, with
``dispatcher_side="training"``, inside the training ranks (``tf_data_service``).

Where hora differs from Horovod 0.28.1, on purpose: TensorFlow names its servers
``localhost`` (a dispatcher's target is ``grpc://localhost:<port>``, a worker registers as
``localhost:<port>``), which other hosts cannot reach; hora advertises both at the address
the host uses to reach the compute service, so a compute job and a training job on
different hosts work. On one host the two are the same. Importing this module adds
``send_to_data_service`` to ``tf.data.Dataset``, as Horovod's does.
"""

from __future__ import annotations

import binascii
import dataclasses
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import tensorflow as tf  # type: ignore[import-untyped]

import hora.tensorflow as hvd
from hora.core.compute_service import ComputeClient

log = logging.getLogger(__name__)

_WAIT_LOG_SECONDS = 30.0  # how often read(wait_for_file_creation=True) says it still waits
_CONNECT_SECONDS = 10.0  # the longest a training rank tries to reach its dispatcher


@dataclasses.dataclass(frozen=True)
class TfDataServiceConfig:
    """Where a training job finds a compute job's data service.

    Attributes:
        dispatchers: how many dispatchers (1, or one per training rank).
        workers_per_dispatcher: how many tf.data workers serve each dispatcher.
        dispatcher_side: ``"compute"`` or ``"training"``: who runs the dispatchers.
        addresses: the compute service's addresses, ``{interface: [(address, port)]}``.
        key: the compute service's key.
        timeout: seconds to wait for dispatchers and workers to register.
    """

    dispatchers: int
    workers_per_dispatcher: int
    dispatcher_side: str
    addresses: Mapping[str, Sequence[tuple[str, int]]]
    key: bytes
    timeout: int = 60

    def compute_client(self, verbose: int = 1) -> ComputeClient:
        """A client of the compute service (``ConnectionError`` when it cannot be reached)."""
        return ComputeClient(self.addresses, self.key, verbose=verbose)

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-compatible values: the key in hex."""
        config = dict(self.__dict__)
        config["key"] = binascii.hexlify(self.key).decode()
        return config

    @staticmethod
    def from_dict(config: Mapping[str, Any]) -> TfDataServiceConfig:
        """The config of ``to_dict``'s values."""
        return TfDataServiceConfig(
            dispatchers=config["dispatchers"],
            workers_per_dispatcher=config["workers_per_dispatcher"],
            dispatcher_side=config["dispatcher_side"],
            addresses={
                iface: [(str(address[0]), int(address[1])) for address in entries]
                for iface, entries in config["addresses"].items()
            },
            key=binascii.unhexlify(config["key"]),
            timeout=config.get("timeout", 60),
        )

    def write(self, filename: str) -> None:
        """Writes the config to ``filename`` at once: into a temporary file beside it, then renamed."""
        path = Path(filename)
        with tempfile.NamedTemporaryFile("w", dir=str(path.parent), prefix=path.name, delete=False) as file:
            json.dump(self.to_dict(), file)
        os.rename(file.name, filename)
        log.info("wrote the data service config to %s", filename)

    @staticmethod
    def read(filename: str, wait_for_file_creation: bool = False) -> TfDataServiceConfig:
        """Reads a config ``write`` wrote, waiting for the file when asked to (and saying so
        every 30 s: the compute job writes it once its service runs)."""
        since = last_said = time.monotonic()
        while wait_for_file_creation and not os.path.exists(filename):
            if time.monotonic() - last_said >= _WAIT_LOG_SECONDS:
                last_said = time.monotonic()
                log.warning("still waiting for %s after %.0f s: is the compute job running?", filename, last_said - since)
            time.sleep(0.2)
        with open(filename) as file:
            return TfDataServiceConfig.from_dict(json.load(file))


def _reachable(target: str, host: str) -> str:
    """``target`` (``grpc://localhost:<port>`` or ``localhost:<port>``) at ``host`` instead."""
    return target.replace("localhost", host, 1)


def _check_reachable(dispatcher_id: int, address: str, timeout: float) -> None:
    """Raises ``ConnectionError`` when nothing accepts connections at the dispatcher's
    ``address`` (``grpc://host:port``): TensorFlow's client would retry for ever."""
    host, _, port = address.split("://")[-1].rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError) as exc:
        raise ConnectionError(
            f"dispatcher {dispatcher_id} at {address} cannot be reached from this host: {exc}"
        ) from exc


def _start_dispatcher(compute: ComputeClient, dispatcher_id: int, host: str) -> Any:
    """Starts a tf.data dispatcher and registers it, at ``host``, as ``dispatcher_id``."""
    server = tf.data.experimental.service.DispatchServer()
    try:
        address = _reachable(server.target, host)
        compute.register_dispatcher(dispatcher_id, address)
    except BaseException:
        _stop(server, "dispatcher")
        raise
    log.info("registered dispatcher %d at %s", dispatcher_id, address)
    return server


def _stop(server: Any, what: str) -> None:
    # TensorFlow offers no public way to stop its data service servers.
    server._stop()
    server.join()
    log.info("%s shut down", what)


@contextmanager
def tf_data_service(compute_config: TfDataServiceConfig, rank: int) -> Iterator[str]:
    """Yields the address of the dispatcher that serves training rank ``rank``.

    With ``dispatcher_side="training"`` the training ranks run the dispatchers (rank 0 the
    only one, or every rank its own) for as long as the block runs. Before yielding, waits
    until the dispatcher and all its workers registered.

    Raises:
        TimeoutError: they did not register within ``compute_config.timeout`` seconds.
        ConnectionError: the compute service, or the dispatcher, cannot be reached from
            this host (TensorFlow's client would wait for an unreachable dispatcher for ever).
    """
    compute = compute_config.compute_client(verbose=2)
    dispatcher_server = None
    dispatcher_id = rank if compute_config.dispatchers > 1 else 0
    try:
        if compute_config.dispatcher_side == "training" and (compute_config.dispatchers > 1 or rank == 0):
            dispatcher_server = _start_dispatcher(compute, rank, compute.local_address())
        dispatcher_address = compute.wait_for_dispatcher_registration(dispatcher_id, compute_config.timeout)
        compute.wait_for_dispatcher_worker_registration(dispatcher_id, compute_config.timeout)
        _check_reachable(dispatcher_id, dispatcher_address, min(compute_config.timeout, _CONNECT_SECONDS))
        yield dispatcher_address
    finally:
        if dispatcher_server is not None:
            _stop_workers(compute, dispatcher_id, compute_config.timeout)
            _stop(dispatcher_server, "dispatcher")


def _stop_workers(compute: ComputeClient, dispatcher_id: int, timeout: float) -> None:
    """Stops the compute job's workers of a training-side dispatcher before the dispatcher
    stops (see ``ComputeClient.stop_dispatcher_workers``); says so when they do not stop,
    and the dispatcher stops anyway: the training job has finished with it."""
    try:
        compute.stop_dispatcher_workers(dispatcher_id, timeout)
    except (TimeoutError, ConnectionError) as exc:
        log.warning("stopping dispatcher %d with its workers still running: %s", dispatcher_id, exc)


def send_to_data_service(
    dataset: tf.data.Dataset,
    compute_config: TfDataServiceConfig,
    rank: int,
    size: int | None = None,
    processing_mode: str = "distributed_epoch",
    reuse_dataset: bool = False,
    round_robin: bool = False,
) -> tf.data.Dataset:
    """``dataset`` processed by the compute job's data service: what was applied to it so far
    runs on the workers of rank ``rank``'s dispatcher (``tf.data.experimental.service.distribute``).

    Args:
        dataset: the pipeline to move.
        compute_config: the compute job's config.
        rank: this training rank.
        size: the training job's size (for ``round_robin``).
        processing_mode: tf.data's processing mode.
        reuse_dataset: one dispatcher: the training ranks share one job of it (first come,
            first served), instead of each reading the whole dataset.
        round_robin: with ``reuse_dataset``: the ranks take the elements in turn.

    Raises:
        RuntimeError: the dispatchers run on the training side (use ``tf_data_service``).
        TimeoutError, ConnectionError: as ``tf_data_service``.
    """
    if compute_config.dispatcher_side == "training":
        raise RuntimeError("training side dispatcher not supported, use tf_data_service context manager instead")
    with tf_data_service(compute_config, rank) as dispatcher_address:
        return dataset.apply(
            tf.data.experimental.service.distribute(
                processing_mode=processing_mode,
                service=dispatcher_address,
                job_name="job" if reuse_dataset else None,
                consumer_index=rank if reuse_dataset and round_robin else None,
                num_consumers=size if reuse_dataset and round_robin else None,
            )
        )


tf.data.Dataset.send_to_data_service = send_to_data_service


def compute_worker_fn(compute_config: TfDataServiceConfig) -> None:
    """Runs this rank's part of the compute job until the training job asks it to shut down.

    Rank ``r`` runs a tf.data worker for dispatcher ``r // workers_per_dispatcher``; with
    compute-side dispatchers the first rank of each group also runs that dispatcher. The
    worker stops when its dispatcher is about to (a training-side dispatcher whose training
    ranks are done) or at shutdown; dispatchers stop once every worker has.

    Raises:
        TimeoutError: its dispatcher did not register within ``compute_config.timeout`` seconds.
        ConnectionError: the compute service cannot be reached.
    """
    hvd.init()
    index = hvd.rank()
    per_dispatcher = compute_config.workers_per_dispatcher
    dispatcher_index = index // per_dispatcher
    compute = compute_config.compute_client(verbose=2)
    host = compute.local_address()

    dispatcher_server = None
    try:
        if compute_config.dispatcher_side == "compute" and index % per_dispatcher == 0:
            dispatcher_server = _start_dispatcher(compute, dispatcher_index, host)
        dispatcher_address = compute.wait_for_dispatcher_registration(dispatcher_index, compute_config.timeout)
        worker_config = tf.data.experimental.service.WorkerConfig(
            dispatcher_address=dispatcher_address.split("://")[1],
            worker_address=f"{host}:%port%",
            heartbeat_interval_ms=1000,
            dispatcher_timeout_ms=compute_config.timeout * 1000,
        )
        worker_server = tf.data.experimental.service.WorkerServer(worker_config)
        worker_server.start()
        asked = False
        try:
            compute.register_worker_for_dispatcher(dispatcher_index, index)
            log.info("worker %d registered for dispatcher %d", index, dispatcher_index)
            asked = compute.wait_for_worker_stop(dispatcher_index)
        finally:
            _stop(worker_server, "worker")
        if asked:  # else the service has gone: each call would only wait to find that out
            compute.worker_stopped(dispatcher_index, index)
            compute.wait_for_shutdown()
        hvd.barrier()  # a dispatcher outlives its workers: every worker stopped before any dispatcher stops
    finally:
        if dispatcher_server is not None:
            _stop(dispatcher_server, "dispatcher")
