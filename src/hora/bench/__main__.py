"""``python -m hora.bench``: the same as the ``hora-bench`` command."""

import sys

from hora.bench.cli import main

sys.exit(main())
