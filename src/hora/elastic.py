"""The worker side of elastic training, shared by every binding (``horovod.common.elastic``).

A training function decorated by a binding's ``hvd.elastic.run`` receives a ``State``
that holds what must survive a failure: ``state.commit()`` keeps a copy of it in host
memory; when a collective fails (``HoraInternalError``: a rank was lost) the loop in
``run_fn`` puts the last commit back, resets hora and synchronizes the state from rank 0
before calling the function again. When the hosts of the job change, ``commit()`` (or
``check_host_updates()``) raises ``HostsUpdatedInterrupt`` on every rank at once, and the
loop resets the same way, skipping the synchronization when hosts were only removed.

Under ``horarun``'s elastic driver (``horarun --min-np``/``--host-discovery-script``) a
reset joins the job's next world, and rank 0 learns of the driver's changes of hosts as
they come: inside ``run``, the state's ``on_hosts_updated`` is called at once, on a thread
of hora's, as Horovod's notification service calls it (``hora.core.membership``), and each
``check_host_updates`` reads them too. Elsewhere a reset re-initializes
hora against the same world and only ``State.on_hosts_updated`` raises an interrupt.
"""

from __future__ import annotations

import enum
import functools
import queue
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from hora.errors import HoraInternalError, HostsUpdatedInterrupt

R = TypeVar("R")

_JOIN_ATTEMPTS = 3  # init() attempts of one reset under horarun's elastic driver


class HostUpdateResult(enum.IntFlag):
    """What a change of hosts did to the job (Horovod's values): flags that combine."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class State:
    """State tracked in memory across the workers of an elastic job.

    Subclasses say how to ``save`` (commit to host memory), ``restore`` (undo every
    change since the last commit) and ``sync`` (make every rank hold rank 0's state).

    Args:
        bcast_object: ``broadcast_object(obj)``: returns rank 0's ``obj`` on every rank.
        get_rank: returns this worker's rank.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue[tuple[float, HostUpdateResult]] = queue.Queue()
        self._last_updated_timestamp: float = 0
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Adds functions to call after every reset (a worker added or removed), before
        the state is synchronized; for example to rescale the learning rate by the new
        ``size()``.

        Args:
            callbacks: functions taking no argument, called in the order registered.
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``run_fn`` after hora was reset: forgets pending host updates, runs
        ``reset()``, then the registered callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: HostUpdateResult) -> None:
        """Queues a notification that the hosts changed (the elastic driver's message).

        Args:
            timestamp: when the driver saw the change; later ones supersede earlier ones.
            update_res: whether hosts were added, removed or both.
        """
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Saves the state to host memory, then checks for host changes.

        Commits copy data (possibly from a device), so committing every few batches
        rather than every batch trades lost steps after a failure for speed.

        Raises:
            HostsUpdatedInterrupt: on every rank, when the hosts changed since the
                last check.
            HoraInternalError: the broadcast of rank 0's view failed.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises ``HostsUpdatedInterrupt`` on every rank when rank 0 has been told of a
        newer change of hosts. A collective: every rank must call it.

        Raises:
            HostsUpdatedInterrupt: with ``skip_sync`` True when hosts were only removed
                (the survivors hold consistent state already).
            HoraInternalError: the broadcast of rank 0's view failed.
        """
        # Inside run() these reached on_hosts_updated already: the same timestamps count once.
        for timestamp, result in _published_host_updates():
            self.on_hosts_updated(timestamp, HostUpdateResult(result))
        prev_timestamp = last_timestamp = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while True:
            try:
                timestamp, result = self._host_messages.get_nowait()
            except queue.Empty:
                break
            if timestamp > last_timestamp:
                last_timestamp = timestamp
                update |= result
        # Rank 0's view decides, so every rank raises at the same commit.
        prev_timestamp, last_timestamp, update = self._bcast_object((prev_timestamp, last_timestamp, update))
        self._last_updated_timestamp = last_timestamp
        if last_timestamp > prev_timestamp:
            raise HostsUpdatedInterrupt(skip_sync=HostUpdateResult(update) == HostUpdateResult.removed)

    def save(self) -> None:
        """Saves the state to host memory."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Puts back the last committed state, undoing every change since."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Makes every rank hold rank 0's state (a collective)."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Adjusts objects to the new world after a reset, before synchronization; by
        default nothing."""


class ObjectState(State):
    """State made of plain picklable Python objects, given as keyword arguments.

    Every keyword becomes an attribute: ``state = ObjectState(bcast, rank, epoch=0)``
    then ``state.epoch += 1``. As in Horovod, a commit keeps references to the
    attributes' objects, not copies: assign new values (``state.total = state.total +
    x``) rather than changing an object in place, or ``restore`` cannot undo it.

    Args:
        bcast_object: ``broadcast_object(obj)``: returns rank 0's ``obj`` on every rank.
        get_rank: returns this worker's rank.
        **kwargs: the objects tracked, by attribute name.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any) -> None:
        self._saved_state: dict[str, Any] = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        """Keeps the tracked attributes' current objects."""
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        """Sets the tracked attributes back to the objects kept by the last commit."""
        self._set_attrs()

    def sync(self) -> None:
        """Sets every rank's committed objects and attributes to rank 0's.

        Raises:
            HoraInternalError: the broadcast failed.
        """
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


