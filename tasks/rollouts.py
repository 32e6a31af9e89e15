"""Prefect task: collect a step's rollouts and store them as one Parquet file (an asset)."""

from __future__ import annotations

import time

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.assets import add_asset_metadata
from prefect.cache_policies import NO_CACHE

from infra.config import RunConfig
from infra.environments import BASE_IMAGE
from infra.rollout.collector import Collector, CollectSettings
from infra.store import step_uri, write_step
from tasks.runtime import runtime


@task(name="collect_rollouts", cache_policy=NO_CACHE)
def collect_rollouts(config: RunConfig, catalog_uri: str, task_ids: list[str], step: int) -> dict:
    """Run G attempts per chosen task and write ``trajectories/step-N.parquet``.

    Run as a materializing task (the flow gives it the trajectory asset and the image assets as
    dependencies). Rewriting a step replaces its file, so a re-run never duplicates rows.

    Returns:
        ``{"uri", "rows", "time_to_batch_s", "outcomes": {outcome: count}, "reward_mean", "bytes",
        "min_policy_version", "infra_reasons": {reason code: count}, "retried" (rows that are retries),
        "sandbox_warm" (rows whose sandbox came from the warm pool), "sandbox_acquire_p50_s"}``.
    """
    rt = runtime(config)
    catalog = rt.load_catalog(catalog_uri)
    images = {e["task_id"]: (e["image"], e["image_digest"]) for e in catalog["tasks"] if e["usable"]}
    r = config.rollout
    settings = CollectSettings(r.group_size, r.temperature, r.top_p, r.max_tokens_per_turn, r.max_turns,
                               r.seed, r.max_infra_retries)
    collector = Collector(rt.engine, rt.backend, settings, code_image=BASE_IMAGE, pool=rt.sandbox_pool)
    progress = create_progress_artifact(0.0, description=f"step {step}: rollouts finished")
    start = time.monotonic()

    def on_progress(done: int, total: int) -> None:
        update_progress_artifact(progress, 100.0 * done / max(total, 1))

    rows = collector.collect(config.run_id, step, [rt.tasks[t] for t in task_ids], images, on_progress)
    uri = step_uri(config.storage.bucket, config.storage.prefix, config.run_id, step)
    size = write_step(rt.fs, uri, rows)
    elapsed = time.monotonic() - start
    update_progress_artifact(progress, 100.0)
    outcomes: dict[str, int] = {}
    infra_reasons: dict[str, int] = {}
    for row in rows:
        outcomes[row["outcome"]] = outcomes.get(row["outcome"], 0) + 1
        if row["outcome"] == "infra_failure":
            infra_reasons[row["reason"]] = infra_reasons.get(row["reason"], 0) + 1
    acquire = sorted(row["sandbox_acquire_s"] for row in rows if row["sandbox_id"])
    versions = sorted({row["min_policy_version"] for row in rows} | {row["max_policy_version"] for row in rows})
    add_asset_metadata(uri, {"rows": len(rows), "step": step, "policy_versions": versions, "bytes": size})
    return {"uri": uri, "rows": len(rows), "time_to_batch_s": elapsed, "outcomes": outcomes,
            "reward_mean": sum(row["reward"] for row in rows) / max(len(rows), 1), "bytes": size,
            "min_policy_version": min((row["min_policy_version"] for row in rows), default=-1),
            "infra_reasons": infra_reasons, "retried": sum(row["attempt"] > 0 for row in rows),
            "sandbox_warm": sum(row["sandbox_warm"] for row in rows),
            "sandbox_acquire_p50_s": acquire[len(acquire) // 2] if acquire else 0.0}
