"""StepSummary: one step's stage records rendered as the stored JSON, namespaced metrics and the step line."""

from __future__ import annotations

from dataclasses import dataclass, replace

from prefect.assets import Asset
from prefect.context import AssetContext

from infra.layout import RunLayout
from infra.summary import EvalResult, PublishResult, RolloutStats, Selection, StepSummary, TrainStats

# The flat keys every stored summary had before the records (flows/post_train.py at fd6c360), async collector.
STORED_KEYS = {
    "step", "time_to_batch_s", "reward_mean", "outcomes", "infra_reasons", "retried", "sandbox_warm",
    "sandbox_acquire_p50_s", "rows", "rollouts_reused", "policy_lag_max", "logprob_abs_diff", "kl_k1", "kl_k3",
    "ratio_p05", "ratio_p95", "tis_capped_frac", "tis_masked_frac", "rows_with_signal", "optimizer_step",
    "trainer_state_s", "trainer_state_restored", "checkpoint", "policy_version", "publish_pattern",
    "publish_latency_s", "upload_wait_s", "reload_pause_s", "publish_transfer_s", "checkpoint_refused",
    "eval_pass_at_1", "eval_pass_at_k", "eval_delta", "difficulty_s", "rollout_s", "train_s", "publish_s", "eval_s",
    "rows_dropped_divergence", "rows_downweighted_divergence", "episode_s_p50", "episode_s_p90", "episode_s_max",
    "straggler_tail_s", "engine_idle_s", "generation_tokens_per_s", "prefix_cache_hit_rate", "groups_carried_in",
    "groups_dropped", "policy_lag_hist",
}
ADDED_KEYS = {"rows_trained", "update_norm", "segments_trained",  # since the step line says whether the step learned
              "completion_tokens_mean", "turns_mean",  # since the report plots response length and turns
              "verifier_tampered",  # since verification detects tampering
              "episode_time_s",  # since the report splits an episode's wall time
              "egress",  # since sandboxes reach the outside through the egress proxy
              "side_calls"}  # since installed agents make calls that are answered but not trained on
TRAIN = {"rows_trained": 8.0, "rows_with_signal": 4.0, "optimizer_step": 1.0, "loss": -0.5, "grad_norm": 0.25,
         "logprob_abs_diff": 2e-5, "kl_k1": 1e-6, "kl_k3": 3e-6, "tis_capped_frac": 0.0, "tis_masked_frac": 0.0,
         "ratio_p05": 0.999, "ratio_p50": 1.0, "ratio_p95": 1.001, "rows_dropped_divergence": 0.0,
         "rows_downweighted_divergence": 0.0}
SCHED = {"time_to_batch_s": 12.3456, "episode_s_p50": 5.0, "episode_s_p90": 9.0, "episode_s_max": 11.0,
         "straggler_tail_s": 2.0, "engine_idle_s": 1.5, "generation_tokens_per_s": 40.0, "prefix_cache_hit_rate": 0.5,
         "groups_carried_in": 1, "groups_dropped": 0, "lag_hist_0": 3, "lag_hist_1": 1}


def summary(trained: TrainStats | None = None, sched: dict = SCHED) -> StepSummary:
    batch = RolloutStats("s3://b/r/trajectories/step-000002.parquet", 16, 12.3456, 0.25, {"success": 4,
                         "model_failure": 12}, {}, 0, 16, 0.4321, 1000, 1, 2, 1.0e9, sched, stage_s=13.0)
    trained = trained or TrainStats(TRAIN, 1.0, 2.5, "v2", stage_s=20.0)
    published = PublishResult("s3://b/r/checkpoints/v3", 3, "storage", 0.5, 2.0, latency_s=3.25, upload_wait_s=0.0,
                              stage_s=3.5)
    report = {"pass_at_1": 0.5, "pass_at_k": {"1": 0.5}, "compared_to": {"pass_at_k_delta": {"1": 0.25}}}
    return StepSummary.of(2, Selection(["t"], {}, [], {}, 0.125), batch, trained, published,
                          EvalResult(report, stage_s=4.0))


