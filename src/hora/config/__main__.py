"""``python -m hora.config DOC.md``: rewrites the knob tables of a document (``knobs.render``)."""

from __future__ import annotations

import sys

from hora.config import knobs


def main(argv: list[str]) -> int:
    """Rewrites the ``<!-- knobs: SECTION -->`` blocks of the one file named.

    Returns:
        0, or 2 for a usage error.
    """
    if len(argv) != 1:
        print("usage: python -m hora.config docs/configuration.md", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as handle:
        text = handle.read()
    with open(argv[0], "w", encoding="utf-8") as handle:
        handle.write(knobs.render(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
