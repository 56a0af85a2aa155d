"""Handles: the result of an asynchronous collective, waited on with an event (never a spin)."""

from __future__ import annotations

import threading
from typing import Any


class Handle:
    """Completes once, with a result or an exception.

    Attributes:
        name: the tensor's name, for messages.
    """

    __slots__ = ("_error", "_event", "_result", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the collective finished, successfully or not."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Blocks until the collective finishes and returns its result.

        Raises:
            TimeoutError: ``timeout`` passed first.
            Exception: the error the collective failed with.
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"'{self.name}' did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def complete(self, result: Any) -> None:
        if not self._event.is_set():
            self._result = result
            self._event.set()

    def fail(self, error: BaseException) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()
