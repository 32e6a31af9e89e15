"""Prefect task: collect a step's rollouts and store them as one Parquet file (an asset)."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import assert_never

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.assets import add_asset_metadata

from infra.config import AsyncScheduler, SyncScheduler
from infra.rollout.scheduler import row_tokens_by_version
from infra.run import Run
from infra.store import write_step
from infra.summary import RolloutStats, egress_totals, episode_time_split
from tasks.lineage import as_asset, declare_inputs, policy_input
from tasks.naming import stage_run_name

ROLLOUTS_RESULT_KEY = "agentrl-rollouts/{parameters[run].config.run_id}/step-{parameters[step]}.pickle"


@task(name="collect_rollouts", task_run_name=stage_run_name("collect_rollouts"),
      persist_result=True, result_storage_key=ROLLOUTS_RESULT_KEY)
def collect_rollouts(run: Run, task_ids: list[str], step: int) -> RolloutStats:
    """Collect a batch of ``len(task_ids)`` complete groups and write ``trajectories/step-N.parquet``.

    Idempotent on run id and step: the result is persisted under ``ROLLOUTS_RESULT_KEY``, so a
    rerun of a step whose rollouts were stored (a run killed before its checkpoint was published)
    reuses them; :func:`rollouts_for_step` checks the stored file before trusting it. A failed
    collection is not served back (Prefect persists failures at random keys, not the templated one).

    ``rollout.scheduler`` of kind ``async`` (default): the run's :class:`~infra.rollout.scheduler.AsyncCollector`
    keeps up to ``ceil(tasks_per_step * overprovision)`` groups in flight; the chosen tasks (then, to
    fill that bound, extra groups of the same tasks) are submitted, and the first complete eligible
    groups form the batch, whatever step launched them. Groups dropped meanwhile (stale, or infra
    policy) are written to ``dropped/step-N.parquet``, never trained on. Kind ``sync``: a
    one-shot batch of exactly the chosen groups (``Collector.collect``).

    Run as a materializing task (:func:`rollouts_for_step` gives it the trajectory asset and the image
    assets as dependencies). Rewriting a step replaces its file, so a re-run never duplicates rows.
    """
    images = run.catalog.images()
    progress = create_progress_artifact(0.0, description=f"step {step}: rollouts finished")
    start = time.monotonic()

    def on_progress(done: int, total: int) -> None:
        update_progress_artifact(progress, 100.0 * done / max(total, 1))

    dropped_rows: list[dict] = []
    scheduling: dict = {}
    match run.config.rollout.scheduler:
        case SyncScheduler():
            rows = run.episode_runner().collect(run.config.run_id, step, [run.tasks[t] for t in task_ids], images,
                                                on_progress)
        case AsyncScheduler():
            rows, dropped_rows, scheduling = _collect_async(run, images, task_ids, step, on_progress)
        case other:
            assert_never(other)
    update_progress_artifact(progress, 100.0)
    return store_step(run, step, rows, dropped_rows, scheduling, time.monotonic() - start)


def store_step(run: Run, step: int, rows: list[dict], dropped_rows: list[dict], scheduling: dict,
               elapsed_s: float) -> RolloutStats:
    """Write a step's rows (and dropped groups) as Parquet and summarize them (see :func:`collect_rollouts`)."""
    uri = run.layout.trajectories(step)
    size = write_step(run.fs, uri, rows)
    if dropped_rows:
        write_step(run.fs, run.layout.dropped(step), dropped_rows)
    outcomes = Counter(row["outcome"] for row in rows)
    infra_reasons = Counter(row["reason"] for row in rows if row["outcome"] == "infra_failure")
    acquire = sorted(row["sandbox_acquire_s"] for row in rows if row["sandbox_id"])
    finished = [row for row in rows if row["outcome"] != "infra_failure"]  # episodes that ran to an end
    version_tokens = policy_version_tokens(rows)
    producers = {run.policy_asset(v): n for v, n in version_tokens.items()}
    declare_inputs(policy_input(run, v) for v in version_tokens)  # every policy that sampled a token of it
    add_asset_metadata(uri, {"rows": len(rows), "step": step, "policy_versions": sorted(version_tokens),
                             "policy_version_tokens": producers, "bytes": size,
                             "scheduling": {k: round(v, 4) for k, v in scheduling.items()}})
    return RolloutStats(
        uri=uri, rows=len(rows), time_to_batch_s=scheduling.get("time_to_batch_s", elapsed_s),
        reward_mean=sum(row["reward"] for row in rows) / max(len(rows), 1), outcomes=dict(outcomes),
        infra_reasons=dict(infra_reasons), retried=sum(row["attempt"] > 0 for row in rows),
        sandbox_warm=sum(row["sandbox_warm"] for row in rows),
        sandbox_acquire_p50_s=acquire[len(acquire) // 2] if acquire else 0.0, bytes=size,
        min_policy_version=min((row["min_policy_version"] for row in rows), default=-1),
        max_policy_version=max((row["max_policy_version"] for row in rows), default=-1),
        collected_at=time.time(), scheduling=scheduling,
        completion_tokens_mean=sum(row["completion_tokens"] for row in finished) / max(len(finished), 1),
        turns_mean=sum(row["num_turns"] for row in finished) / max(len(finished), 1),
        verifier_tampered=sum(row["reason"] == "verifier_tampered" for row in rows),
        episode_time_s=episode_time_split(rows), egress=egress_totals(rows),
        policy_version_tokens=version_tokens, side_calls=sum(row.get("side_calls") or 0 for row in rows))


def policy_version_tokens(rows: list[dict]) -> dict[int, int]:
    """Sampled tokens per policy version over ``rows`` (``policy_versions`` where ``loss_mask`` is 1)."""
    counts: Counter = Counter()
    for row in rows:
        counts.update(row_tokens_by_version({k: row[k] for k in ("policy_versions", "loss_mask")}))
    return dict(sorted(counts.items()))


def _collect_async(run: Run, images: dict, task_ids: list[str], step: int,
                   on_progress) -> tuple[list[dict], list[dict], dict]:
    """Submit this step's groups to the run's asynchronous collector and take one batch from it.

    With dynamic sampling the collector replaces each zero-variance group it skips by a refill
    (``{prefix}/{task}/r{k}``): this step's tasks in turn, passing over the tasks whose groups came back
    zero-variance in this batch while any other is left. Refills are not in the sandbox reservation:
    the warm pool keeps the declared demand per image ready (topped up after every acquire), and an
    acquire beyond it starts a sandbox cold (``WarmPool.acquire``), so a refill is slower, never refused.
    """
    sched = run.collector
    sched.runner.bind(run.config.run_id, step, images)
    room = sched.room()
    prefix = f"{run.config.run_id}/{step}"
    chosen = [(f"{prefix}/{t}", run.tasks[t]) for t in task_ids]
    extra = [(f"{prefix}/{t}/x{k}", run.tasks[t])
             for k, t in zip(range(max(0, room - len(chosen))), itertools.cycle(task_ids), strict=False)]
    groups = (chosen + extra)[:room]
    sched.runner.reserve_sandboxes([t for _, t in groups])  # this step's sandbox demand per image
    zero_variance: set[str] = set()  # task ids whose groups came back zero-variance in this batch
    turn, refills = itertools.count(), itertools.count()

    def refill(skipped) -> tuple[str, object] | None:
        zero_variance.add(skipped.task.task_id)
        if not task_ids:
            return None
        for _ in task_ids:  # the next task in turn, not zero-variance unless every one is
            t = task_ids[next(turn) % len(task_ids)]
            if t not in zero_variance or zero_variance.issuperset(task_ids):
                break
        return f"{prefix}/{t}/r{next(refills)}", run.tasks[t]

    engine = run.engine
    counters0, t0 = _engine_counters(engine, sched.runner), time.monotonic()
    cache0 = engine.prefix_cache()
    sched.submit(groups)
    batch = sched.next_batch(len(task_ids), on_progress=on_progress, refill=refill)
    wall = time.monotonic() - t0
    counters = _engine_counters(engine, sched.runner)
    tokens = sum(t1 - t0_ for (t0_, _), (t1, _) in zip(counters0, counters, strict=True))
    busy = max(b1 - b0 for (_, b0), (_, b1) in zip(counters0, counters, strict=True))
    dropped = [row for g in batch.dropped for row in g.rows]
    metrics = dict(batch.metrics)
    metrics["generation_tokens_per_s"] = tokens / max(busy, 1e-9)
    metrics["engine_idle_s"] = max(0.0, wall - busy)  # waiting on environments (sandboxes, verifiers)
    cache = engine.prefix_cache()
    queries = cache["queries"] - cache0["queries"]
    metrics["prefix_cache_hit_rate"] = (cache["hits"] - cache0["hits"]) / queries if queries else 0.0
    metrics["groups_dropped"] = len(batch.dropped)
    metrics["groups_submitted"] = len(groups)
    return batch.rows, dropped, metrics


def _engine_counters(engine, runner) -> list[tuple[int, float]]:
    """``(tokens sampled, busy s)`` of each engine client the episodes use: the run's, or each Ray actor's."""
    if hasattr(runner, "engine_counters"):  # episodes on Ray actors (infra.rollout.ray_episodes)
        return runner.engine_counters()
    return [(engine.generated_tokens, engine.busy_s)]


def rollouts_for_step(run: Run, task_ids: list[str], step: int, deps: list[str]) -> RolloutStats:
    """The step's rollouts: reused from an earlier attempt of this step when still valid, else collected.

    A reused result is trusted only if it names this step's file, the file still exists with the
    same size, and every row was sampled by a version no newer than ``run.resumed_version`` (the newest
    version published when this process resumed the run: its weights are fixed by a manifest, so
    the version number names exactly the weights that sampled). Rows from a version published
    later, or never (a background upload lost in the crash), are collected again
    (``refresh_cache``), overwriting the stored result. ``reused`` says which.
    """
    from dataclasses import replace

    traj_uri = run.layout.trajectories(step)
    resumed_version = run.resumed_version
    started, start = time.time(), time.monotonic()
    result = as_asset(collect_rollouts, traj_uri, deps)(run, task_ids, step)
    if not isinstance(result, RolloutStats) or result.collected_at < started:  # an earlier attempt's result
        run.fs.invalidate_cache()
        intact = isinstance(result, RolloutStats) and result.uri == traj_uri and run.fs.exists(traj_uri) \
            and run.fs.size(traj_uri) == result.bytes
        if intact and result.max_policy_version <= resumed_version:
            return replace(result, reused=True, stage_s=time.monotonic() - start)
        result = as_asset(collect_rollouts.with_options(refresh_cache=True), traj_uri, deps)(run, task_ids, step)
    return replace(result, reused=False, stage_s=time.monotonic() - start)
