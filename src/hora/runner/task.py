"""The program each rank of ``hora.run`` executes: ``python -m hora.runner.task [DIR]``.

It reads the job's call, ``payload`` (the cloudpickled ``(func, args, kwargs)``) and
``sys_path.json`` (the caller's ``sys.path``, so that functions pickled by reference to the
caller's modules import here too), from one of two places:

* **the store** (no argument; ``hora.run``): an authenticated key-value store that
  ``hora.run`` serves for the job (a ``RendezvousServer``, as Horovod serves the call
  from an HTTP store on the launcher), so ranks on any host reach it without a shared
  file system. The rank finds it at ``HORA_RUN_STORE_ADDR`` (else at
  ``HORA_RENDEZVOUS_ADDR``, the launcher's address the rank's host reaches) and
  ``HORA_RUN_STORE_PORT``, and proves ``HORA_RUN_SECRET`` (hex), which travels like the
  job secret, never on a command line. Each name is the key ``run/<name>``; a value
  larger than the store takes in one key goes in pieces, ``<key>/<i>`` and then
  ``<key>/count``, whose presence says every piece is there.
* **a directory** (``DIR``; hora's Spark tasks, whose rank runs beside them): files of
  those names, written atomically (under a temporary name, then renamed).

The rank (``HORA_RANK``, or the MPI launcher's rank under ``mpirun``) calls the function
and writes ``result.<rank>``: the cloudpickled return value, under the rank hora has when
the function returns if it is initialized then (an elastic job's rank changes with its
world), else under the rank it started as. If loading, calling or pickling raises, it
writes the traceback as ``error.<rank>``, prints it on stderr and exits 1.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import cloudpickle

from hora.config import knobs, launchers
from hora.transport.rendezvous import RendezvousClient

PAYLOAD = "payload"
SYS_PATH = "sys_path.json"
PIECE = 1 << 19  # bytes of one piece in the store: well under its limit for one value
STORE_TIMEOUT = 60.0  # seconds a rank tries to reach the store, and waits for a value


def result_name(rank: int) -> str:
    """The name rank ``rank``'s return value is written under."""
    return f"result.{rank}"


def error_name(rank: int) -> str:
    """The name rank ``rank``'s traceback is written under."""
    return f"error.{rank}"


def result_path(directory: str, rank: int) -> str:
    """Where rank ``rank`` writes its return value in directory mode."""
    return os.path.join(directory, result_name(rank))


def error_path(directory: str, rank: int) -> str:
    """Where rank ``rank`` writes its traceback in directory mode."""
    return os.path.join(directory, error_name(rank))


def store_key(name: str) -> str:
    """The store's key for ``name``."""
    return f"run/{name}"


