"""hora: Horovod's API in pure Python.

Import a framework binding (``hora.torch``, ``hora.tensorflow``, ``hora.numpy``, ...)
the way you imported Horovod's, and launch with ``horarun``, or call a function on
every rank with ``hora.run(func, num_proc=4)``.

``hora.run`` is loaded on first use: every rank imports this package, and none of
them needs the launcher.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hora.version import __version__

# Quiet until init() (hora.logs): no record reaches logging's last-resort handler.
logging.getLogger("hora").addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from hora.runner.run_func import run

__all__ = ["__version__", "run"]


def __getattr__(name: str) -> Any:
    """Loads ``run`` (the launcher) when it is first asked for."""
    if name == "run":
        from hora.runner.run_func import run

        return run
    raise AttributeError(f"module 'hora' has no attribute {name!r}")
