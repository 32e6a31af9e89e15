"""The main loop as a Prefect flow: build envs → difficulty → rollouts → store → train → publish → evaluate.

Run it: ``python -m flows.post_train --config configs/quickstart.toml`` (``make run`` does this
after bringing up the local services). Each stage is a Prefect task; stages pass URIs. Re-running
the same ``run_id`` resumes after the last published checkpoint.
"""

from __future__ import annotations

import sys
import time

from prefect import flow

from flows.cli import preflight
from infra.checkpoint import checkpoint_uri
from infra.config import RunConfig
from infra.evaluate import PrecisionMismatch
from tasks.build_envs import build_envs, materialize_task_images, task_image_assets
from tasks.difficulty import refresh_difficulty
from tasks.evaluate import evaluate
from tasks.lineage import as_asset
from tasks.policy import prepare_policy
from tasks.publish import export_weights, hot_load, load_colocated, load_direct, publish_checkpoint
from tasks.report import record_step
from tasks.rollouts import rollouts_for_step
from tasks.runtime import runtime
from tasks.train import save_trainer_state, train_step

DEFAULT_CONFIG = RunConfig()


@flow(name="post_train", log_prints=True)
def post_train(config: RunConfig = DEFAULT_CONFIG) -> list[dict]:
    """Run ``config.steps`` GRPO steps of agentic RL post-training; returns one summary per step run.

    Summary keys: step, time_to_batch_s, reward_mean, outcomes, infra_reasons (reason code -> count),
    retried, sandbox_warm, sandbox_acquire_p50_s, policy_lag_max, the mismatch and
    importance-sampling metrics (logprob_abs_diff, kl_k1, kl_k3, ratio_p05/p95, tis_capped_frac,
    tis_masked_frac), rows_with_signal, checkpoint, eval_pass_at_1, per-stage seconds, rows
    dropped/down-weighted for divergence, and with the async collector: episode_s_p50/p90/max,
    straggler_tail_s, engine_idle_s, generation_tokens_per_s, groups_carried_in, groups_dropped,
    policy_lag_hist (lag in versions -> groups).
    """
    check_eval_precision(config)
    preflight(config)  # S3, Docker, task sources, model: a bad one fails here, before any task or write
    catalog_uri = build_envs(config)
    materialize_task_images(config, catalog_uri)
    policy = prepare_policy(config)
    s = config.storage
    summaries = []
    upload = None  # background upload of the last version (direct and colocated patterns)
    for step in range(policy["next_step"], config.steps):
        t0 = time.monotonic()
        selection = refresh_difficulty(config, catalog_uri, step)
        t1 = time.monotonic()
        traj_uri = f"s3://{s.bucket}/{s.prefix}/{config.run_id}/trajectories/step-{step:06d}.parquet"
        deps = task_image_assets(config, catalog_uri, selection["chosen"])
        rollouts = rollouts_for_step(config, catalog_uri, selection["chosen"], step, deps, policy["version"])
        t2 = time.monotonic()
        metrics = train_step(config, rollouts["uri"])
        version = step + 1
        state_s = save_trainer_state(config, version) if config.train.save_optimizer_state else 0.0
        t3 = time.monotonic()
        ckpt = checkpoint_uri(s.bucket, s.prefix, config.run_id, version)
        if upload is not None:
            upload.result()  # the previous version's background upload (raises if it failed)
        t_publish = time.monotonic()
        loaded, upload = publish_version(config, ckpt, version, step, traj_uri)
        t4 = time.monotonic()
        report = None
        if config.eval.enabled and not loaded["refused"]:  # a refused version was not loaded: nothing to evaluate
            previous = f"{checkpoint_uri(s.bucket, s.prefix, config.run_id, version - 1)}/eval.json"
            report = as_asset(evaluate, f"{ckpt}/eval.json", [ckpt])(config, catalog_uri, f"{ckpt}/eval.json",
                                                                    previous)
        t5 = time.monotonic()
        summary = {
            "step": step, "time_to_batch_s": round(rollouts["time_to_batch_s"], 2),
            "reward_mean": round(rollouts["reward_mean"], 4), "outcomes": rollouts["outcomes"],
            "infra_reasons": rollouts["infra_reasons"], "retried": rollouts["retried"],
            "sandbox_warm": rollouts["sandbox_warm"],
            "sandbox_acquire_p50_s": round(rollouts["sandbox_acquire_p50_s"], 3),
            "rows": rollouts["rows"], "rollouts_reused": rollouts["reused"],
            "policy_lag_max": metrics["policy_lag_max"],
            "logprob_abs_diff": metrics["logprob_abs_diff"], "kl_k1": metrics["kl_k1"], "kl_k3": metrics["kl_k3"],
            "ratio_p05": metrics["ratio_p05"], "ratio_p95": metrics["ratio_p95"],
            "tis_capped_frac": metrics["tis_capped_frac"], "tis_masked_frac": metrics["tis_masked_frac"],
            "rows_with_signal": metrics["rows_with_signal"], "optimizer_step": metrics["optimizer_step"],
            "trainer_state_s": round(state_s, 2), "trainer_state_restored": runtime(config).trainer_restored,
            "checkpoint": ckpt, "policy_version": loaded["version"], "publish_pattern": config.publish.pattern,
            "publish_latency_s": round(t4 - t_publish, 3), "upload_wait_s": round(t_publish - t3, 3),
            "reload_pause_s": round(loaded["pause_s"], 3),
            "publish_transfer_s": round(loaded["transfer_s"], 3), "checkpoint_refused": loaded["refused"],
            "eval_pass_at_1": report.get("pass_at_1") if report else None,
            "eval_pass_at_k": report["pass_at_k"] if report else {},
            "eval_delta": report.get("compared_to", {}).get("pass_at_k_delta", {}) if report else {},
            "difficulty_s": round(t1 - t0, 2), "rollout_s": round(t2 - t1, 2), "train_s": round(t3 - t2, 2),
            "publish_s": round(t4 - t3, 2), "eval_s": round(t5 - t4, 2),
            "rows_dropped_divergence": metrics["rows_dropped_divergence"],
            "rows_downweighted_divergence": metrics["rows_downweighted_divergence"],
        }
        sched = rollouts.get("scheduling") or {}
        for key in ("episode_s_p50", "episode_s_p90", "episode_s_max", "straggler_tail_s", "engine_idle_s",
                    "generation_tokens_per_s", "prefix_cache_hit_rate", "groups_carried_in", "groups_dropped"):
            if key in sched:
                summary[key] = round(sched[key], 3)
        summary["policy_lag_hist"] = {int(k.rsplit("_", 1)[1]): v for k, v in sched.items()
                                      if k.startswith("lag_hist_")}
        summaries.append(summary)
        print(format_summary(summary))
        record_step(config, summary)
    if upload is not None:
        upload.result()
    return summaries


