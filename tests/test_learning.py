"""The learning benchmark: its summary math (unit), and the learning run itself (slow, not in CI)."""

from __future__ import annotations

import os
import time

import pytest

from benchmarks.learning_curve import reward_curve, run_seed, summarize


def test_summarize_first_and_last_window():
    # seed 0: 0.1 -> 0.5 (gain 0.4); seed 1: 0.2 -> 0.3 (gain 0.1); mean gain 0.25
    s = summarize({0: [0.0, 0.2, 0.4, 0.6], 1: [0.2, 0.2, 0.3, 0.3]}, window=2)
    assert s["first_mean"] == pytest.approx(0.15) and s["last_mean"] == pytest.approx(0.4)
    assert (s["gain_mean"], s["gain_min"], s["gain_max"]) == pytest.approx((0.25, 0.1, 0.4))


@pytest.mark.slow
@pytest.mark.integration
def test_grpo_raises_mean_reward_on_simple_code(services_env):
    """SmolLM2-135M on configs/learn-simple.toml: the last steps' reward beats the first steps' (seed 0)."""
    steps = int(os.environ.get("AGENTRL_LEARN_STEPS", "10"))
    run_id = f"learn-test-{time.strftime('%Y%m%d-%H%M%S')}"
    run_seed("configs/learn-simple.toml", run_id, seed=0, steps=steps)
    curve = reward_curve("agentrl", "runs", run_id)
    assert len(curve) == steps
    assert summarize({0: curve}, window=3)["gain_mean"] > 0, curve
