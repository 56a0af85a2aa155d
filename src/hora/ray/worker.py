"""The Ray actor behind every rank (Horovod's ``BaseHorovodWorker``).

The executor creates one actor per slot, sets its environment (the rank's topology,
the rendezvous endpoint and the job secret, as ``horarun`` sets a process's) and
optionally builds an *executable* in it (``start(executable_cls=...)``), which
``execute`` hands to the function. ``call`` is what ``run`` and ``execute`` use: it
returns an ``Outcome`` whatever the function does. The actor never imports hora's
rank machinery; the user's function does, when it calls ``hvd.init()``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.ray.outcome import Outcome


def node_ip_address() -> str:
    """This process's Ray node IP address."""
    import ray.util

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]  # untyped in Ray


class BaseHoraWorker:
    """One rank's actor; subclass it only to add methods (the executor creates it).

    Args:
        env: variables set in the actor's process before anything else runs
            (``OMP_NUM_THREADS`` must be set before torch is imported).
    """

    executable: Any = None

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        os.environ.update({name: str(value) for name, value in (env or {}).items()})

    def node(self) -> tuple[str, str]:
        """Returns this actor's Ray node id (hex) and node IP address."""
        import ray

        return ray.get_runtime_context().get_node_id(), node_ip_address()

    def node_id(self) -> str:
        """Returns this actor's Ray node id (hex)."""
        return self.node()[0]

    def hostname(self) -> str:
        """Returns the host name of the machine the actor runs on."""
        return socket.gethostname()

    def get_gpu_ids(self) -> list[Any]:
        """Returns the GPU ids Ray assigned to this actor."""
        import ray

        return list(ray.get_gpu_ids())

    def update_env_vars(self, env_vars: Mapping[str, Any]) -> None:
        """Sets variables in the actor's process (values are turned into strings)."""
        os.environ.update({name: str(value) for name, value in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        """Returns the actor's environment."""
        return dict(os.environ)

    def start_executable(
        self,
        executable_cls: type | None = None,
        executable_args: Sequence[Any] | None = None,
        executable_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Builds ``executable_cls(*args, **kwargs)`` in the actor; None leaves no executable."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or ()), **(executable_kwargs or {}))

    def execute(self, func: Callable[[Any], Any]) -> Any:
        """Returns ``func(executable)``; an exception propagates through Ray."""
        return func(self.executable)

    def call(self, func: Callable[[Any], Any], rank: int) -> Outcome:
        """Runs ``func(executable)`` and reports how it ended, never raising.

        Args:
            func: the function.
            rank: this worker's rank, recorded in the outcome.

        Returns:
            The value, or the exception with its traceback.
        """
        try:
            value = func(self.executable)
        except BaseException as error:  # noqa: BLE001 - every ending is reported to the executor
            return Outcome.failed(rank, error)
        return Outcome(rank, value=value)
