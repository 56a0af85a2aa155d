"""``python -m hora.runner -np 2 COMMAND``: the same as ``horarun -np 2 COMMAND``."""

from __future__ import annotations

import sys

from hora.runner.cli import main

if __name__ == "__main__":
    sys.exit(main())
