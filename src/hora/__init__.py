"""hora: Horovod's API in pure Python.

Import a framework binding (``hora.torch``, ``hora.tensorflow``, ``hora.numpy``, ...)
the way you imported Horovod's, and launch with ``horarun``, or call a function on
every rank with ``hora.run(func, np=4)``.
"""

from hora.runner.run_func import run
from hora.version import __version__

__all__ = ["__version__", "run"]
