"""Exception types that carry meaning for the training loop.

``HoraInternalError`` means a collective could not complete because the job lost a
rank or was aborted: elastic training restores the last committed state and retries.
``HostsUpdatedInterrupt`` means the set of hosts changed: elastic training resets.
``CollectiveMismatchError`` means the ranks disagreed about a collective (shape,
dtype, op, ...): a bug in the script, raised on every rank, after which the runtime
remains usable; it is a ``HoraInternalError``, as Horovod raises ``HorovodInternalError``
for these.

Horovod's names are kept as aliases so that ``except hvd.HorovodInternalError``
works unchanged.
"""

from __future__ import annotations


class HoraInternalError(RuntimeError):
    """A collective failed because a rank was lost, the job aborted, or hora shut down."""


class HostsUpdatedInterrupt(RuntimeError):
    """The hosts of an elastic job changed; the training loop should reset.

    Args:
        skip_sync: True when hosts were only removed, so the surviving ranks already
            hold consistent state and need not synchronize it again.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of the elastic job changed")
        self.skip_sync = skip_sync


class HoraVersionMismatchError(ImportError):
    """A framework binding was built for a different framework version than the one imported."""


class CollectiveMismatchError(HoraInternalError):
    """The ranks of a process set submitted a collective that they do not agree on.

    The message names the operation, the tensor and each rank's value, for example
    ``allreduce 'grad.w': shapes differ across ranks: rank 0 (17, 1311), rank 1 (17, 23)``.
    Raised on every rank; later collectives run normally. A subclass of
    ``HoraInternalError`` because Horovod raises ``HorovodInternalError`` for these.
    """


class UnsupportedOperationError(HoraInternalError, NotImplementedError):
    """An operation not offered for these arguments (``reducescatter`` with Adasum, Min,
    Max or Product). Horovod raises ``HorovodInternalError`` (a ``RuntimeError``) here;
    this is one, and a ``NotImplementedError`` too."""


class ProtocolError(ConnectionError):
    """A peer sent bytes that are not a well-formed hora message."""


class AuthenticationError(ConnectionError):
    """A peer failed the HMAC challenge on the job secret."""


# Horovod's names, for scripts that catch them.
HorovodInternalError = HoraInternalError
HorovodVersionMismatchError = HoraVersionMismatchError

__all__ = [
    "AuthenticationError",
    "CollectiveMismatchError",
    "HoraInternalError",
    "HoraVersionMismatchError",
    "HorovodInternalError",
    "HorovodVersionMismatchError",
    "HostsUpdatedInterrupt",
    "ProtocolError",
    "UnsupportedOperationError",
]
