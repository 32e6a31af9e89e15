"""Prefect task: collect a step's rollouts and store them as one Parquet file (an asset)."""

from __future__ import annotations

import itertools
import time
from collections import Counter

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.assets import add_asset_metadata

from infra.config import RunConfig
from infra.environments import BASE_IMAGE
from infra.rollout.collector import Collector, CollectSettings
from infra.store import TRAJECTORY_SCHEMA, step_uri, write_step
from tasks.runtime import runtime

ROLLOUTS_RESULT_KEY = "agentrl-rollouts/{parameters[config].run_id}/step-{parameters[step]}.pickle"


@task(name="collect_rollouts", persist_result=True, result_storage_key=ROLLOUTS_RESULT_KEY)
def collect_rollouts(config: RunConfig, catalog_uri: str, task_ids: list[str], step: int) -> dict:
    """Collect a batch of ``len(task_ids)`` complete groups and write ``trajectories/step-N.parquet``.

    Idempotent on run id and step: the result is persisted under ``ROLLOUTS_RESULT_KEY``, so a
    rerun of a step whose rollouts were stored (a run killed before its checkpoint was published)
    reuses them; :func:`rollouts_for_step` checks the stored file before trusting it. A failed
    collection is not served back (Prefect persists failures at random keys, not the templated one).

    ``rollout.scheduler="async"`` (default): the run's :class:`~infra.rollout.scheduler.AsyncCollector`
    keeps up to ``ceil(tasks_per_step * overprovision)`` groups in flight; the chosen tasks (then, to
    fill that bound, extra groups of the same tasks) are submitted, and the first complete eligible
    groups form the batch, whatever step launched them. Groups dropped meanwhile (stale, or infra
    policy) are written to ``dropped/step-N.parquet``, never trained on. ``sync``: one
    turn-synchronous batch of exactly the chosen groups.

    Run as a materializing task (the flow gives it the trajectory asset and the image assets as
    dependencies). Rewriting a step replaces its file, so a re-run never duplicates rows.

    Returns:
        ``{"uri", "rows", "time_to_batch_s", "outcomes": {outcome: count}, "reward_mean", "bytes",
        "min_policy_version", "infra_reasons": {reason code: count}, "retried" (rows that are retries),
        "sandbox_warm" (rows whose sandbox came from the warm pool), "sandbox_acquire_p50_s",
        "scheduling": the scheduler's batch metrics (async; see ``AsyncCollector.next_batch``) plus
        ``generation_tokens_per_s`` (while the engine generated), ``engine_idle_s`` (batch wall time
        the engine was not generating), ``prefix_cache_hit_rate`` (cached prompt tokens / prompt
        tokens looked up), ``groups_dropped``, ``groups_submitted``}``.
    """
    rt = runtime(config)
    catalog = rt.load_catalog(catalog_uri)
    images = {e["task_id"]: (e["image"], e["image_digest"]) for e in catalog["tasks"] if e["usable"]}
    r = config.rollout
    progress = create_progress_artifact(0.0, description=f"step {step}: rollouts finished")
    start = time.monotonic()

    def on_progress(done: int, total: int) -> None:
        update_progress_artifact(progress, 100.0 * done / max(total, 1))

    dropped_rows: list[dict] = []
    scheduling: dict = {}
    if r.scheduler == "sync":
        settings = CollectSettings(r.group_size, r.temperature, r.top_p, r.max_tokens_per_turn, r.max_turns,
                                   r.seed, r.max_infra_retries)
        collector = Collector(rt.engine, rt.backend, settings, code_image=BASE_IMAGE, pool=rt.sandbox_pool)
        rows = collector.collect(config.run_id, step, [rt.tasks[t] for t in task_ids], images, on_progress)
    else:
        rows, dropped_rows, scheduling = _collect_async(rt, config, images, task_ids, step, on_progress)
    update_progress_artifact(progress, 100.0)
    return store_step(config, step, rows, dropped_rows, scheduling, time.monotonic() - start)


