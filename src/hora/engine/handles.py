"""Handles: the result of an asynchronous collective, waited on with a lock (never a spin)."""

from __future__ import annotations

import _thread
from collections.abc import Callable
from typing import Any


class Handle:
    """Completes once, with a result or an exception.

    A latch made of one raw lock, held from creation until completion: ``wait``
    acquires it (blocking without the GIL) and releases it again at once, so any number
    of threads may wait. A raw lock costs a fraction of ``threading.Event``, whose
    condition variable is pure Python; the handle is on every collective's path.

    Args:
        name: the tensor's name, for messages.
        drive: called by an untimed ``wait``: waits until the handle completes, running
            the engine on the waiting thread when it can (``Engine.drive``).

    Attributes:
        name: the tensor's name, for messages.
    """

    __slots__ = ("_bell", "_done", "_drive", "_error", "_latch", "_result", "name")

    def __init__(self, name: str, drive: Callable[[Handle], None] | None = None) -> None:
        self.name = name
        self._drive = drive
        self._latch = _thread.allocate_lock()
        self._bell: _thread.LockType | None = None  # a held raw lock that completion also releases (Engine.drive)
        self._latch.acquire()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the collective finished, successfully or not."""
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """Blocks until the collective finishes and returns its result.

        Raises:
            TimeoutError: ``timeout`` passed first.
            Exception: the error the collective failed with.
        """
        if not self._done and timeout is None and self._drive is not None:
            self._drive(self)  # returns once the handle is done
        if not self._done:
            if not self._latch.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(f"'{self.name}' did not finish within {timeout} s")
            self._latch.release()
        if self._error is not None:
            raise self._error
        return self._result

    def block(self) -> None:
        """Blocks until the collective finishes, without driving the engine."""
        if not self._done:
            self._latch.acquire()
            self._latch.release()

    def complete(self, result: Any) -> None:
        if not self._done:
            self._result = result
            self._finish()

    def fail(self, error: BaseException) -> None:
        if not self._done:
            self._error = error
            self._finish()

    def _finish(self) -> None:
        # Invariant: the result is stored before ``_done`` is set and the latch opens.
        self._done = True
        self._latch.release()
        ring(self._bell)

    def set_bell(self, bell: _thread.LockType | None) -> None:
        """Also releases ``bell`` (a held raw lock) on completion, or now if already done."""
        self._bell = bell
        if self._done:
            ring(bell)


def ring(bell: _thread.LockType | None) -> None:
    """Releases a held raw lock used as a one-shot signal; a second ring does nothing."""
    if bell is not None:
        try:
            bell.release()
        except RuntimeError:
            pass  # already rung
