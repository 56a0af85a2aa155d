"""hora's logging: records reach the application's handlers with the rank as a field, and
hora's own stderr handler writes only while the application has configured none."""

from __future__ import annotations

import io
import logging

from hora import logs


def _own_handler() -> logging.StreamHandler:  # type: ignore[type-arg]
    return next(h for h in logging.getLogger("hora").handlers if isinstance(h, logs._Handler))


def test_records_reach_the_applications_handlers_with_the_rank_field() -> None:
    logs.configure("WARNING", hide_time=True)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(self.format(record))

    keep = Keep()
    keep.setFormatter(logging.Formatter("%(rank)s|%(name)s|%(message)s"))
    root = logging.getLogger()
    root.addHandler(keep)
    try:
        logging.getLogger("hora.engine.engine").warning("cannot pin", extra=logs.at(3))
        logging.getLogger("hora.engine.engine").info("below hora's level")
    finally:
        root.removeHandler(keep)
    assert seen == ["3|hora.engine.engine|cannot pin"]
    assert logging.getLogger("hora").propagate


def test_horas_handler_writes_only_while_the_application_has_none() -> None:
    logs.configure("WARNING", hide_time=True)
    logs.configure("WARNING", hide_time=True)  # a second init adds no second handler
    assert sum(isinstance(h, logs._Handler) for h in logging.getLogger("hora").handlers) == 1
    handler = _own_handler()
    stream = io.StringIO()
    previous = handler.setStream(stream)
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        logging.getLogger("hora.transport.local").warning("no shared memory", extra=logs.at(1))
        logging.getLogger("hora.transport.mesh").warning("rejected a connection")
        root.addHandler(logging.NullHandler())  # the application configures logging now
        logging.getLogger("hora.engine.stall").warning("written by the application's handlers only")
    finally:
        root.handlers[:] = saved
        handler.setStream(previous)
    assert stream.getvalue() == "hora rank 1: no shared memory\nhora: rejected a connection\n"


def test_trace_and_fatal_are_horovods_spellings() -> None:
    logs.configure("TRACE", hide_time=False)
    assert logging.getLogger("hora").level == logs.TRACE
    logs.configure("FATAL", hide_time=False)
    assert logging.getLogger("hora").level == logging.CRITICAL
    logs.configure("WARNING", hide_time=False)
