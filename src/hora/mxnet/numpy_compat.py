"""The NumPy aliases MXNet 1.9.1 reads, restored before ``import mxnet``.

MXNet 1.9.1 (its last release) predates NumPy 1.24, which removed the aliases
``np.bool``, ``np.int``, ``np.float``, ``np.complex``, ``np.object`` and ``np.str`` (for
the builtins of the same names, deprecated since NumPy 1.20). MXNet reads ``np.bool``
and ``np.int`` when it is imported and in some of its operators, so on NumPy 1.24-1.26
``import mxnet`` fails with ``AttributeError: module 'numpy' has no attribute 'bool'``.

``restore()`` puts back exactly those six aliases, each only where NumPy lacks it, and
only on NumPy 1.24 and later (NumPy 1.23 still has them all): the same objects NumPy
1.23 had (the builtins), so code that still spells them behaves as it did there. It
changes the ``numpy`` module for the whole process, which is why only ``hora.mxnet``
calls it. NumPy 2 cannot run MXNet 1.9.1 at all (MXNet reads constants NumPy 2 removed,
such as ``np.PZERO``); ``restore()`` says so instead of patching further.
"""

from __future__ import annotations

import builtins

import numpy as np

# The aliases NumPy 1.24 removed: each named the builtin of the same name.
REMOVED_ALIASES = ("bool", "int", "float", "complex", "object", "str")


def _numpy_version() -> tuple[int, int]:
    major, minor = np.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def restore() -> list[str]:
    """Restores the aliases NumPy 1.24 removed, where missing, so that MXNet 1.9.1 imports.

    Returns:
        The names restored (empty on NumPy < 1.24, or when they are there already).

    Raises:
        ImportError: NumPy is 2 or later, which MXNet 1.9.1 cannot run on; the message
            says which NumPy to install.
    """
    version = _numpy_version()
    if version >= (2, 0):
        raise ImportError(
            f"hora.mxnet: MXNet 1.9.1 does not run on NumPy {np.__version__} (it needs NumPy < 2); "
            "run MXNet jobs in an environment of their own with pip install 'numpy<2' mxnet==1.9.1 "
            "(hora's Makefile builds one: .venv-mxnet, from requirements/mxnet.txt)"
        )
    if version < (1, 24):
        return []
    restored = []
    for name in REMOVED_ALIASES:
        if name not in np.__dict__:  # np.<name> itself would raise NumPy's AttributeError
            setattr(np, name, getattr(builtins, name))
            restored.append(name)
    return restored
