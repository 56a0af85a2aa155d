"""What hora's command lines (``horarun``, ``horarun doctor``, ``hora-bench``) share:
one-line usage errors with exit code 2, and number arguments checked against a range."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

USAGE_ERROR = 2


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``<prog>: error: ... (see <prog> --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def number(
    kind: type[int] | type[float], low: float, strict: bool = False, high: float | None = None
) -> Callable[[str], float]:
    """Makes an argparse type for numbers ``>= low`` (``> low`` when strict), ``<= high``.

    Raises (from the returned function):
        argparse.ArgumentTypeError: the text is not such a number.
    """
    wanted = f"{'an integer' if kind is int else 'a number'} {'>' if strict else '>='} {low:g}"
    if high is not None:
        wanted = f"{'an integer' if kind is int else 'a number'} in [{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected {wanted}") from None
        if not math.isfinite(value) or value < low or (strict and value == low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected {wanted}")
        return value

    return parse