def publish_version(config: RunConfig, ckpt: str, version: int, step: int, traj_uri: str):
    """Get ``version`` to the engine by ``config.publish.pattern``; returns (load result, upload future or None).

    storage: upload (manifest last), then fetch, verify and load. direct / colocated: the engine
    loads first (pulled over HTTP and verified / from memory) and the S3 upload is submitted to
    run in the background; the caller waits on it before the next publication.
    """
    pattern = config.publish.pattern
    publish = as_asset(publish_checkpoint, ckpt, [traj_uri])
    if pattern == "storage":
        publish(config, ckpt, version, step)
        return hot_load(config, ckpt), None
    if pattern == "direct":
        export_dir = export_weights(config, version)
        loaded = load_direct(config, export_dir, version)
    else:
        loaded = load_colocated(config, version)
        export_dir = export_weights(config, version)
    return loaded, publish.submit(config, ckpt, version, step, export_dir)


def format_summary(s: dict) -> str:
    """One line per step for the terminal."""
    outcomes = " ".join(f"{k}={v}" for k, v in sorted(s["outcomes"].items()))
    infra = " ".join(f"{k}={v}" for k, v in sorted(s.get("infra_reasons", {}).items()))
    if infra:
        outcomes += f" infra_reasons({infra}) retried={s.get('retried', 0)}"
    pass1 = " ".join(f"pass@{k}={v:.3f}" for k, v in s.get("eval_pass_at_k", {}).items()) or "n/a"
    if s.get("eval_delta"):
        pass1 += " (vs previous: " + " ".join(f"{v:+.3f}" for v in s["eval_delta"].values()) + ")"
    return (f"step {s['step']}: time_to_batch={s['time_to_batch_s']:.1f}s reward_mean={s['reward_mean']:.3f} "
            f"outcomes[{outcomes}] policy_lag_max={s['policy_lag_max']:.0f} "
            f"logprob_mismatch={s['logprob_abs_diff']:.2e} kl_k3={s['kl_k3']:.1e} "
            f"ratio_p05/p95={s['ratio_p05']:.3f}/{s['ratio_p95']:.3f} capped={s['tis_capped_frac']:.3f} "
            f"masked={s['tis_masked_frac']:.3f} rows_with_signal={s['rows_with_signal']:.0f} "
            f"checkpoint={s['checkpoint']} publish[{s.get('publish_pattern', 'storage')}] "
            f"latency={s.get('publish_latency_s', 0):.1f}s pause={s.get('reload_pause_s', 0):.2f}s "
            f"eval {pass1} "
            + (f"episode_s p50/p90/max={s['episode_s_p50']:.1f}/{s['episode_s_p90']:.1f}/{s['episode_s_max']:.1f} "
               f"straggler_tail={s['straggler_tail_s']:.1f}s engine_idle={s['engine_idle_s']:.1f}s "
               f"gen_tok/s={s['generation_tokens_per_s']:.0f} prefix_hit={s['prefix_cache_hit_rate']:.2f} "
               f"carried_in={s['groups_carried_in']:.0f} "
               f"lag_hist={s['policy_lag_hist']} " if "episode_s_p50" in s else "")
            + f"divergence drop/down={s.get('rows_dropped_divergence', 0):.0f}/"
            f"{s.get('rows_downweighted_divergence', 0):.0f} "
            f"(stages s: difficulty {s['difficulty_s']} rollout {s['rollout_s']} train {s['train_s']} "
            f"publish+load {s['publish_s']} eval {s['eval_s']})")


