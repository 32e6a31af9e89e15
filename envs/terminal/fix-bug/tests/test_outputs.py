import importlib.util

import pytest


def _load():
    spec = importlib.util.spec_from_file_location("calc", "/app/calc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("a,b,want", [(5, 3, 2), (3, 5, -2), (10, 0, 10), (0, 7, -7), (2.5, 1.0, 1.5)])
def test_subtract(a, b, want):
    assert _load().subtract(a, b) == want


@pytest.mark.parametrize("a,b,want", [(2, 3, 5), (-1, 1, 0)])
def test_add_still_works(a, b, want):
    assert _load().add(a, b) == want


@pytest.mark.parametrize("a,b,want", [(2, 3, 6), (-2, 4, -8)])
def test_multiply_still_works(a, b, want):
    assert _load().multiply(a, b) == want
