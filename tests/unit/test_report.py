"""The run report: banner of what needs a look, real PNG plots, the narrow table with every step."""

from __future__ import annotations

import base64
import re

import pytest

from infra.report import NARROW_COLUMNS, attention, banner, narrow_table, render_report
from tests.unit.test_summary import summary as step_summary

# absent from summaries stored before they were recorded
NEW_KEYS = ("completion_tokens_mean", "turns_mean", "episode_time_s")


def _summary(step: int, **kw) -> dict:
    """A stored summary as ``StepSummary.to_json`` writes it after a JSON round trip (async collector)."""
    s = {"step": step, "time_to_batch_s": 10.0 + step, "reward_mean": 0.1 * step, "completion_tokens_mean": 40.0 + step,
         "turns_mean": 2.5, "outcomes": {"success": step, "model_failure": 8 - step}, "infra_reasons": {}, "retried": 0,
         "verifier_tampered": 0, "egress": {}, "side_calls": 0,
         "episode_time_s": {"sandbox_acquire_s": 1.0, "engine_queue_s": 0.5, "prefill_s": 1.0, "decode_s": 5.0,
                            "generation_other_s": 0.1, "tool_s": 2.0, "verify_s": 3.0, "overhead_s": 0.4,
                            "episode_s": 13.0},
         "sandbox_warm": 8, "sandbox_acquire_p50_s": 0.1, "rows": 8, "rollouts_reused": False, "policy_lag_max": 1.0,
         "logprob_abs_diff": 3e-6, "kl_k1": -2e-7, "kl_k3": 1e-9, "ratio_p05": 0.99, "ratio_p95": 1.01,
         "tis_capped_frac": 0.0, "tis_masked_frac": 0.001, "rows_with_signal": 4.0, "optimizer_step": 1.0,
         "rows_trained": 8.0, "segments_trained": 8.0, "update_norm": 0.00123, "trainer_state_s": 1.0,
         "trainer_state_restored": "",
         "checkpoint": f"s3://b/r/checkpoints/v{step + 1}", "policy_version": step + 1, "publish_pattern": "storage",
         "publish_latency_s": 1.0, "upload_wait_s": 0.0, "reload_pause_s": 0.5, "publish_transfer_s": 0.5,
         "checkpoint_refused": "", "eval_pass_at_1": 0.2 * step, "eval_pass_at_k": {"1": 0.2 * step},
         "eval_delta": {"1": 0.2} if step else {}, "difficulty_s": 1, "rollout_s": 10, "train_s": 5, "publish_s": 2,
         "eval_s": 3, "rows_dropped_divergence": 0.0, "rows_downweighted_divergence": 0.0, "episode_s_p50": 5.0,
         "episode_s_p90": 9.0, "episode_s_max": 11.0, "straggler_tail_s": 2.0, "engine_idle_s": 1.5,
         "generation_tokens_per_s": 40.0, "prefix_cache_hit_rate": 0.5, "groups_carried_in": 1, "groups_dropped": 0,
         "policy_lag_hist": {"0": 3, "1": 1},
         "metrics": {"rollout/dropped_stale": 0.0, "rollout/dropped_infra": 0.0}}
    return {**s, **kw}


def _old(step: int, **kw) -> dict:
    """A summary stored before the new keys (and, sync collector, without the scheduler's)."""
    return {k: v for k, v in _summary(step, **kw).items()
            if k not in NEW_KEYS and not k.startswith(("episode_s", "groups_")) and k != "metrics"}


def test_hand_built_summary_has_the_keys_to_json_writes():
    assert set(_summary(0)) == set(step_summary().to_json())


def test_all_clear():
    assert attention(_summary(3)) == []
    assert banner([_summary(3)]) == ["> ✅ **Step 3: all clear**: learned (rows_with_signal=4/8 update_norm=1.23e-03); "
                                     "no infra failures, dropped groups or refused checkpoint"]


