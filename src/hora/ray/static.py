"""A Ray job of a fixed size: the actors, their ranks, the rendezvous server, and calls on them.

``StaticJob.start`` places the actors (``hora.ray.placement``), asks each for its node,
numbers the ranks by node (``hora.ray.topology``), starts the job's rendezvous server
in this process with a fresh secret, and gives every actor its rank's environment
(``hora.runner.settings.rank_env``: the same variables ``horarun`` sets), so
``hvd.init()`` in a function the actors run forms the job.

``call`` runs a function on every rank and waits, never for ever:

* a rank whose function raises is killed at once, so its peers blocked in a
  collective fail with ``HoraInternalError`` (hora fails a lost rank's collectives on
  every rank) instead of waiting for it;
* once one rank failed, the others have ``FAILURE_GRACE_S`` to end, then are killed;
* past the caller's ``timeout`` every rank still running is killed.

After a call that failed, the job's actors are replaced (new processes in the same
bundles, a new rendezvous server and secret) before the next call, since a rank's
hora runtime does not survive its peers' failure; the executor stays usable. A call
that succeeded leaves every actor as it is, so a function may ``hvd.init()`` in one
``run`` and use the runtime in the next (as with Horovod).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from hora.ray.outcome import Outcome, WorkerError
from hora.ray.placement import Placement
from hora.ray.settings import RaySettings
from hora.ray.topology import grouped_slots
from hora.ray.worker import BaseHoraWorker, node_ip_address
from hora.runner.hosts import SlotInfo
from hora.runner.placement import ANY, LOOPBACK
from hora.runner.rendezvous import RendezvousServer
from hora.runner.settings import LaunchSettings, rank_env
from hora.transport import auth

FAILURE_GRACE_S = 10.0
"""Seconds the other ranks have to end once one failed (they normally fail within one)."""
SETUP_TIMEOUT_S = 300.0
"""Seconds the actors have to start and answer (imports on a busy machine can be slow)."""
WORKER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
"""Set in every actor unless the caller's ``extra_env_vars`` says otherwise."""


