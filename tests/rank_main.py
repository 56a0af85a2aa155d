"""Entry point of one test rank: runs the pickled function, stores its result or traceback."""

import sys
import traceback
from pathlib import Path

import cloudpickle


def main() -> int:
    workdir = Path(sys.argv[1])
    environ = __import__("os").environ
    rank = environ.get("HORA_RANK", environ.get("RANK"))
    fn, args = cloudpickle.loads((workdir / "payload").read_bytes())
    try:
        value = fn(*args)
    except BaseException:  # noqa: BLE001 - report everything to the harness
        (workdir / f"error.{rank}").write_text(traceback.format_exc())
        return 1
    (workdir / f"result.{rank}").write_bytes(cloudpickle.dumps(value))
    return 0


if __name__ == "__main__":
    sys.exit(main())
