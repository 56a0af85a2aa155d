"""hora's collectives inside ``torch.compile``: run as they are, outside the traced graph.

TorchDynamo traces the Python a compiled function calls, and compiles every frame that
runs beneath it. A collective submits its tensors and may then run engine passes on the
calling thread (``Engine.caller_drives``): traced, hora's engine code would be turned into
graph ops (Dynamo rewrites NumPy calls into torch ops, and failed on hora's riders). Like a
C++ op Dynamo cannot see into (Horovod's), each public collective of ``hora.torch`` is a
graph break instead: it runs eagerly, with autograd, between the compiled pieces.

``torch.compiler.disable`` does that, but importing TorchDynamo costs about a second; a
program that never compiles should not pay it. So the wrapper asks for it only once
``torch._dynamo`` has been imported (by ``torch.compile`` or anything else): before that
nothing can be tracing the call.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def outside_compile(fn: F) -> F:
    """``fn``, run eagerly when called from code ``torch.compile`` traces (a graph break).

    Args:
        fn: a public collective (or anything that reaches hora's engine).

    Returns:
        A wrapper with ``fn``'s name and docstring.
    """
    disabled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:  # nothing has loaded the tracer: nothing traces this call
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]
        return disabled(*args, **kwargs)

    return call  # type: ignore[return-value]