def run_fn(func: Callable[..., R], reset: Callable[[], Any]) -> Callable[..., R]:
    """Wraps a training function in the elastic loop (Horovod's ``run_fn``).

    The wrapper takes the ``State`` first, then the function's own arguments. It
    synchronizes the state and calls ``func(state, *args, **kwargs)``; when a collective
    fails with ``HoraInternalError`` it restores the last commit, calls ``reset()`` and
    ``state.on_reset()``, synchronizes and calls ``func`` again; on
    ``HostsUpdatedInterrupt`` likewise without restoring, and without synchronizing
    when the interrupt says ``skip_sync``.

    Args:
        func: the training function; its first parameter is the ``State``. It must not
            run a collective before it reaches its own code (the state is synchronized
            first).
        reset: re-initializes the framework binding (``shutdown()`` then ``init()``).

    Returns:
        The wrapper, which returns what ``func`` returns once it completes.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        from hora.core import api  # here: the launcher imports this module for HostUpdateResult

        def listener(timestamp: float, result: int) -> None:
            state.on_hosts_updated(timestamp, HostUpdateResult(result))

        api.add_host_listener(listener)  # as Horovod's run_fn registers the state for notifications
        try:
            skip_sync = False
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except HoraInternalError:
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as interrupt:
                    skip_sync = interrupt.skip_sync
                reset()
                state.on_reset()
        finally:
            api.remove_host_listener(listener)

    return wrapper


def reset() -> None:
    """Re-initializes hora in this process, as every binding's reset does: ``shutdown()``,
    then ``init()``, which under horarun's elastic driver joins the job's next world
    (``hora.core.membership``) and elsewhere the same world again."""
    from hora.core import api  # here: the launcher imports this module for HostUpdateResult

    api.shutdown()
    for attempt in range(_JOIN_ATTEMPTS):
        try:
            api.init()
            return
        except HoraInternalError:
            # Under the elastic driver a world can fail to form (a new worker died while
            # starting): the driver records that worker's failure, and the next init()
            # asks for the world after it.
            if not api.elastic_worker() or attempt == _JOIN_ATTEMPTS - 1:
                raise


def _published_host_updates() -> list[tuple[float, int]]:
    """The changes of hosts horarun's elastic driver published since the last call (rank 0)."""
    from hora.core import api

    return api.host_updates()


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Decorates an elastic training function (``func(state, *args, **kwargs)``): every
    binding's ``hvd.elastic.run``.

    The state is synchronized from rank 0 before ``func`` runs (so ``func`` must not
    start with a collective). When a collective fails, the last commit is restored,
    hora is reset (``reset``) and ``func`` runs again; see ``run_fn``.

    Args:
        func: the training function; its first parameter is the state.

    Returns:
        The wrapped function.
    """
    return run_fn(func, reset)


__all__ = ["HostUpdateResult", "ObjectState", "State", "reset", "run", "run_fn"]
