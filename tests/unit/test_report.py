"""The run report: every plot is a real PNG embedded in the markdown, the table has every step."""

from __future__ import annotations

import base64
import re

import pytest

from infra.report import render_report


def _summary(step: int, **kw) -> dict:
    s = {"step": step, "time_to_batch_s": 10.0 + step, "reward_mean": 0.1 * step, "outcomes": {"success": step},
         "policy_lag_max": 1, "logprob_abs_diff": 3e-6, "kl_k3": 1e-9, "checkpoint": f"s3://b/r/v{step + 1}",
         "difficulty_s": 1, "rollout_s": 10, "train_s": 5, "publish_s": 2, "eval_s": 3,
         "eval_pass_at_k": {"1": 0.2 * step}, "policy_lag_hist": {"0": 3, "1": 1}}
    return {**s, **kw}


def test_report_embeds_four_png_plots_and_a_row_per_step():
    md = render_report("run-x", [_summary(2), _summary(0), _summary(1, eval_pass_at_k={})])
    images = re.findall(r"!\[([^\]]+)\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", md)
    assert [alt for alt, _ in images] == ["reward curve", "policy lag histogram", "time to batch breakdown",
                                          "mismatch"]
    for _, data in images:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    steps = [int(m) for m in re.findall(r"^\| (\d+) \|", md, re.M)]
    assert steps == [0, 1, 2]  # sorted by step
    assert "| 1 | 11.0 | 0.100 | success 1 |" in md and "n/a" in md


def test_report_without_lag_histogram_and_empty_history():
    md = render_report("run-y", [_summary(0, policy_lag_hist={})])
    assert md.count("data:image/png;base64,") == 4
    with pytest.raises(ValueError, match="run-z: no step summaries"):
        render_report("run-z", [])
