"""Prefect task: pass@k on the held-out tasks with the serving engine and dtype; report beside the checkpoint."""

from __future__ import annotations

import json
import time

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.assets import add_asset_metadata
from prefect.cache_policies import NO_CACHE

from infra.evaluate import PrecisionMismatch, compare_reports, eval_precision, eval_report
from infra.layout import artifact_key
from infra.rollout.collector import CollectSettings
from infra.run import Run
from infra.summary import EvalResult, PublishResult
from tasks.build_envs import image_asset
from tasks.lineage import as_asset, declare_inputs
from tasks.naming import stage_run_name


def eval_settings(config) -> dict:
    """The settings a report was made with; a stored report is reused only when they match."""
    e = config.eval
    return {"samples_per_task": e.samples_per_task, "k": list(e.k), "temperature": e.temperature,
            "max_tokens": e.max_tokens, "max_turns": config.rollout.max_turns}


@task(name="evaluate", task_run_name=stage_run_name("evaluate"), cache_policy=NO_CACHE)
def evaluate(run: Run, report_uri: str, previous_uri: str = "") -> dict:
    """pass@k (``eval.k``, ``eval.samples_per_task`` attempts per task) on every usable held-out task.

    Runs with the engine as it serves now, in the serving dtype (or, with
    ``eval.allow_precision_mismatch``, in ``eval.dtype``, marked in the report). When
    ``previous_uri`` holds an earlier version's report in the same precision, the report gets a
    ``compared_to`` section (``infra.evaluate.compare_reports``). Run as a materializing task
    (asset ``report_uri``): its inputs are the checkpoint and the held-out tasks' images, and the dtype it
    ran in is a property of the report (``dtype``, ``serving_dtype``, ``precision_mismatch``).

    Returns:
        The report (see ``infra.evaluate.eval_report``, plus ``settings``, ``evaluated_at`` (unix s),
        ``compared_to``), also written to ``report_uri``.

    Raises:
        PrecisionMismatch: the precision is refused, or the engine in this process serves another dtype.
    """
    config = run.config
    dtype, _ = eval_precision(config.model.serving_dtype, config.eval.dtype, config.eval.allow_precision_mismatch)
    engine = run.engine_in(dtype)
    if engine.dtype != dtype:
        raise PrecisionMismatch(f"the engine in this process serves {engine.dtype}; evaluating in {dtype} needs a "
                                f"fresh process (python -m flows.evaluate --config ...)")
    held_out = run.catalog.usable("eval")
    r, e = config.rollout, config.eval
    settings = CollectSettings(group_size=e.samples_per_task, temperature=e.temperature, top_p=1.0,
                               max_tokens_per_turn=e.max_tokens, max_turns=r.max_turns, seed=r.seed,
                               max_infra_retries=r.max_infra_retries, top_k=0)
    version = run.policy.version
    rows = run.episode_runner(settings).collect(f"{config.run_id}-eval", version,
                                                [run.tasks[x.task_id] for x in held_out], run.catalog.images("eval"))
    report = eval_report(rows, version, engine=f"vllm:{engine.replica}", dtype=engine.dtype, k=e.k,
                         serving_dtype=config.model.serving_dtype)
    report["settings"] = eval_settings(config)
    report["evaluated_at"] = time.time()
    if previous_uri and run.fs.exists(previous_uri):
        previous = json.loads(run.fs.cat_file(previous_uri))
        if previous.get("dtype") == report["dtype"] and "pass_at_k" in previous:
            report["compared_to"] = compare_reports(report, previous)
    run.fs.pipe_file(report_uri, json.dumps(report, indent=1).encode())
    previous = json.loads(run.fs.cat_file(previous_uri)) if report.get("compared_to") else None
    create_table_artifact(key=artifact_key(run.config.run_id, f"eval-v{version}"),
                          table=per_task_rows(report, previous),
                          description=f"{run.config.run_id} v{version}: pass@k per held-out task ({report['dtype']})"
                                      + (f", against v{previous['version']}" if previous else ""))
    declare_inputs(sorted({image_asset(image) for image, _ in run.catalog.images("eval").values()}))
    add_asset_metadata(report_uri, {"version": report["version"], "dtype": report["dtype"],
                                    "serving_dtype": config.model.serving_dtype,
                                    "precision_mismatch": report["precision_mismatch"],
                                    **{f"pass_at_{k}": v for k, v in report["pass_at_k"].items()}})
    return report


def per_task_rows(report: dict, previous: dict | None = None) -> list[dict]:
    """One table row per held-out task: samples, passed, pass@k and, with ``previous``, its pass@k and the change."""
    rows = []
    for task_id, t in sorted(report["per_task"].items()):
        row = {"task": task_id, "samples": t["samples"], "passed": t["passed"],
               **{f"pass@{k}": round(v, 3) for k, v in t["pass_at_k"].items()}}
        before = (previous or {}).get("per_task", {}).get(task_id)
        if previous is not None:
            for k, v in t["pass_at_k"].items():
                old = before["pass_at_k"].get(k) if before else None
                row[f"v{previous['version']} pass@{k}"] = "new" if old is None else round(old, 3)
                row[f"change pass@{k}"] = "" if old is None else f"{v - old:+.3f}"
        rows.append(row)
    return rows


def evaluate_published(run: Run, published: PublishResult) -> EvalResult:
    """The evaluation stage of post_train: evaluate the version just served.

    Skipped when ``eval.enabled`` is off or the checkpoint was refused (a refused version was not loaded).
    """
    if not run.config.eval.enabled or published.refused:
        return EvalResult(None)
    start = time.monotonic()
    uri = run.layout.eval_report(published.version)
    report = as_asset(evaluate, uri, [published.checkpoint])(run, uri, run.layout.eval_report(published.version - 1))
    return EvalResult(report, time.monotonic() - start)
