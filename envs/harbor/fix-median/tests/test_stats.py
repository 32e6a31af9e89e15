import importlib.util

import pytest


def _median():
    spec = importlib.util.spec_from_file_location("stats", "/app/stats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.median


@pytest.mark.parametrize("xs,want", [([3, 1, 2], 2), ([4, 1, 3, 2], 2.5), ([5], 5), ([1, 2], 1.5), ([7, 7, 1, 9], 7)])
def test_median(xs, want):
    assert _median()(xs) == want