def check_eval_precision(config: RunConfig) -> None:
    """post_train evaluates with its serving engine: refuse another ``eval.dtype``.

    Raises:
        PrecisionMismatch: ``eval.enabled`` with an ``eval.dtype`` other than the serving dtype.
    """
    if config.eval.enabled and config.eval.dtype not in ("serving", config.model.serving_dtype):
        raise PrecisionMismatch(f"eval.dtype={config.eval.dtype}: post_train evaluates with its serving engine "
                                f"({config.model.serving_dtype}); evaluate other precisions with flows.evaluate")


def main(argv: list[str] | None = None) -> int:
    """CLI: ``--config``, ``--run-id``, ``--steps``, ``--seed``, then the flow.

    The config and the run's inputs are checked before anything loads (one ``error:`` line and
    exit 2 on a bad one).
    """
    from flows.cli import run_flow_cli

    return run_flow_cli(post_train, __doc__, argv, precheck=check_eval_precision,
                        config_options=[("--steps", "steps", {"type": int, "help": "override config steps"}),
                                        ("--seed", "rollout.seed", {"type": int, "help": "override rollout.seed"})],
                        show=lambda summaries, config: print(f"post_train {config.run_id}: "
                                                             f"{len(summaries)} step(s) run"))


if __name__ == "__main__":
    sys.exit(main())
