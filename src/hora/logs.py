"""hora's logging: one logger per module under ``hora``, quiet until ``init``, the rank a field.

Each module logs through ``logging.getLogger(__name__)``. The ``hora`` logger carries a
``NullHandler`` (see ``hora/__init__.py``), so nothing reaches ``logging``'s last-resort
handler before ``init``. ``init`` calls ``configure``: it sets hora's level and gives
``hora`` its own stderr handler, which writes only while the application has configured
no logging of its own (the root logger has no handler), so a record is never written
twice, whenever the application configures logging. ``propagate`` is never turned off:
the application's handlers see every record hora logs.

A record about this process's rank carries it as a field, ``rank`` (``extra=at(rank)``),
never pasted into the message: hora's handler writes ``hora rank N: message``, and an
application's format can use ``%(rank)s``.
"""

from __future__ import annotations

import logging

ROOT = "hora"
TRACE = 5  # HORA_LOG_LEVEL=TRACE, below DEBUG


def at(rank: int) -> dict[str, int]:
    """The ``extra`` of a record about this process's rank."""
    return {"rank": rank}


class _Formatter(logging.Formatter):
    """``[time] hora rank N: message`` (``hora: message`` for records without a rank)."""

    def __init__(self, hide_time: bool) -> None:
        super().__init__("%(message)s" if hide_time else "[%(asctime)s] %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        rank = getattr(record, "rank", None)
        prefix = "hora: " if rank is None else f"hora rank {rank}: "
        saved = record.message
        record.message = prefix + saved
        try:
            return super().formatMessage(record)
        finally:
            record.message = saved


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """hora's stderr handler: writes only while the root logger has no handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers and bool(super().filter(record))


def configure(level: str, hide_time: bool) -> None:
    """Sets hora's level and its handler's format (adding the handler once).

    Args:
        level: a ``logging`` level name, or ``TRACE``/``FATAL`` as Horovod spells them.
        hide_time: leave the time out of hora's own lines.
    """
    logger = logging.getLogger(ROOT)
    logger.setLevel({"TRACE": TRACE, "FATAL": logging.CRITICAL}.get(level, level))
    handler = next((h for h in logger.handlers if isinstance(h, _Handler)), None)
    if handler is None:
        handler = _Handler()
        logger.addHandler(handler)
    handler.setFormatter(_Formatter(hide_time))