def test_a_step_that_could_not_learn():
    flat = _summary(1, rows_with_signal=0.0, optimizer_step=0.0, update_norm=0.0)
    assert attention(flat) == ["did not learn (rows_with_signal=0/8: every group's rewards were equal, "
                               "optimizer step skipped)"]
    stepped = _summary(1, rows_with_signal=0.0, update_norm=None)  # an older trainer stepped anyway
    assert attention(stepped) == ["no row carried signal, yet the optimizer stepped: learned (rows_with_signal=0/8)"]


def test_infra_failures_with_their_reasons():
    s = _summary(1, outcomes={"success": 5, "infra_failure": 3}, retried=2,
                 infra_reasons={"sandbox_lost": 1, "episode_deadline": 2})
    assert attention(s) == ["infra failures: 3 of 8 rows (episode_deadline 2, sandbox_lost 1), never trained on; "
                            "2 rows are retry attempts"]
    assert attention(_summary(1, infra_reasons={"sandbox_lost": 1})) == [
        "infra failures: 0 of 8 rows (sandbox_lost 1), never trained on; 0 rows are retry attempts"]


def test_tampered_verifier_rows_are_named():
    s = _summary(1, verifier_tampered=2)
    assert attention(s) == ["verifier tampered with: 2 of 8 rows (reason `verifier_tampered`: the agent changed the "
                            "verifier's toolchain, tests or reward; scored 0, see the episodes)"]


def test_refused_checkpoint():
    s = _summary(4, checkpoint_refused="sha256 mismatch", policy_version=4)
    assert attention(s) == ["checkpoint refused: sha256 mismatch; `s3://b/r/checkpoints/v5` was not loaded, the engine "
                            "still serves version 4 (eval skipped)"]


def test_dropped_groups_named_by_why():
    # 5 dropped = 2 stale + 1 infra + 2 zero-variance (next_batch's dropped list: self._dropped + stale + skipped)
    s = _summary(7, groups_dropped=5, groups_skipped_zero_variance=2,
                 metrics={"rollout/dropped_stale": 2.0, "rollout/dropped_infra": 1.0})
    assert attention(s) == ["5 groups dropped since the previous batch, never trained on: 2 stale (policy lag past "
                            "`max_policy_lag`), 1 after infra failures (retries spent, or `infra_policy` drop), "
                            "2 zero-variance (skipped by dynamic sampling); their rows are in "
                            "`dropped/step-000007.parquet`"]
    no_metrics = _summary(7, groups_dropped=1, metrics={})
    assert attention(no_metrics) == ["1 groups dropped since the previous batch, never trained on: 1 stale or after "
                                     "infra failures; their rows are in `dropped/step-000007.parquet`"]
    # dynamic sampling skipping zero-variance groups, and nothing else dropped: by design, all clear
    assert attention(_summary(7, groups_dropped=2, groups_skipped_zero_variance=2)) == []


def test_divergence_drops():
    s = _summary(2, rows_dropped_divergence=3.0, rows_downweighted_divergence=0.0)
    assert attention(s) == ["3 rows dropped for divergence (per-row KL estimate past `train.divergence_threshold`), "
                            "0 downweighted"]


def test_banner_lists_the_latest_step_then_earlier_ones_most_recent_first():
    flat = {"rows_with_signal": 0.0, "optimizer_step": 0.0, "update_norm": 0.0}
    rows = [_summary(0, **flat), _summary(1), _summary(2, rows_dropped_divergence=1.0),
            _summary(3, checkpoint_refused="no manifest", policy_version=3)]
    assert banner(rows) == [
        "> ⚠️ **Step 3 needs a look**",
        "> - checkpoint refused: no manifest; `s3://b/r/checkpoints/v4` was not loaded, the engine still serves "
        "version 3 (eval skipped)",
        ">",
        "> ⚠️ **2 earlier step(s) need a look**",
        "> - step 2: 1 rows dropped for divergence (per-row KL estimate past `train.divergence_threshold`), "
        "0 downweighted",
        "> - step 0: did not learn (rows_with_signal=0/8: every group's rewards were equal, optimizer step skipped)",
    ]


