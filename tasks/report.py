"""Prefect task: store a step's summary and refresh the run's table and report artifacts."""

from __future__ import annotations

import json

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from infra.config import RunConfig
from infra.report import render_report
from tasks.runtime import artifact_key, run_uri, runtime


@task(name="record_step", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def record_step(config: RunConfig, summary: dict) -> list[dict]:
    """Store ``summary`` at ``{run}/summaries/step-N.json``, then refresh the run's artifacts.

    The ``<run>-steps`` table and the ``<run>-report`` markdown (also written to ``{run}/report.md``)
    cover every stored step, so a resumed run reports all its steps, not only this process's.
    Idempotent: a retry rewrites the same objects.

    Returns:
        Every stored summary of the run, by step.
    """
    fs = runtime(config).fs
    root = f"{run_uri(config)}/summaries"
    fs.pipe_file(f"{root}/step-{summary['step']:06d}.json", json.dumps(summary, default=str).encode())
    fs.invalidate_cache()
    history = [json.loads(fs.cat_file(p)) for p in sorted(fs.glob(f"{root}/step-*.json"))]
    create_table_artifact(key=artifact_key(config.run_id, "steps"),
                          table=[{k: str(v) for k, v in x.items()} for x in history],
                          description=f"post_train {config.run_id}: per-step summary")
    report = render_report(config.run_id, history)
    fs.pipe_file(f"{run_uri(config)}/report.md", report.encode())
    create_markdown_artifact(key=artifact_key(config.run_id, "report"), markdown=report,
                             description=f"post_train {config.run_id}: reward, lag, time and mismatch plots")
    return history
