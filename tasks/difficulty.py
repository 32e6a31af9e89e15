"""Prefect task: per-task pass rates from the trajectory store, and this step's task sample."""

from __future__ import annotations

import time
from dataclasses import replace

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.difficulty import pass_stats, select_tasks
from infra.run import Run
from infra.store import read_history
from infra.summary import Selection
from tasks.naming import stage_run_name


def select_step_tasks(run: Run, step: int) -> Selection:
    """The difficulty stage: :func:`refresh_difficulty`, its seconds (retries included) as ``stage_s``."""
    start = time.monotonic()
    return replace(refresh_difficulty(run, step), stage_s=time.monotonic() - start)


@task(name="refresh_difficulty", task_run_name=stage_run_name("refresh_difficulty"),
      cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def refresh_difficulty(run: Run, step: int) -> Selection:
    """Choose the step's training tasks from past pass rates (``infra.difficulty``).

    Pass rates count every attempt stored, trained or dropped (``read_history(include_dropped=True)``).
    """
    train_ids = [e.task_id for e in run.catalog.usable("train")]
    columns = ("task_id", "step", "reward", "outcome")
    hist = read_history(run.fs, run.layout, list(columns), include_dropped=True)  # skipped groups are attempts too
    records = list(zip(*(hist.column(c).to_pylist() for c in columns), strict=True))
    d, r = run.config.difficulty, run.config.rollout
    stats = pass_stats(records, d.window)
    sel = select_tasks(train_ids, stats, r.tasks_per_step, d.window, d.hopeless_min_attempts,
                       d.explore_min_attempts, seed=r.seed * 7919 + step, revisit_frac=d.revisit_frac)
    return Selection(sel.chosen, sel.skipped, sel.revisited,
                     {t: stats[t].pass_rate for t in sel.chosen if t in stats})
