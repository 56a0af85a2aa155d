"""Holding back the exceptions of signal handlers while the main thread runs the engine.

Python runs signal handlers on the main thread, between any two bytecodes, and a
handler may raise: Ctrl-C's ``KeyboardInterrupt``, a watchdog's or a test timeout's
exception on SIGALRM, ``SystemExit`` from a SIGTERM handler. A blocking collective runs
engine passes on its caller's thread (``Engine.drive``), often the main thread, and an
exception raised in the middle of a pass would leave the engine half-updated (a frame
half read, tensors drained but not announced, a collective half done on this rank while
its peers wait for the rest), failing every later collective.

So while the main thread holds the engine's lock, the ``InterruptShield`` holds the
handlers back: each Python-level handler is wrapped once in a ``_Trampoline``, which
calls it at once when the shield is down (the usual case: nothing changes) and, while
it is up, records the signal and returns. When the thread lets go of the lock, the
shield comes down and runs the recorded handlers in order, so their exception (if any)
comes out of the user's call, with the engine consistent; the collective goes on on the
engine thread and completes or fails on its own. Two refinements:

* A blocked wait that reads nothing (the engine's ``poll`` for frames) is a *safe point*:
  a signal there ends the drive at once (``Interrupted``), so Ctrl-C during a long wait
  for other ranks acts immediately.
* A data-plane wait is not: the collective is half done. A signal there wakes the wait
  (a byte on the shield's socket); the wait goes on while the collective makes progress,
  and gives up once it has made none for ``GIVE_UP_SECONDS`` after the signal (the peers
  are frozen or gone), raising the handler's exception there (``Abandoned``): the job
  then fails on this rank with a reason that says so.

Every handler is wrapped, whenever it is installed: while hora runs, ``signal.signal``
and ``signal.getsignal`` are hora's thin versions, which wrap a new handler in a
trampoline and hand back the unwrapped one, so a program sees exactly the handlers it
installed (``getsignal(SIGINT) is default_int_handler`` stays true) and no handler
installed after ``init()`` escapes the shield, however soon it fires. A handler that
bypasses them (installed through a reference to the original function taken before
``init()``) is wrapped the next time the main thread drives after ``REFRESH_SECONDS``.
``restore`` (at shutdown) puts back the original functions and the plain handlers.

Invariant: ``_active`` is True only while the main thread holds the engine's lock, and
only the main thread reads or changes the pending list (handlers run there).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from types import FrameType
from typing import Any, Callable

REFRESH_SECONDS = 1.0  # how often the main thread, when it drives, wraps handlers installed around hora
GIVE_UP_SECONDS = 1.0  # a data-plane wait without progress this long after a signal gives up

Handler = Callable[[int, FrameType | None], Any]


class Interrupted(BaseException):
    """A signal arrived while the main thread waited at a safe point: stop driving."""


class Abandoned(BaseException):
    """A signal's handler raised in a data-plane wait that had stopped progressing.

    Attributes:
        error: the handler's exception, raised again in the user's call.
    """

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"interrupted by {type(error).__name__}")
        self.error = error


class _Trampoline:
    """Stands in for a Python signal handler: calls it now, or later if the shield is up."""

    def __init__(self, shield: InterruptShield, handler: Handler) -> None:
        self.shield = shield
        self.__wrapped__ = handler

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        return self.shield._on_signal(self.__wrapped__, signum, frame)

    def __repr__(self) -> str:
        return f"<hora signal trampoline for {self.__wrapped__!r}>"


class InterruptShield:
    """Defers Python signal handlers while the main thread drives the engine (see above)."""

    def __init__(self) -> None:
        self._main = threading.main_thread().ident
        self._active = False
        self.safe = False  # True while the main thread blocks at a safe point
        self.pending: list[tuple[Handler, int, FrameType | None]] = []
        self.pending_since = 0.0  # time.monotonic() of the first pending signal
        self._originals: tuple[Any, Any] | None = None  # signal.signal/getsignal before _install
        self._replacements: tuple[Any, Any] | None = None
        self._refreshed = float("-inf")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.refresh()

    def enter(self) -> bool:
        """Raises the shield if this is the main thread (which just took the engine's lock).

        Returns:
            Whether the shield is up (call ``leave`` when letting go of the lock).
        """
        if threading.get_ident() != self._main:
            return False
        now = time.perf_counter()
        if now - self._refreshed >= REFRESH_SECONDS:
            self.refresh()
        self._active = True
        return True

    def leave(self) -> None:
        """Lowers the shield (the main thread let go of the lock) and runs the held-back
        handlers in order.

        Raises:
            BaseException: whatever a handler raises (the rest are then dropped, as when
                a handler raises while others are tripped).
        """
        self._active = False
        self.safe = False
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        self.clear_wake()
        for handler, signum, frame in pending:
            handler(signum, frame)

    def _on_signal(self, handler: Handler, signum: int, frame: FrameType | None) -> Any:
        if not self._active:
            return handler(signum, frame)
        if not self.pending:
            self.pending_since = time.monotonic()
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")  # wakes a data-plane wait (see deadline)
        self.pending.append((handler, signum, frame))
        if self.safe:
            raise Interrupted()
        return None

    # ----- for data-plane waits (hora.transport.tcp.Interrupts) -----

    def fileno(self) -> int:
        """Readable once a signal is pending: a data-plane wait polls it to wake up."""
        return self._wake_r.fileno()

    def clear_wake(self) -> None:
        """Reads the wake-up bytes (what is pending stays pending)."""
        with contextlib.suppress(OSError):
            while self._wake_r.recv(64):
                pass

    def deadline(self, idle_since: float) -> float | None:
        """When a wait idle since ``idle_since`` gives up on its collective (None: no signal)."""
        if not self.pending:
            return None
        return max(self.pending_since, idle_since) + GIVE_UP_SECONDS

    def give_up(self) -> None:
        """Runs the held-back handlers now, in a data-plane wait that stopped progressing.

        Raises:
            Abandoned: a handler raised; its exception is ``error``.
        """
        pending, self.pending = self.pending, []
        self.clear_wake()
        for handler, signum, frame in pending:
            try:
                handler(signum, frame)
            except BaseException as exc:  # noqa: BLE001 - carried out of the engine and raised again
                raise Abandoned(exc) from exc

    # ----- handlers -----

    def _wrap(self, handler: Any) -> Any:
        if callable(handler) and not isinstance(handler, _Trampoline):
            return _Trampoline(self, handler)
        return handler

    def _install(self) -> None:
        """Puts hora's ``signal.signal``/``signal.getsignal`` in place (see the module doc)."""
        installed = getattr(signal.signal, "_hora_shield", None)
        if installed is self:
            return
        if isinstance(installed, InterruptShield):
            installed.restore()  # an earlier runtime's, not restored at its shutdown: take over
        original_signal, original_getsignal = signal.signal, signal.getsignal

        def wrapped_signal(signalnum: int, handler: Any) -> Any:
            return _unwrap(original_signal(signalnum, self._wrap(handler)))

        def wrapped_getsignal(signalnum: int) -> Any:
            return _unwrap(original_getsignal(signalnum))

        wrapped_signal.__doc__ = original_signal.__doc__
        wrapped_getsignal.__doc__ = original_getsignal.__doc__
        wrapped_signal._hora_shield = self  # type: ignore[attr-defined]
        self._originals = (original_signal, original_getsignal)
        self._replacements = (wrapped_signal, wrapped_getsignal)
        signal.signal, signal.getsignal = wrapped_signal, wrapped_getsignal

    def refresh(self) -> None:
        """Wraps every Python-level handler that is not wrapped yet (main thread only)."""
        self._refreshed = time.perf_counter()
        if threading.get_ident() != self._main:
            return
        self._install()
        assert self._originals is not None  # invariant: set by _install
        original_signal, original_getsignal = self._originals
        for signum in signal.valid_signals():
            try:
                handler = original_getsignal(signum)
            except (OSError, ValueError):
                continue
            if callable(handler) and not (isinstance(handler, _Trampoline) and handler.shield is self):
                with contextlib.suppress(OSError, ValueError, RuntimeError):
                    original_signal(signum, _Trampoline(self, _unwrap(handler)))

    def restore(self) -> None:
        """Puts back ``signal``'s functions and every plain handler (main thread only;
        elsewhere the trampolines stay, calling their handlers directly)."""
        if threading.get_ident() != self._main or self._originals is None:
            return
        original_signal, original_getsignal = self._originals
        if (signal.signal, signal.getsignal) == self._replacements:
            signal.signal, signal.getsignal = original_signal, original_getsignal
        for signum in signal.valid_signals():
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                handler = original_getsignal(signum)
                if isinstance(handler, _Trampoline):
                    original_signal(signum, handler.__wrapped__)
        self._originals = None

    def close(self) -> None:
        """Closes the wake-up socket (after ``restore``; a trampoline left behind calls its
        handler directly)."""
        self._active = False
        self._wake_r.close()
        self._wake_w.close()


def _unwrap(handler: Any) -> Any:
    return handler.__wrapped__ if isinstance(handler, _Trampoline) else handler
