"""The learning benchmark's run itself (slow, not in CI): GRPO raises the mean reward."""

from __future__ import annotations

import os
import time

import pytest

from benchmarks.learning_curve import reward_curve, run_seed, summarize, task_matched_gain


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


@pytest.mark.slow
@pytest.mark.integration
def test_grpo_raises_task_matched_pass_rate_on_multiturn_tasks(services_env):
    """SmolLM2-135M on configs/learn-agentic.toml (look-then-act terminal tasks in sandboxes, async
    collector): each task's pass rate in the second half of the steps beats its first half (seed 0)."""
    steps = int(os.environ.get("AGENTRL_LEARN_STEPS", "10"))
    run_id = f"learn-agentic-test-{time.strftime('%Y%m%d-%H%M%S')}"
    run_seed("configs/learn-agentic.toml", run_id, seed=0, steps=steps)
    assert len(reward_curve("agentrl", "runs", run_id)) == steps
    matched = task_matched_gain("agentrl", "runs", run_id, steps)
    assert matched["tasks"] >= 3 and matched["gain"] > 0, matched
