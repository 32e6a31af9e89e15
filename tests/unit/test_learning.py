"""The learning benchmark's summary math (the learning run itself is in tests/slow)."""

from __future__ import annotations

import pytest

from benchmarks.learning_curve import summarize


def test_summarize_first_and_last_window():
    # seed 0: 0.1 -> 0.5 (gain 0.4); seed 1: 0.2 -> 0.3 (gain 0.1); mean gain 0.25
    s = summarize({0: [0.0, 0.2, 0.4, 0.6], 1: [0.2, 0.2, 0.3, 0.3]}, window=2)
    assert s["first_mean"] == pytest.approx(0.15) and s["last_mean"] == pytest.approx(0.4)
    assert (s["gain_mean"], s["gain_min"], s["gain_max"]) == pytest.approx((0.25, 0.1, 0.4))
