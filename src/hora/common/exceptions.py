"""``horovod.common.exceptions``: the errors a training loop catches (``hora.errors``'s objects)."""

from hora.errors import HorovodInternalError, HorovodVersionMismatchError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HorovodVersionMismatchError", "HostsUpdatedInterrupt"]