def store_step(config: RunConfig, step: int, rows: list[dict], dropped_rows: list[dict], scheduling: dict,
               elapsed_s: float) -> dict:
    """Write a step's rows (and dropped groups) as Parquet and summarize them (see :func:`collect_rollouts`)."""
    rt = runtime(config)
    uri = step_uri(config.storage.bucket, config.storage.prefix, config.run_id, step)
    size = write_step(rt.fs, uri, rows)
    if dropped_rows:
        write_step(rt.fs, uri.replace("/trajectories/", "/dropped/"), dropped_rows)
    outcomes: dict[str, int] = {}
    infra_reasons: dict[str, int] = {}
    for row in rows:
        outcomes[row["outcome"]] = outcomes.get(row["outcome"], 0) + 1
        if row["outcome"] == "infra_failure":
            infra_reasons[row["reason"]] = infra_reasons.get(row["reason"], 0) + 1
    acquire = sorted(row["sandbox_acquire_s"] for row in rows if row["sandbox_id"])
    versions = sorted({row["min_policy_version"] for row in rows} | {row["max_policy_version"] for row in rows})
    add_asset_metadata(uri, {"rows": len(rows), "step": step, "policy_versions": versions, "bytes": size,
                             "scheduling": {k: round(v, 4) for k, v in scheduling.items()}})
    return {"uri": uri, "rows": len(rows), "collected_at": time.time(),
            "max_policy_version": max((row["max_policy_version"] for row in rows), default=-1),
            "time_to_batch_s": scheduling.get("time_to_batch_s", elapsed_s),
            "outcomes": outcomes,
            "reward_mean": sum(row["reward"] for row in rows) / max(len(rows), 1), "bytes": size,
            "min_policy_version": min((row["min_policy_version"] for row in rows), default=-1),
            "infra_reasons": infra_reasons, "retried": sum(row["attempt"] > 0 for row in rows),
            "sandbox_warm": sum(row["sandbox_warm"] for row in rows),
            "sandbox_acquire_p50_s": acquire[len(acquire) // 2] if acquire else 0.0, "scheduling": scheduling}


def _collect_async(rt, config: RunConfig, images: dict, task_ids: list[str], step: int,
                   on_progress) -> tuple[list[dict], list[dict], dict]:
    """Submit this step's groups to the run's asynchronous collector and take one batch from it."""
    r = config.rollout
    sched = rt.scheduler
    sched.runner.bind(config.run_id, step, images)
    backlog = sched.pending + sched.in_flight + sched.bank.eligible(sched.policy_version)  # stale ones never train
    room = max(0, sched.K - backlog)
    chosen = [(f"{config.run_id}/{step}/{t}", rt.tasks[t]) for t in task_ids]
    extra = [(f"{config.run_id}/{step}/{t}/x{k}", rt.tasks[t])
             for k, t in zip(range(max(0, room - len(chosen))), itertools.cycle(task_ids), strict=False)]
    groups = (chosen + extra)[:room]
    if rt.sandbox_pool is not None:  # declare this step's sandbox demand per image
        demand: Counter = Counter()
        for _, task in groups:  # code tasks are verified in the base image, which the catalog lists for them
            image = images.get(task.task_id, (BASE_IMAGE, ""))[0]
            demand[(image, task.cpus, task.memory_mb, task.allow_internet, task.disk_mb)] += 1
        for (image, cpus, memory_mb, network, disk_mb), n in demand.items():
            rt.sandbox_pool.ensure(image, n * r.group_size, cpus=cpus, memory_mb=memory_mb, network=network,
                                   disk_mb=disk_mb)
    engine = rt.engine
    tokens0, busy0, t0 = engine.generated_tokens, engine.busy_s, time.monotonic()
    cache0 = engine.prefix_cache()
    sched.submit(groups)
    batch = sched.next_batch(len(task_ids), on_progress=on_progress)
    wall, busy = time.monotonic() - t0, engine.busy_s - busy0
    dropped = [row for g in batch.dropped for row in g.rows]
    metrics = dict(batch.metrics)
    metrics["generation_tokens_per_s"] = (engine.generated_tokens - tokens0) / max(busy, 1e-9)
    metrics["engine_idle_s"] = max(0.0, wall - busy)  # waiting on environments (sandboxes, verifiers)
    cache = engine.prefix_cache()
    queries = cache["queries"] - cache0["queries"]
    metrics["prefix_cache_hit_rate"] = (cache["hits"] - cache0["hits"]) / queries if queries else 0.0
    metrics["groups_dropped"] = len(batch.dropped)
    metrics["groups_submitted"] = len(groups)
    columns = set(TRAJECTORY_SCHEMA.names)  # the scheduler's own bookkeeping (finished_s, episode_s) stays out

    def stored(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in row.items() if k in columns} for row in rows]

    return stored(batch.rows), stored(dropped), metrics


def rollouts_for_step(config: RunConfig, catalog_uri: str, task_ids: list[str], step: int, deps: list[str],
                      resumed_version: int) -> dict:
    """The step's rollouts: reused from an earlier attempt of this step when still valid, else collected.

    A reused result is trusted only if it names this step's file, the file still exists with the
    same size, and every row was sampled by a version no newer than ``resumed_version`` (the newest
    version published when this process resumed the run: its weights are fixed by a manifest, so
    the version number names exactly the weights that sampled). Rows from a version published
    later, or never (a background upload lost in the crash), are collected again
    (``refresh_cache``), overwriting the stored result. ``rollouts["reused"]`` says which.
    """
    from tasks.lineage import as_asset

    traj_uri = step_uri(config.storage.bucket, config.storage.prefix, config.run_id, step)
    started = time.time()
    result = as_asset(collect_rollouts, traj_uri, deps)(config, catalog_uri, task_ids, step)
    if result.get("collected_at", started) >= started:
        return {**result, "reused": False}
    fs = runtime(config).fs
    fs.invalidate_cache()
    if result["uri"] == traj_uri and fs.exists(traj_uri) and fs.size(traj_uri) == result["bytes"] \
            and result.get("max_policy_version", resumed_version + 1) <= resumed_version:
        return {**result, "reused": True}
    result = as_asset(collect_rollouts.with_options(refresh_cache=True), traj_uri, deps)(
        config, catalog_uri, task_ids, step)
    return {**result, "reused": False}
