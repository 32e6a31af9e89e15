"""Prefect task: per-task pass rates from the trajectory store, and this step's task sample."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.config import RunConfig
from infra.difficulty import pass_stats, select_tasks
from infra.store import read_history
from tasks.runtime import runtime


@task(name="refresh_difficulty", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def refresh_difficulty(config: RunConfig, catalog_uri: str, step: int) -> dict:
    """Choose the step's training tasks from past pass rates.

    Returns:
        ``{"chosen": [task ids], "skipped": {task id: reason}, "revisited": [skipped task ids chosen anyway],
        "pass_rates": {task id: rate}}``.
    """
    rt = runtime(config)
    catalog = rt.load_catalog(catalog_uri)
    train_ids = [e["task_id"] for e in catalog["tasks"] if e["usable"] and e["split"] == "train"]
    s = config.storage
    hist = read_history(rt.fs, s.bucket, s.prefix, config.run_id, ["task_id", "step", "reward", "outcome"])
    records = list(zip(*(hist.column(c).to_pylist() for c in ("task_id", "step", "reward", "outcome")), strict=True))
    d = config.difficulty
    stats = pass_stats(records, d.window)
    sel = select_tasks(train_ids, stats, config.rollout.tasks_per_step, d.window, d.hopeless_min_attempts,
                       d.explore_min_attempts, seed=config.rollout.seed * 7919 + step, revisit_frac=d.revisit_frac)
    return {"chosen": sel.chosen, "skipped": sel.skipped, "revisited": sel.revisited,
            "pass_rates": {t: stats[t].pass_rate for t in sel.chosen if t in stats}}
