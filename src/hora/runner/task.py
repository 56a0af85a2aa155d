"""The program each rank of ``hora.run`` executes: ``python -m hora.runner.task DIR``.

``DIR`` holds what ``hora.run`` wrote: ``payload`` (the cloudpickled
``(func, args, kwargs)``) and ``sys_path.json`` (the caller's ``sys.path``, so that
functions pickled by reference to the caller's modules import here too). The rank
(``HORA_RANK``, or the MPI launcher's rank under ``mpirun``) calls the function and writes
``DIR/result.<rank>``: the cloudpickled return value, under the rank hora has when the
function returns if it is initialized then (an elastic job's rank changes with its
world), else under the rank it started as. If loading, calling or pickling raises, it writes the traceback to
``DIR/error.<rank>``, prints it on stderr and exits 1. Files appear atomically
(written under a temporary name, then renamed).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Mapping, Sequence

import cloudpickle

from hora.config import knobs, launchers

PAYLOAD = "payload"
SYS_PATH = "sys_path.json"


def result_path(directory: str, rank: int) -> str:
    """Returns where rank ``rank`` writes its return value."""
    return os.path.join(directory, f"result.{rank}")


def error_path(directory: str, rank: int) -> str:
    """Returns where rank ``rank`` writes its traceback."""
    return os.path.join(directory, f"error.{rank}")


def _write(path: str, data: bytes) -> None:
    partial = f"{path}.partial"
    with open(partial, "wb") as handle:
        handle.write(data)
    os.replace(partial, path)


def _extend_sys_path(directory: str) -> None:
    with open(os.path.join(directory, SYS_PATH), encoding="utf-8") as handle:
        entries = json.load(handle)
    for entry in entries:
        if isinstance(entry, str) and entry not in sys.path:
            sys.path.append(entry)


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


def run_task(directory: str, rank: int) -> int:
    """Loads the payload in ``directory``, calls it and writes this rank's result.

    Args:
        directory: the directory ``hora.run`` prepared.
        rank: this rank.

    Returns:
        0 when the function returned and its result was written, 1 when anything
        raised (the traceback is in ``error.<rank>`` and on stderr).
    """
    try:
        _extend_sys_path(directory)
        with open(os.path.join(directory, PAYLOAD), "rb") as handle:
            func, args, kwargs = cloudpickle.load(handle)
        value = func(*args, **kwargs)
        data = cloudpickle.dumps(value)
        rank = _final_rank(rank)
    except Exception:  # the user's error: report it to hora.run, whatever it is
        text = traceback.format_exc()
        _write(error_path(directory, rank), text.encode("utf-8", errors="replace"))
        sys.stderr.write(text)
        sys.stderr.flush()
        return 1
    _write(result_path(directory, rank), data)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m hora.runner.task DIR``.

    Args:
        argv: ``[DIR]``; ``sys.argv[1:]`` when None.

    Returns:
        The exit code (2 when started without a directory or without a rank).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    rank = _launch_rank(os.environ)
    if len(args) != 1 or rank is None:
        print("usage: HORA_RANK=<rank> python -m hora.runner.task DIR (started by hora.run)", file=sys.stderr)
        return 2
    return run_task(args[0], rank)


if __name__ == "__main__":
    sys.exit(main())