class StaticJob:
    """A fixed number of actors that run functions as the ranks of one hora job.

    Args:
        settings: the job's settings.
        placement: where the actors go.
        extra_env: variables for every actor (``start(extra_env_vars=...)``).
        executable: ``(cls, args, kwargs)`` to build in every actor, or None.
    """

    def __init__(
        self,
        settings: RaySettings,
        placement: Placement,
        extra_env: Mapping[str, Any] | None,
        executable: tuple[type | None, Sequence[Any], Mapping[str, Any]],
    ) -> None:
        self._settings = settings
        self._placement = placement
        self._extra_env = {name: str(value) for name, value in (extra_env or {}).items()}
        self._executable = executable
        self._workers: list[Any] = []  # by rank
        self._slots: list[SlotInfo] = []
        self._server: RendezvousServer | None = None
        self._broken = False

    # ----- the actors -----

    @property
    def workers(self) -> list[Any]:
        """The actors, by rank (replaced first if the last call failed)."""
        self._repair()
        return list(self._workers)

    @property
    def slots(self) -> list[SlotInfo]:
        """Every rank's place (host = the label of its Ray node)."""
        return list(self._slots)

    def start(self) -> None:
        """Creates the actors, numbers them, starts the rendezvous server, sets their env.

        Raises:
            TimeoutError: the actors did not start within ``SETUP_TIMEOUT_S``.
        """
        # Ray's stubs type an actor class's methods as plain functions: handles are Any here.
        cls: Any = ray.remote(BaseHoraWorker)
        env = {**WORKER_ENV, **self._extra_env}
        created = [
            cls.options(**self._placement.actor_options(index)).remote(env)
            for index in range(len(self._placement.bundles))
        ]
        try:
            nodes = _get([worker.node.remote() for worker in created], SETUP_TIMEOUT_S, "report their nodes")
            order, slots = grouped_slots([node_id for node_id, _ in nodes])
            self._workers = [created[index] for index in order]
            self._slots = slots
            ips = {nodes[index][1] for index in order}
            here = node_ip_address()
            # All on this machine: the server stays on loopback; else every node reaches
            # it at this node's address.
            local = ips == {here}
            secret = auth.new_secret()
            self._server = RendezvousServer(secret, host=LOOPBACK if local else ANY).start()
            address = LOOPBACK if local else here
            launch = LaunchSettings(
                command=("ray",),
                num_proc=len(slots),
                start_timeout=float(self._settings.timeout_s),
                network_interfaces=",".join(sorted(self._settings.nics)) if self._settings.nics else None,
            )
            updates = [
                worker.update_env_vars.remote(rank_env({}, launch, slot, (address, self._server.port), secret))
                for worker, slot in zip(self._workers, slots)
            ]
            if self._placement.gpus:
                updates.extend(self._share_gpus())
            executable, args, kwargs = self._executable
            updates.extend(worker.start_executable.remote(executable, args, kwargs) for worker in self._workers)
            _get(updates, SETUP_TIMEOUT_S, "take their environment")
        except BaseException:
            for worker in created:
                ray.kill(worker)
            self._stop_server()
            raise
        if self._settings.verbose > 1:
            for slot in slots:
                print(f"hora.ray: rank {slot.rank} on {slot.hostname} (local rank {slot.local_rank})", flush=True)

    def _share_gpus(self) -> list[ray.ObjectRef[None]]:
        """Lets every worker of a node see all the node's GPUs of the job (Horovod does)."""
        ids = _get([worker.get_gpu_ids.remote() for worker in self._workers], SETUP_TIMEOUT_S, "report their GPUs")
        by_host: dict[str, list[str]] = {}
        for slot, gpus in zip(self._slots, ids):
            by_host.setdefault(slot.hostname, []).extend(str(gpu) for gpu in gpus)
        return [
            worker.update_env_vars.remote({"CUDA_VISIBLE_DEVICES": ",".join(by_host[slot.hostname])})
            for worker, slot in zip(self._workers, self._slots)
        ]

    def _repair(self) -> None:
        """Replaces every actor after a failed call (their hora runtimes are unusable)."""
        if not self._broken:
            return
        self._kill_all()
        self._stop_server()
        self.start()  # raises, leaving the job broken, if the new actors cannot start
        self._broken = False

    def shutdown(self) -> None:
        """Kills the actors, stops the rendezvous server, removes an owned placement group."""
        self._kill_all()
        self._stop_server()
        self._placement.remove()

    def _kill_all(self) -> None:
        for worker in self._workers:
            ray.kill(worker)
        self._workers = []

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    # ----- calls -----

    def call(self, func: Callable[[Any], Any], name: str, timeout: float | None) -> list[Any]:
        """Runs ``func(executable)`` on every rank; see the module docstring for failures.

        Args:
            func: the function, given the actor's executable (None without one).
            name: the function's name, for errors.
            timeout: seconds after which the ranks still running are killed; None: no limit.

        Returns:
            The values, by rank.

        Raises:
            WorkerError: a rank raised or its actor died; names the root cause's rank.
            TimeoutError: ``timeout`` passed; names the ranks still running.
        """
        workers = self.workers
        refs = {worker.call.remote(func, rank): rank for rank, worker in enumerate(workers)}
        pending = dict(refs)
        values: list[Any] = [None] * len(workers)
        failures: list[Outcome] = []
        start = time.monotonic()
        grace_end: float | None = None
        try:
            while pending:
                ends = [end for end in (grace_end, None if timeout is None else start + timeout) if end is not None]
                wait = None if not ends else max(0.0, min(ends) - time.monotonic())
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
                if not ready:
                    break
                for ref in ready:
                    rank = pending.pop(ref)
                    outcome = _outcome(ref, rank)
                    if outcome.ok:
                        values[rank] = outcome.value
                        continue
                    failures.append(outcome)
                    self._broken = True
                    ray.kill(workers[rank])  # its peers' collectives fail now instead of waiting
                    grace_end = grace_end or time.monotonic() + FAILURE_GRACE_S
        except BaseException:
            self._broken = True
            self._kill_all()
            raise
        if pending:  # the grace or the timeout ran out
            self._broken = True
            for rank in pending.values():
                ray.kill(workers[rank])
            still = sorted(pending.values())
            if not failures:
                raise TimeoutError(
                    f"hora.ray: {name} did not finish within {timeout:g} s on {len(workers)} ranks; ranks still "
                    f"running: {', '.join(map(str, still))} (every worker was stopped and will be replaced)"
                )
            failures.extend(Outcome.gone(rank, f"still running {FAILURE_GRACE_S:g} s after the failure: stopped")
                            for rank in still)  # fmt: skip
        if failures:
            error = WorkerError(name, len(workers), failures, [slot.hostname for slot in self._slots])
            raise error from error.cause
        return values

    def call_async(self, func: Callable[[Any], Any]) -> list[ray.ObjectRef[Any]]:
        """Starts ``func(executable)`` on every rank; returns the ObjectRefs, by rank."""
        return [worker.execute.remote(func) for worker in self.workers]


def _outcome(ref: ray.ObjectRef[Any], rank: int) -> Outcome:
    """Reads one rank's outcome; a dead actor or a value Ray could not send is a failure."""
    try:
        outcome = ray.get(ref)
    except ray.exceptions.RayActorError as error:
        return Outcome.gone(rank, f"its Ray actor died: {error}")
    except ray.exceptions.RayError as error:  # e.g. the return value could not be serialized
        return Outcome(rank, summary=f"{type(error).__name__}: {error}", traceback=str(error))
    assert isinstance(outcome, Outcome)
    return outcome


def _get(refs: list[Any], timeout: float, what: str) -> list[Any]:
    try:
        return list(ray.get(refs, timeout=timeout))
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"hora.ray: the workers did not {what} within {timeout:g} s") from None
