"""Prefect task: per-task pass rates from the trajectory store, and this step's task sample."""

from __future__ import annotations

import time
from dataclasses import replace

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from infra.difficulty import pass_stats, select_tasks
from infra.layout import artifact_key
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
    unverified = {e.task_id for e in run.catalog.usable("train") if e.validation == "unverified_reference"}
    columns = ("task_id", "step", "reward", "outcome")
    hist = read_history(run.fs, run.layout, list(columns), include_dropped=True)  # skipped groups are attempts too
    records = list(zip(*(hist.column(c).to_pylist() for c in columns), strict=True))
    d, r = run.config.difficulty, run.config.rollout
    stats = pass_stats(records, d.window)
    sel = select_tasks(train_ids, stats, r.tasks_per_step, d.window, d.hopeless_min_attempts,
                       d.explore_min_attempts, seed=r.seed * 7919 + step, revisit_frac=d.revisit_frac)
    selection = Selection(sel.chosen, sel.skipped, sel.revisited,
                          {t: stats[t].pass_rate for t in sel.chosen if t in stats})
    create_table_artifact(key=artifact_key(run.config.run_id, "difficulty"),
                          table=pool_rows(train_ids, stats, selection, unverified),
                          description=f"{run.config.run_id} step {step}: the training pool's pass rates (last "
                                      f"{d.window} attempts), the tasks chosen and those skipped, and why; "
                                      f"{len(train_ids)} usable, {len(unverified)} of them with an unverified "
                                      "reference (no reference solution: nothing shows their tests can be passed)")
    return selection


def pool_rows(train_ids: list[str], stats: dict, selection: Selection,
              unverified: set[str] | frozenset[str] = frozenset()) -> list[dict]:
    """One row per training task: attempts, pass rate, and this step's verdict (chosen, revisited, skipped: why).

    A task in ``unverified`` (usable without a reference solution, ``validation = "unverified_reference"``)
    has `` (unverified reference)`` after its id.
    """
    rows = []
    for t in sorted(train_ids):
        s = stats.get(t)
        verdict = ("revisited" if t in selection.revisited else "chosen" if t in selection.chosen
                   else f"skipped: {selection.skipped[t]}" if t in selection.skipped else "not sampled")
        name = t + (" (unverified reference)" if t in unverified else "")
        rows.append({"task": name, "attempts": s.attempts if s else 0,
                     "pass rate": round(s.pass_rate, 3) if s else "untried", "this step": verdict})
    return rows