def put_pieces(put: Callable[[str, bytes], None], name: str, data: bytes) -> None:
    """Stores ``data`` under ``name``'s key in pieces, the count last."""
    key = store_key(name)
    count = max(1, -(-len(data) // PIECE))
    for index in range(count):
        put(f"{key}/{index}", data[index * PIECE : (index + 1) * PIECE])
    put(f"{key}/count", str(count).encode())


def get_pieces(get: Callable[[str], bytes | None], name: str) -> bytes | None:
    """What ``put_pieces`` stored under ``name`` (read on the store's side), or None if absent."""
    key = store_key(name)
    count = get(f"{key}/count")
    if count is None:
        return None
    return b"".join(get(f"{key}/{index}") or b"" for index in range(int(count)))


class _Exchange(Protocol):
    """Where the rank reads the call and writes its outcome."""

    def read(self, name: str) -> bytes: ...

    def write(self, name: str, data: bytes) -> None: ...


class _Directory:
    def __init__(self, directory: str) -> None:
        self._directory = directory

    def read(self, name: str) -> bytes:
        with open(os.path.join(self._directory, name), "rb") as handle:
            return handle.read()

    def write(self, name: str, data: bytes) -> None:
        path = os.path.join(self._directory, name)
        partial = f"{path}.partial"
        with open(partial, "wb") as handle:
            handle.write(data)
        os.replace(partial, path)


class _Store:
    def __init__(self, client: RendezvousClient) -> None:
        self._client = client

    def read(self, name: str) -> bytes:
        key = store_key(name)
        (count,) = self._client.wait([f"{key}/count"], STORE_TIMEOUT)
        return b"".join(self._client.wait([f"{key}/{index}" for index in range(int(count))], STORE_TIMEOUT))

    def write(self, name: str, data: bytes) -> None:
        put_pieces(self._client.put, name, data)


def _final_rank(started_as: int) -> int:
    """This process's rank in hora when initialized (its last world's), else ``started_as``."""
    api = sys.modules.get("hora.core.api")  # never imported here: only the function can have
    if api is not None and api.is_initialized():
        return int(api.rank())
    return started_as


def _launch_rank(env: Mapping[str, str]) -> int | None:
    """The rank the launcher gave this process: ``HORA_RANK``, else an MPI launcher's; None if none."""
    try:
        rank = knobs.read("HORA_RANK", env)
        if rank is None:
            detected = launchers.detect(env)
            rank = None if detected is None else detected.rank
    except ValueError:
        return None
    return None if rank is None else int(rank)


def run_task(exchange: _Exchange, rank: int) -> int:
    """Reads the call, makes it and writes this rank's result.

    Args:
        exchange: where the call is and the outcome goes (the store or a directory).
        rank: this rank.

    Returns:
        0 when the function returned and its result was written, 1 when anything
        raised (the traceback is written as ``error.<rank>`` and on stderr).
    """
    try:
        for entry in json.loads(exchange.read(SYS_PATH)):
            if isinstance(entry, str) and entry not in sys.path:
                sys.path.append(entry)
        func, args, kwargs = cloudpickle.loads(exchange.read(PAYLOAD))
        value = func(*args, **kwargs)
        data = cloudpickle.dumps(value)
        rank = _final_rank(rank)
    except Exception:  # the user's error: report it to hora.run, whatever it is
        text = traceback.format_exc()
        sys.stderr.write(text)
        sys.stderr.flush()
        exchange.write(error_name(rank), text.encode("utf-8", errors="replace"))
        return 1
    exchange.write(result_name(rank), data)
    return 0


def _run_from_store(env: Mapping[str, str], rank: int) -> int:
    try:
        addr = knobs.read("HORA_RUN_STORE_ADDR", env) or knobs.read("HORA_RENDEZVOUS_ADDR", env)
        port, secret = knobs.read("HORA_RUN_STORE_PORT", env), knobs.read("HORA_RUN_SECRET", env)
    except ValueError as exc:
        print(f"hora.run: rank {rank}: {exc}", file=sys.stderr)
        return 2
    if not addr or not port or not secret:
        print(
            f"hora.run: rank {rank}: HORA_RUN_STORE_PORT, HORA_RUN_SECRET and the store's address are not all set "
            "(hora.run sets them)",
            file=sys.stderr,
        )
        return 2
    try:
        client = RendezvousClient(addr, int(port), bytes.fromhex(secret), STORE_TIMEOUT)
    except (OSError, TimeoutError) as exc:
        print(f"hora.run: rank {rank} cannot reach hora.run's store at {addr}:{port}: {exc}", file=sys.stderr)
        return 1
    with client:
        return run_task(_Store(client), rank)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m hora.runner.task [DIR]``.

    Args:
        argv: ``[]`` (the store) or ``[DIR]``; ``sys.argv[1:]`` when None.

    Returns:
        The exit code: 2 when started without a rank or the store's variables, 1 when
        the store cannot be reached or the function failed.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    rank = _launch_rank(os.environ)
    if len(args) > 1 or rank is None:
        print("usage: HORA_RANK=<rank> python -m hora.runner.task [DIR] (started by hora.run)", file=sys.stderr)
        return 2
    if args:
        return run_task(_Directory(args[0]), rank)
    return _run_from_store(os.environ, rank)


if __name__ == "__main__":
    sys.exit(main())
