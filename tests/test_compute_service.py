"""The compute service (``hora.core.compute_service``) that a data-service job and a training
job meet through: real sockets, clients on threads, one process.

What Horovod's ``ComputeService`` promises: dispatchers and workers register, waits block
until they did (or time out naming what they waited for), ids out of range and a
dispatcher re-registered elsewhere are refused, shutdown wakes every waiter. And what hora
adds: a wrong key or a service that has gone is an error, never a wait, and a dispatcher
stops its workers before it stops (a tf.data worker left fetching from a dispatcher that
has gone cannot stop for as long as its dispatcher timeout).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from hora.core import compute_service
from hora.core.compute_service import ComputeClient, ComputeService, make_secret_key

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def key() -> bytes:
    return make_secret_key()


@pytest.fixture
def service(key: bytes) -> Iterator[ComputeService]:
    service = ComputeService(2, 3, key)
    try:
        yield service
    finally:
        service.shutdown()


def loopback(service: ComputeService) -> dict[str, list[tuple[str, int]]]:
    return {iface: entries for iface, entries in service.addresses().items() if entries[0][0].startswith("127.")}


def test_addresses_name_every_interface_with_the_service_port(service: ComputeService) -> None:
    addresses = service.addresses()
    assert loopback(service), addresses
    ports = {port for entries in addresses.values() for _, port in entries}
    assert len(ports) == 1 and ports.pop() > 0


def test_a_dispatcher_and_its_workers_register_and_waiters_wake(service: ComputeService, key: bytes) -> None:
    client = ComputeClient(service.addresses(), key, verbose=0)
    found: list[str] = []
    waiter = threading.Thread(target=lambda: found.append(client.wait_for_dispatcher_registration(1, 20)))
    waiter.start()
    time.sleep(0.2)
    assert not found  # it waits for the registration
    client.register_dispatcher(1, "grpc://10.0.0.1:5000")
    waiter.join(20)
    assert found == ["grpc://10.0.0.1:5000"]
    client.register_dispatcher(1, "grpc://10.0.0.1:5000")  # the same address again is fine

    done = threading.Event()
    workers = threading.Thread(target=lambda: (client.wait_for_dispatcher_worker_registration(1, 20), done.set()))
    workers.start()
    for worker_id in (3, 4):
        client.register_worker_for_dispatcher(1, worker_id)
    time.sleep(0.2)
    assert not done.is_set()  # two of its three workers
    client.register_worker_for_dispatcher(1, 5)
    workers.join(20)
    assert done.is_set()


def test_waits_time_out_naming_what_they_waited_for(service: ComputeService, key: bytes) -> None:
    client = ComputeClient(service.addresses(), key, verbose=0)
    with pytest.raises(TimeoutError, match="dispatcher 0 to register"):
        client.wait_for_dispatcher_registration(0, 0.3)
    client.register_worker_for_dispatcher(0, 0)
    with pytest.raises(TimeoutError, match="workers for dispatcher 0 to register"):
        client.wait_for_dispatcher_worker_registration(0, 0.3)


def test_ids_out_of_range_and_a_moved_dispatcher_are_refused(service: ComputeService, key: bytes) -> None:
    client = ComputeClient(service.addresses(), key, verbose=0)
    with pytest.raises(IndexError, match=r"within \[0..1\]: 2"):
        client.register_dispatcher(2, "grpc://a:1")
    with pytest.raises(IndexError):
        client.wait_for_dispatcher_registration(-1, 1)
    with pytest.raises(IndexError):
        client.register_worker_for_dispatcher(5, 0)
    client.register_dispatcher(0, "grpc://a:1")
    with pytest.raises(ValueError, match="already been registered under different address grpc://a:1: grpc://b:2"):
        client.register_dispatcher(0, "grpc://b:2")
    assert client.wait_for_dispatcher_registration(0, 1) == "grpc://a:1"


def test_one_dispatcher_serves_every_rank_worker_wait(key: bytes) -> None:
    service = ComputeService(1, 2, key)
    try:
        client = ComputeClient(loopback(service), key, verbose=0)
        client.register_worker_for_dispatcher(0, 0)
        client.register_worker_for_dispatcher(0, 1)
        client.wait_for_dispatcher_worker_registration(0, 5)
    finally:
        service.shutdown()


def test_shutdown_wakes_every_waiter(service: ComputeService, key: bytes) -> None:
    """Those waiting for shutdown, and every dispatcher's workers waiting to stop."""
    client = ComputeClient(service.addresses(), key, verbose=0)
    woke: list[str] = []
    waits = [(f"shutdown {i}", client.wait_for_shutdown) for i in range(3)]
    waits += [(f"worker of {d}", lambda d=d: client.wait_for_worker_stop(d)) for d in (0, 1)]
    waiters = [threading.Thread(target=lambda n=n, w=w: (w(), woke.append(n))) for n, w in waits]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.2)
    assert not woke
    client.shutdown()
    for waiter in waiters:
        waiter.join(20)
    assert sorted(woke) == sorted(name for name, _ in waits)