def test_banner_counts_earlier_steps_past_the_bound():
    rows = [_summary(i, rows_dropped_divergence=1.0) for i in range(13)] + [_summary(13)]
    lines = banner(rows)
    assert lines[2] == "> ⚠️ **13 earlier step(s) need a look**"
    assert [int(re.match(r"> - step (\d+):", x)[1]) for x in lines[3:-1]] == list(range(12, 2, -1))  # 10 listed
    assert lines[-1] == "> - and 3 earlier step(s): see the table"  # steps 0, 1, 2


def test_narrow_table_columns_and_values():
    rows = narrow_table([_summary(2), _old(0, eval_pass_at_1=None, eval_pass_at_k={}, update_norm=None,
                                           optimizer_step=0.0, rows_with_signal=0.0),
                         _summary(1, checkpoint_refused="bad", outcomes={"success": 1, "infra_failure": 2})])
    assert all(tuple(r) == NARROW_COLUMNS for r in rows) and len(NARROW_COLUMNS) == 14
    assert list(rows[0].values()) == ["2", "yes", "4/8", "0.200", "2", "0", "12.0", "1", "3.00e-06", "1.0e-09",
                                      "1.23e-03", "0.400", "+0.200", "3"]
    assert list(rows[1].values()) == ["0", "no", "0/8", "0.000", "0", "0", "10.0", "1", "3.00e-06", "1.0e-09",
                                      "n/a", "n/a", "n/a", "1"]
    assert (rows[2]["infra failures"], rows[2]["checkpoint version"]) == ("2", "2, new one refused")


def _images(md: str) -> list[tuple[str, bytes]]:
    found = re.findall(r"!\[([^\]]+)\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", md)
    return [(alt, base64.b64decode(data)) for alt, data in found]


def test_report_banner_first_seven_png_plots_then_a_row_per_step():
    md = render_report("run-x", [_summary(2), _summary(0), _summary(1, eval_pass_at_k={}, eval_pass_at_1=None)])
    assert md.splitlines()[2] == "> ✅ **Step 2: all clear**: learned (rows_with_signal=4/8 update_norm=1.23e-03); " \
                                 "no infra failures, dropped groups or refused checkpoint"
    images = _images(md)
    assert [alt for alt, _ in images] == ["reward curve", "policy lag histogram", "time to batch breakdown",
                                          "episode time breakdown", "mismatch and KL", "importance ratio", "episodes"]
    assert all(png[:8] == b"\x89PNG\r\n\x1a\n" for _, png in images)
    assert "| " + " | ".join(NARROW_COLUMNS) + " |" in md
    assert [int(m) for m in re.findall(r"^\| (\d+) \|", md, re.M)] == [0, 1, 2]  # sorted by step
    assert "| 1 | yes | 4/8 | 0.100 | 1 | 0 | 11.0 | 1 | 3.00e-06 | 1.0e-09 | 1.23e-03 | n/a | +0.200 | 2 |" in md
    assert "table artifact `run-x-steps-all`" in md


def test_old_summaries_without_the_new_keys_still_render():
    md = render_report("run-old", [_old(0), _old(1, policy_lag_hist={})])  # and a sync collector's: no lag histogram
    assert len(_images(md)) == 7 and "| 1 | yes | 4/8 |" in md


def test_empty_history():
    with pytest.raises(ValueError, match="run-z: no step summaries"):
        render_report("run-z", [])


def test_per_step_axes_tick_whole_steps_only():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from infra.report import _per_step

    def ticks(steps: list[int]) -> list[float]:
        fig, ax = plt.subplots()
        ax.plot(steps, [0.1] * len(steps))
        _per_step(ax, steps, "t")
        fig.canvas.draw()
        lo, hi = ax.get_xlim()
        plt.close(fig)
        return [t for t in ax.get_xticks() if lo <= t <= hi]

    assert ticks([0, 1, 2]) == [0.0, 1.0, 2.0]  # without the integer locator matplotlib ticks every 0.25
    assert ticks([5]) == [5.0]  # one step: one tick, not -0.5 ... 0.5 by tenths
