"""Horovod's basics are declared once (hora.core.basics) and every binding offers them as the same objects."""

from __future__ import annotations

import importlib

import pytest

from hora.core import basics

BINDINGS = ["hora.numpy", "hora.torch", "hora.torch.mpi_ops"]


def _check(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in basics.__all__:
        assert name in module.__all__, f"{module_name} does not export {name}"
        assert getattr(module, name) is getattr(basics, name), f"{module_name}.{name} is not hora.core.basics.{name}"
    assert len(module.__all__) == len(set(module.__all__)), f"{module_name}.__all__ repeats names"
    assert all(hasattr(module, name) for name in module.__all__)


@pytest.mark.parametrize("module_name", BINDINGS)
def test_every_binding_offers_the_basics(module_name: str) -> None:
    _check(module_name)


@pytest.mark.framework
def test_tensorflow_offers_the_basics() -> None:
    _check("hora.tensorflow")