def test_stored_summary_keeps_every_key_it_had():
    stored = summary().to_json()
    assert set(stored) - {"metrics"} == STORED_KEYS | ADDED_KEYS
    # rounded as before: time to batch to 2 places, reward to 4, acquire to 3; the lag histogram by int lag
    assert (stored["time_to_batch_s"], stored["reward_mean"], stored["sandbox_acquire_p50_s"]) == (12.35, 0.25, 0.432)
    assert stored["policy_lag_hist"] == {0: 3, 1: 1} and stored["difficulty_s"] == 0.12
    assert (stored["eval_pass_at_1"], stored["eval_delta"], stored["policy_version"]) == (0.5, {"1": 0.25}, 3)


def test_response_length_and_turns_are_stored_rounded():
    stored = StepSummary.of(2, summary().selection, replace(summary().batch, completion_tokens_mean=123.456,
                                                            turns_mean=2.3333), summary().trained,
                            summary().published, summary().evaluated).to_json()
    assert (stored["completion_tokens_mean"], stored["turns_mean"]) == (123.46, 2.33)
    assert stored["metrics"]["rollout/completion_tokens_mean"] == 123.456


class _Files:
    """A store that keeps what is written (``pipe_file``), by URI."""

    def __init__(self):
        self.files: dict[str, bytes] = {}

    def pipe_file(self, uri: str, data: bytes) -> None:
        self.files[uri] = data


def test_store_step_means_over_episodes_that_ran_to_an_end():
    from types import SimpleNamespace

    from tasks.rollouts import store_step
    from tests.helpers import make_row

    rows = [make_row(episode_id="e0", completion_tokens=10, num_turns=1),
            make_row(episode_id="e1", completion_tokens=30, num_turns=4, outcome="model_failure", reward=0.0,
                     policy_versions=[-1, -1, 0, 4], min_policy_version=0),
            make_row(episode_id="e2", completion_tokens=0, num_turns=0, outcome="infra_failure", reason="sandbox_lost",
                     reward=0.0)]
    rows = [{**r, "sandbox_warm": True} for r in rows]
    base = "s3://b/runs/other/checkpoints/v3"  # version 0 of a run started from another run's checkpoint
    run = SimpleNamespace(layout=RunLayout("b", "runs", "r"), fs=_Files(),
                          policy_asset=lambda v: RunLayout("b", "runs", "r").checkpoint(v) if v else base)

    def materializing(step: int) -> AssetContext:  # store_step records asset metadata, as in collect_rollouts
        return AssetContext(downstream_assets={Asset(key=run.layout.trajectories(step))})

    with materializing(0) as ctx:
        stats = store_step(run, 0, rows, [], {}, 1.5)
    # sampled tokens by version (make_row: versions [-1, -1, 3, 4], e1's [-1, -1, 0, 4]): v0 1, v3 2, v4 3,
    # infra failures' tokens included (they are in the file); each version is an input of the file
    assert stats.policy_version_tokens == {0: 1, 3: 2, 4: 3}
    v3, v4 = run.layout.checkpoint(3), run.layout.checkpoint(4)
    assert {a.key for a in ctx.direct_asset_dependencies} == {base, v3, v4}
    assert ctx.materialization_metadata[run.layout.trajectories(0)]["policy_version_tokens"] == {base: 1, v3: 2,
                                                                                                v4: 3}
    # the infra failure is left out: (10 + 30) / 2 = 20 tokens, (1 + 4) / 2 = 2.5 turns
    assert (stats.completion_tokens_mean, stats.turns_mean) == (20.0, 2.5)
    assert (stats.reward_mean, stats.outcomes, stats.infra_reasons) == (1 / 3, {"success": 1, "model_failure": 1,
                                                                               "infra_failure": 1}, {"sandbox_lost": 1})
    # the mean finished episode by part (make_row: 0.5 s, of which generation 0.2 = queue 0.02 + prefill 0.05 +
    # decode 0.1 + 0.03 ours, acquire 0.1, verification 0.1, no tools: 0.1 overhead)
    split = stats.episode_time_s
    assert {k: round(v, 6) for k, v in split.items()} == {
        "sandbox_acquire_s": 0.1, "engine_queue_s": 0.02, "prefill_s": 0.05, "decode_s": 0.1,
        "generation_other_s": 0.03, "tool_s": 0.0, "verify_s": 0.1, "overhead_s": 0.1, "episode_s": 0.5}
    assert abs(sum(v for k, v in split.items() if k != "episode_s") - split["episode_s"]) < 1e-9
    with materializing(1):
        empty = store_step(run, 1, [], [], {}, 0.5)
    assert (empty.completion_tokens_mean, empty.turns_mean, empty.episode_time_s) == (0.0, 0.0, {})