def test_a_dispatcher_stops_its_workers_first_and_waits_for_them(service: ComputeService, key: bytes) -> None:
    """Whoever stops a dispatcher asks its workers to stop and waits until every one has;
    the workers of the other dispatcher go on."""
    client = ComputeClient(service.addresses(), key, verbose=0)
    asked: list[int] = []
    workers = [
        threading.Thread(target=lambda d=d, w=w: client.wait_for_worker_stop(d) and asked.append(w))
        for d, w in ((1, 3), (1, 4), (1, 5), (0, 0))
    ]
    for worker in workers:
        worker.start()
    stopped = threading.Event()
    stopper = threading.Thread(target=lambda: (client.stop_dispatcher_workers(1, 20), stopped.set()))
    stopper.start()
    for worker in workers[:3]:
        worker.join(20)
    assert sorted(asked) == [3, 4, 5]  # dispatcher 1's workers, not dispatcher 0's
    client.worker_stopped(1, 3)
    client.worker_stopped(1, 4)
    time.sleep(0.2)
    assert not stopped.is_set()  # two of its three workers have stopped
    client.worker_stopped(1, 5)
    stopper.join(20)
    assert stopped.is_set() and workers[3].is_alive()
    with pytest.raises(TimeoutError, match="the workers of dispatcher 0 to stop"):
        client.stop_dispatcher_workers(0, 0.3)
    workers[3].join(20)  # asked by the call that timed out
    assert asked[-1] == 0


def test_a_service_that_has_gone_ends_waits_and_fails_requests(key: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compute_service, "_CONNECT_TIMEOUT", 1.0)  # refused connections are retried until then
    service = ComputeService(1, 1, key)
    client = ComputeClient(loopback(service), key, verbose=0)
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: (client.wait_for_shutdown(), woke.set()))
    outcome: list[bool] = []  # a worker waiting to stop learns that the service has gone
    worker = threading.Thread(target=lambda: outcome.append(client.wait_for_worker_stop(0)))
    waiter.start()
    worker.start()
    time.sleep(0.2)
    service._server.stop()  # the compute job's rank 0 died: no shutdown key was ever written
    waiter.join(20)
    worker.join(20)
    assert woke.is_set() and outcome == [False]
    client.worker_stopped(0, 0)  # no error either: nobody waits for it any more
    with pytest.raises(ConnectionError, match="Compute service at 127"):
        client.register_dispatcher(0, "grpc://a:1")


def test_a_wrong_key_or_no_service_is_a_clear_error(service: ComputeService) -> None:
    with pytest.raises(ConnectionError, match="no address answered with the key"):
        ComputeClient(loopback(service), make_secret_key(), verbose=0)
    with pytest.raises(ConnectionError, match="no addresses given"):
        ComputeClient({}, make_secret_key(), verbose=0)


@pytest.mark.parametrize(("dispatchers", "workers"), [(0, 1), (1, 0)])
def test_a_service_needs_dispatchers_and_workers(key: bytes, dispatchers: int, workers: int) -> None:
    with pytest.raises(ValueError, match="must be larger than 0"):
        ComputeService(dispatchers, workers, key)
