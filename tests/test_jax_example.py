"""The JAX example, run for real through horarun."""

from __future__ import annotations

import pytest

from harness import check_digits_example

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(240)
def test_flax_digits_example_reaches_95_percent_on_two_ranks() -> None:
    check_digits_example("examples/jax/flax_digits.py")
