"""The compute service: where a data-service job and a training job find each other.

Horovod's ``ComputeService``/``ComputeClient`` (``horovod.runner.common.service.
compute_service``), kept framework-free as Horovod keeps it; hora's TensorFlow data service
(``hora.tensorflow.data``) is its user. A *compute job* (``python -m
hora.tensorflow.data.compute_worker``) runs the service on its rank 0, and its ranks and
the ranks of a training job meet through it: dispatchers register their addresses, the
workers of each dispatcher register themselves, the training ranks wait for both, and the
training job's rank 0 finally asks the compute job to shut down.

The service is hora's rendezvous server (an authenticated key-value store whose waits
block on the server until keys exist; ``hora.transport.rendezvous``) with these keys:

* ``compute/layout``: ``"<dispatchers> <workers per dispatcher>"``, written at start;
* ``compute/dispatcher/<id>``: the dispatcher's address;
* ``compute/worker/<dispatcher id>/<slot>``: a worker registered for that dispatcher, in
  slot ``worker id % workers per dispatcher`` (Horovod counts distinct worker ids; the
  compute job's workers of one dispatcher have distinct slots, as their ids are
  consecutive);
* ``compute/stop/<dispatcher id>``: present once the workers of that dispatcher are to stop
  (its dispatcher is about to stop, or shutdown was requested);
* ``compute/stopped/<dispatcher id>/<slot>``: that worker has stopped;
* ``compute/shutdown``: present once shutdown was requested.

A dispatcher outlives its workers: whoever stops one first stops its workers
(``stop_dispatcher_workers``). A tf.data worker that is fetching splits from a dispatcher
that has gone retries for as long as its ``dispatcher_timeout_ms``, and stopping the worker
waits for that; a training job that ran the dispatchers and ended before the compute job
shut down left the compute ranks waiting so (three minutes measured at a 60 s timeout).

Every wait has a timeout and names what it waited for; a client whose service has gone
(its compute job ended or died) gets ``ConnectionError`` naming the address, except in
``wait_for_shutdown`` and ``wait_for_worker_stop``, which return once it has gone (the
latter saying so, so that a worker does not go on to wait for a service that is not there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from hora.transport import auth, netif
from hora.transport.rendezvous import MAX_WAIT, RendezvousClient, RendezvousTimeout
from hora.transport.rendezvous_server import RendezvousServer

log = logging.getLogger(__name__)

Addresses = Mapping[str, Sequence[tuple[str, int]]]  # interface name -> [(address, port)]

T = TypeVar("T")

_LAYOUT = "compute/layout"
_SHUTDOWN = "compute/shutdown"
_CONNECT_TIMEOUT = 10.0  # seconds to reach one of the service's addresses
_LAYOUT_TIMEOUT = 30.0  # the layout is written before the service's addresses are known


def make_secret_key() -> bytes:
    """A fresh random key for a ``ComputeService`` (Horovod's ``secret.make_secret_key``)."""
    return auth.new_secret()


def _dispatcher_key(dispatcher_id: int) -> str:
    return f"compute/dispatcher/{dispatcher_id}"


def _worker_key(dispatcher_id: int, slot: int) -> str:
    return f"compute/worker/{dispatcher_id}/{slot}"


def _stop_key(dispatcher_id: int) -> str:
    return f"compute/stop/{dispatcher_id}"


def _stopped_key(dispatcher_id: int, slot: int) -> str:
    return f"compute/stopped/{dispatcher_id}/{slot}"


class ComputeService:
    """Serves the compute service until ``shutdown``: on every interface, authenticated by ``key``.

    Args:
        dispatchers: how many dispatchers the compute job provides (> 0).
        workers_per_dispatcher: how many workers serve each dispatcher (> 0).
        key: the secret every client must hold (``make_secret_key()``).
        nics: the interfaces whose addresses ``addresses()`` lists; None for all.

    Raises:
        ValueError: ``dispatchers`` or ``workers_per_dispatcher`` is not positive.
    """

    NAME = "Compute service"

    def __init__(self, dispatchers: int, workers_per_dispatcher: int, key: bytes, nics: Sequence[str] | None = None):
        if dispatchers <= 0:
            raise ValueError(f"The number of dispatchers must be larger than 0: {dispatchers}")
        if workers_per_dispatcher <= 0:
            raise ValueError(f"The number of workers per dispatcher must be larger than 0: {workers_per_dispatcher}")
        self._nics = None if nics is None else set(nics)
        self._server = RendezvousServer(key, host="0.0.0.0").start()
        self._server.put(_LAYOUT, f"{dispatchers} {workers_per_dispatcher}".encode())

    def addresses(self) -> dict[str, list[tuple[str, int]]]:
        """The service's address on each interface (of ``nics``) that has an IPv4 address."""
        port = self._server.port
        return {
            iface.name: [(iface.address, port)]
            for iface in netif.interfaces()
            if iface.address is not None and (self._nics is None or iface.name in self._nics)
        }

    def shutdown(self) -> None:
        """Wakes every ``wait_for_shutdown`` and stops serving, which ends every other wait
        (``wait_for_worker_stop`` then says the service has gone)."""
        self._server.put(_SHUTDOWN, b"")
        self._server.stop()


class ComputeClient:
    """A client of a ``ComputeService``: every request is a connection of its own.

    Args:
        compute_addresses: the service's ``addresses()``.
        key: the service's key.
        verbose: 0 quiet; 1 and above log which address answered (Horovod's levels).

    Raises:
        ConnectionError: no address answered with the key; the message names every
            address tried and why it failed.
    """

    def __init__(self, compute_addresses: Addresses, key: bytes, verbose: int = 1) -> None:
        self._key = key
        self._address = self._probe(compute_addresses, verbose)
        layout = self._wait([_LAYOUT], _LAYOUT_TIMEOUT, "the compute service's layout")[0].split()
        self._dispatchers, self._workers_per_dispatcher = int(layout[0]), int(layout[1])

    def _probe(self, addresses: Addresses, verbose: int) -> tuple[str, int]:
        # Loopback last: from another host it would reach whatever listens there.
        candidates = sorted(
            {(host, int(port)) for entries in addresses.values() for host, port in entries},
            key=lambda address: (netif.is_loopback_address(address[0]), address),
        )
        failures = []
        for host, port in candidates:
            try:
                RendezvousClient(host, port, self._key, _CONNECT_TIMEOUT).close()
            except OSError as exc:  # hora.errors.AuthenticationError is one
                failures.append(f"{host}:{port} ({exc})")
                continue
            if verbose >= 1:
                log.info("%s: reached at %s:%d", ComputeService.NAME, host, port)
            return host, port
        raise ConnectionError(
            f"{ComputeService.NAME}: no address answered with the key: {'; '.join(failures) or 'no addresses given'}"
        )

    def _connect(self) -> RendezvousClient:
        host, port = self._address
        try:
            return RendezvousClient(host, port, self._key, _CONNECT_TIMEOUT)
        except OSError as exc:  # hora.errors.AuthenticationError is one
            raise ConnectionError(f"{ComputeService.NAME} at {host}:{port} cannot be reached: {exc}") from exc

    def _request(self, call: Callable[[RendezvousClient], T]) -> T:
        """``call`` on a connection of its own; a service that has gone is a ``ConnectionError``."""
        client = self._connect()
        try:
            return call(client)
        except RendezvousTimeout:
            raise
        except OSError as exc:
            host, port = self._address
            raise ConnectionError(f"{ComputeService.NAME} at {host}:{port} went away: {exc}") from exc
        finally:
            client.close()

    def _wait(self, keys: list[str], timeout: float, what: str) -> list[bytes]:
        try:
            return self._request(lambda client: client.wait(keys, timeout))
        except RendezvousTimeout:
            raise TimeoutError(
                f"Timed out waiting for {what} after {timeout:g} s. Try to find out what takes "
                f"so long or increase the timeout."
            ) from None

    def _put(self, key: str, value: bytes) -> None:
        self._request(lambda client: client.put(key, value))

    def local_address(self) -> str:
        """The address this host uses to reach the service: one the service's other clients can reach."""
        return self._request(lambda client: client.local_address())

    def _check_dispatcher(self, dispatcher_id: int) -> None:
        if not 0 <= dispatcher_id < self._dispatchers:
            raise IndexError(f"Dispatcher id must be within [0..{self._dispatchers - 1}]: {dispatcher_id}")

    def register_dispatcher(self, dispatcher_id: int, dispatcher_address: str) -> None:
        """Registers the address of dispatcher ``dispatcher_id``.

        Raises:
            IndexError: no such dispatcher.
            ValueError: the dispatcher was registered under another address.
        """
        self._check_dispatcher(dispatcher_id)
        key = _dispatcher_key(dispatcher_id)
        try:
            known = self._wait([key], 0.0, f"dispatcher {dispatcher_id}")[0].decode()
        except TimeoutError:
            known = None
        if known is not None and known != dispatcher_address:
            raise ValueError(
                f"Dispatcher with id {dispatcher_id} has already been registered under different address "
                f"{known}: {dispatcher_address}"
            )
        self._put(key, dispatcher_address.encode())

    def wait_for_dispatcher_registration(self, dispatcher_id: int, timeout: float) -> str:
        """Returns the address of dispatcher ``dispatcher_id`` once it registered.

        Raises:
            IndexError: no such dispatcher.
            TimeoutError: it did not register within ``timeout`` seconds.
        """
        self._check_dispatcher(dispatcher_id)
        return self._wait([_dispatcher_key(dispatcher_id)], timeout, f"dispatcher {dispatcher_id} to register")[
            0
        ].decode()

    def register_worker_for_dispatcher(self, dispatcher_id: int, worker_id: int) -> None:
        """Registers worker ``worker_id`` as serving dispatcher ``dispatcher_id``.

        Raises:
            IndexError: no such dispatcher.
        """
        self._check_dispatcher(dispatcher_id)
        self._put(_worker_key(dispatcher_id, worker_id % self._workers_per_dispatcher), str(worker_id).encode())

    def wait_for_dispatcher_worker_registration(self, dispatcher_id: int, timeout: float) -> None:
        """Waits until every worker of dispatcher ``dispatcher_id`` registered (of dispatcher 0
        when the service has only one).

        Raises:
            IndexError: no such dispatcher.
            TimeoutError: not all of them registered within ``timeout`` seconds.
        """
        self._check_dispatcher(dispatcher_id)
        dispatcher_id = dispatcher_id if self._dispatchers > 1 else 0
        keys = [_worker_key(dispatcher_id, slot) for slot in range(self._workers_per_dispatcher)]
        self._wait(keys, timeout, f"workers for dispatcher {dispatcher_id} to register")

    def stop_dispatcher_workers(self, dispatcher_id: int, timeout: float) -> None:
        """Asks the workers of dispatcher ``dispatcher_id`` to stop and waits until they have;
        whoever stops a dispatcher calls this first (a worker left fetching from a dispatcher
        that has gone cannot stop until its ``dispatcher_timeout_ms`` ran out).

        Raises:
            IndexError: no such dispatcher.
            TimeoutError: not all of them stopped within ``timeout`` seconds.
        """
        self._check_dispatcher(dispatcher_id)
        self._put(_stop_key(dispatcher_id), b"")
        keys = [_stopped_key(dispatcher_id, slot) for slot in range(self._workers_per_dispatcher)]
        self._wait(keys, timeout, f"the workers of dispatcher {dispatcher_id} to stop")

    def wait_for_worker_stop(self, dispatcher_id: int) -> bool:
        """Returns once the workers of dispatcher ``dispatcher_id`` are to stop: True when
        asked to (their dispatcher is about to stop, or shutdown was requested), False when
        the service has gone (nobody waits for them to say they stopped, nor asks for shutdown)."""
        self._check_dispatcher(dispatcher_id)
        return self._wait_or_gone(_stop_key(dispatcher_id), f"the workers of dispatcher {dispatcher_id} to stop")

    def worker_stopped(self, dispatcher_id: int, worker_id: int) -> None:
        """Says that worker ``worker_id`` of dispatcher ``dispatcher_id`` has stopped (nothing
        when the service has gone: nobody waits for it then)."""
        self._check_dispatcher(dispatcher_id)
        try:
            self._put(_stopped_key(dispatcher_id, worker_id % self._workers_per_dispatcher), b"")
        except ConnectionError as exc:
            log.info("%s: gone before worker %d could say it stopped (%s)", ComputeService.NAME, worker_id, exc)

    def shutdown(self) -> None:
        """Asks the compute job to shut down: wakes every ``wait_for_worker_stop`` and
        ``wait_for_shutdown``."""
        for dispatcher_id in range(self._dispatchers):
            self._put(_stop_key(dispatcher_id), b"")
        self._put(_SHUTDOWN, b"")

    def wait_for_shutdown(self) -> None:
        """Returns once shutdown was requested, or once the service has gone."""
        self._wait_or_gone(_SHUTDOWN, "the compute service to shut down")

    def _wait_or_gone(self, key: str, what: str) -> bool:
        """Waits until ``key`` exists (True) or the service has gone (False), however long that takes."""
        while True:
            try:
                self._wait([key], MAX_WAIT, what)
                return True
            except TimeoutError:
                continue
            except ConnectionError as exc:
                log.info("%s: gone while waiting for %s (%s)", ComputeService.NAME, what, exc)
                return False