def test_step_line_as_printed():
    line = summary().line()
    assert line.startswith("step 2: learned (rows_with_signal=4/8) | time_to_batch=12.3s reward_mean=0.250 "
                           "outcomes[model_failure=12 success=4] "
                           "policy_lag_max=1 logprob_mismatch=2.00e-05 kl_k3=3.0e-06 ")
    assert "masked=0.000 checkpoint=s3://b/r/checkpoints/v3 publish[storage] latency=3.2s pause=0.50s" in line
    assert "eval pass@1=0.500 (vs previous: +0.250) episode_s p50/p90/max=5.0/9.0/11.0" in line
    assert line.endswith("(stages s: difficulty 0.12 rollout 13.0 train 20.0 publish+load 3.5 eval 4.0)")


def test_sample_lag_and_partial_groups_are_stored_and_printed():
    partial = {"sample_lag_mean": 0.4012, "sample_lag_max": 1, "batch_samples": 16, "groups_split": 2,
               "samples_carried": 3, "remainder_parts": 1, "dropped_stale_samples": 4,
               "dropped_stale_reward_mean": 0.125}
    s = summary(sched={**SCHED, **partial})
    assert {k: s.to_json()[k] for k in partial} == {**partial, "sample_lag_mean": 0.401,
                                                    "dropped_stale_reward_mean": 0.125}
    assert "sample_lag mean/max=0.40/1 partial split/carried/parts=2/3/1 stale_cut=4 reward 0.125 " in s.line()
    assert "sample_lag" not in summary().line() and "partial" not in summary().line()
    assert "stale_cut" not in summary().line()


def test_step_line_says_whether_the_step_learned():
    moved = summary(TrainStats({**TRAIN, "update_norm": 0.00123}, 1.0, 2.5, "v2")).line()
    assert moved.startswith("step 2: learned (rows_with_signal=4/8 update_norm=1.23e-03) | ")
    flat = {**TRAIN, "rows_with_signal": 0.0, "optimizer_step": 0.0, "grad_norm": 0.0, "update_norm": 0.0}
    assert summary(TrainStats(flat, 1.0, 2.5, "v2")).line().startswith(
        "step 2: did not learn (rows_with_signal=0/8: every group's rewards were equal, optimizer step skipped) | ")


def test_metrics_are_namespaced_and_a_new_field_needs_only_its_record():
    m = summary().metrics()
    assert m["rollout/reward_mean"] == 0.25 and m["rollout/outcome/success"] == 4.0
    assert m["rollout/generation_tokens_per_s"] == 40.0 and m["train/grad_norm"] == 0.25
    assert m["publish/latency_s"] == 3.25 and m["eval/pass_at_1"] == 0.5
    assert (m["time/rollout_s"], m["time/train_s"], m["time/eval_s"]) == (13.0, 20.0, 4.0)
    assert all("/" in k for k in m)

    @dataclass(frozen=True)
    class TrainWithSpikes(TrainStats):
        grad_spikes: int = 0

    m = summary(TrainWithSpikes(TRAIN, 1.0, 2.5, "v2", stage_s=20.0, grad_spikes=3)).metrics()
    assert m["train/grad_spikes"] == 3.0
    assert summary(TrainWithSpikes(TRAIN, 1.0, 2.5, "v2", grad_spikes=3)).to_json()["metrics"]["train/grad_spikes"] == 3


def test_mismatch_at_lag_0_is_stored_and_printed_apart():
    s = summary(TrainStats({**TRAIN, "logprob_abs_diff_lag0": 1e-6, "lag0_token_frac": 0.4}, 1.0, 2.5, "v2"))
    assert s.to_json()["logprob_abs_diff_lag0"] == 1e-6 and s.to_json()["lag0_token_frac"] == 0.4
    assert "logprob_mismatch=2.00e-05 (lag-0 tokens: 1.00e-06 over 0.40) kl_k3=" in s.line()
    assert "lag-0" not in summary().line()
