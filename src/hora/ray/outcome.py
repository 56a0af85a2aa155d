"""How one rank's call ended, and the error ``RayExecutor.run`` raises when a rank failed.

A worker never lets the user's exception escape into Ray: it returns an ``Outcome``
(the value, or the exception with its formatted traceback and when it was raised),
so the executor sees every rank's ending the same way, can tell the root cause from
the ranks that failed because a peer went away (``HoraInternalError``), and can
release the others at once.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Sequence
from typing import Any

from hora.errors import HoraInternalError

_EXCERPT_LINES = 40  # of a traceback in WorkerError's message; the attribute has it whole


@dataclasses.dataclass
class Outcome:
    """One rank's ending.

    Attributes:
        rank: the rank.
        value: what the function returned (``ok``).
        error: the exception raised, when it could be pickled; else None.
        traceback: the formatted traceback (empty when ``ok``).
        summary: ``Type: message`` of the exception.
        internal: the exception is hora's ``HoraInternalError``: the rank failed
            because a peer failed or left, so it is not the root cause.
        lost: the worker itself was lost (its actor died or was killed).
        at: ``time.time()`` when it ended.
    """

    rank: int
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    summary: str = ""
    internal: bool = False
    lost: bool = False
    at: float = dataclasses.field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        return not self.summary

    @classmethod
    def failed(cls, rank: int, error: BaseException) -> Outcome:
        """The outcome of a call that raised ``error`` (call inside the ``except`` block)."""
        import cloudpickle

        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        try:  # the exception travels only if it can; its text always does
            cloudpickle.dumps(error)
            kept: BaseException | None = error
        except Exception:  # noqa: BLE001 - any pickling failure means: send the text only
            kept = None
        return cls(
            rank,
            error=kept,
            traceback=text,
            summary=f"{type(error).__name__}: {error}",
            internal=isinstance(error, HoraInternalError),
        )

    @classmethod
    def gone(cls, rank: int, reason: str) -> Outcome:
        """The outcome of a worker whose actor died (``reason`` says how)."""
        return cls(rank, summary=reason, lost=True)


def root_cause(failures: Sequence[Outcome]) -> Outcome:
    """The failure to report: the earliest that is the user's own error.

    A rank that raised ``HoraInternalError`` or was lost failed because of another;
    only when every failure is of that kind is the earliest of them chosen.
    """
    own = [outcome for outcome in failures if not outcome.internal and not outcome.lost]
    return min(own or failures, key=lambda outcome: outcome.at)


class WorkerError(RuntimeError):
    """A rank of a Ray job failed; raised by ``RayExecutor.run`` and ``execute``.

    Attributes:
        rank: the rank that failed first by its own error (the root cause).
        cause: its exception, when it could be sent back; else None.
        traceback: its formatted traceback (empty when the worker was lost).
        failures: every rank's failure, root cause first.
    """

    def __init__(self, name: str, size: int, failures: Sequence[Outcome], hosts: Sequence[str]) -> None:
        first = root_cause(failures)
        others = sorted((o for o in failures if o is not first), key=lambda o: o.rank)
        lines = [f"hora.ray: {name} failed on rank {first.rank} of {size} (on {hosts[first.rank]}): {first.summary}"]
        if first.traceback:
            excerpt = first.traceback.rstrip("\n").splitlines()
            if len(excerpt) > _EXCERPT_LINES:
                excerpt = ["..."] + excerpt[-_EXCERPT_LINES:]
            lines.append(f"traceback of rank {first.rank}:")
            lines.extend("  " + line for line in excerpt)
        for outcome in others:
            lines.append(f"rank {outcome.rank} (on {hosts[outcome.rank]}) then failed too: {outcome.summary}")
        super().__init__("\n".join(lines))
        self.rank = first.rank
        self.cause = first.error
        self.traceback = first.traceback
        self.failures = [first, *others]
