"""Values the ranks log to the driver while a call runs: ``RayExecutor``'s ``callbacks``.

Horovod's ``horovod.ray.ray_logger``: inside the function the executor runs, a rank
calls ``ray_logger.log({"epoch": 3, "loss": 0.2})``; on the driver, every callback given
to ``run``/``execute`` is called with each value, in the order they arrive, while the
call runs (a Ray Tune reporter, a progress printer). Without callbacks ``log`` warns and
drops the value, as Horovod's does::

    from hora.ray import ray_logger

    def train():
        hvd.init()
        for epoch in range(10):
            ...
            if hvd.rank() == 0:
                ray_logger.log({"epoch": epoch, "loss": loss})

    executor.run(train, callbacks=[print])

Horovod calls callbacks only in elastic jobs (its fixed-size executor accepts and
ignores them); hora calls them in both.

How it travels: ``Relay`` is a ``ray.util.queue.Queue`` (a Ray actor) for one call and
a thread on the driver that hands each value to the callbacks. The function each rank
runs is wrapped (``Logged``) so that, while it runs, ``log`` in that rank's actor puts
values into the call's queue; which queue is a context variable, set for the duration
of the call in the thread that runs it.
"""

from __future__ import annotations

import contextvars
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

_QUEUE: contextvars.ContextVar[Any] = contextvars.ContextVar("hora_ray_log_queue", default=None)
_DRAIN_POLL = 0.1  # seconds between looks at an empty queue
_DRAIN_JOIN = 60.0  # seconds the driver waits for the callbacks of the last values


def log(info: Any) -> None:
    """Sends ``info`` (anything Ray can serialize; Horovod passes a dict) to the driver's
    callbacks. Outside a call with callbacks it warns and drops the value."""
    queue = _QUEUE.get()
    if queue is None:
        warnings.warn("hora.ray.ray_logger.log called, but the executor's call has no callbacks", stacklevel=2)
        return
    queue.put(info)


class Logged:
    """A function of the worker's executable that runs with ``log`` sending into ``queue``."""

    def __init__(self, func: Callable[[Any], Any], queue: Any) -> None:
        self.func = func
        self.queue = queue

    def __call__(self, executable: Any) -> Any:
        token = _QUEUE.set(self.queue)
        try:
            return self.func(executable)
        finally:
            _QUEUE.reset(token)


class Relay:
    """The driver's side of one call's callbacks: the queue and the thread that drains it.

    Use as a context manager around the call; leaving it hands the values still queued
    to the callbacks, removes the queue's actor, and raises what a callback raised (the
    values after it are dropped).
    """

    def __init__(self, callbacks: Sequence[Callable[[Any], Any]]) -> None:
        from ray.util.queue import Queue

        self._callbacks = list(callbacks)
        self.queue = Queue(actor_options={"num_cpus": 0})
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="hora-ray-callbacks", daemon=True)

    def wrap(self, func: Callable[[Any], Any]) -> Logged:
        return Logged(func, self.queue)

    def __enter__(self) -> Relay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=_DRAIN_JOIN)
        self.queue.shutdown(force=True)
        if self._error is not None and exc[0] is None:
            raise self._error

    def _drain(self) -> None:
        try:
            self._hand_over()
        except BaseException as error:  # noqa: BLE001 - raised in the caller's thread by __exit__
            self._error = error

    def _hand_over(self) -> None:
        from ray.util.queue import Empty

        while True:
            finishing = self._done.is_set()  # read before draining: nothing put after the call is lost
            try:
                items = self.queue.get_nowait_batch(self.queue.qsize())
            except Empty:
                items = []
            for item in items:
                for callback in self._callbacks:
                    callback(item)
            if finishing and not items:
                return
            if not items:
                self._done.wait(_DRAIN_POLL)
