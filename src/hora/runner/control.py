"""The control lines a remote rank's supervisor (``hora.runner.remote``) writes into its stderr.

A control line is ``MARKER`` followed by one JSON object and a newline. ``MARKER``
starts with a NUL byte, which text output does not contain, so a rank's own output is
never taken for one. ``horarun``'s stderr forwarder (``hora.runner.output``) removes
them and hands their data to the rank's ``Worker``.
"""

from __future__ import annotations

import json
from typing import Any

MARKER = b"\x00hora-remote:"


def encode_marker(data: dict[str, Any]) -> bytes:
    """One control line for stderr."""
    return MARKER + json.dumps(data).encode() + b"\n"


def decode_marker(line: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """Splits a line into the rank's text before a control marker and the marker's data.

    Returns:
        (the text before the marker, or the whole line; the marker's data or None).
    """
    index = line.find(MARKER)
    if index < 0:
        return line, None
    try:
        data = json.loads(line[index + len(MARKER) :].decode(errors="replace"))
    except ValueError:
        return line, None
    return line[:index], data if isinstance(data, dict) else None
