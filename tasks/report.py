"""Prefect task: store a step's summary and refresh the run's two table artifacts and its report artifact."""

from __future__ import annotations

import json

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from infra.layout import artifact_key
from infra.report import narrow_table, render_report
from infra.run import Run
from infra.summary import StepSummary
from tasks.naming import stage_run_name


@task(name="record_step", task_run_name=stage_run_name("record_step"),
      cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def record_step(run: Run, summary: StepSummary) -> list[dict]:
    """Store the summary at ``RunLayout.summary(step)``, then refresh the run's artifacts.

    Three artifacts, each covering every stored step (a resumed run reports all its steps, not only
    this process's): ``<run>-steps``, the narrow table (``infra.report.narrow_table``: the figures people
    scan); ``<run>-steps-all``, every flat key of every summary (``metrics`` left out); ``<run>-report``,
    the markdown report (``infra.report.render_report``: banner, plots, narrow table), also written to
    ``RunLayout.report``. Idempotent: a retry rewrites the same objects.

    Returns:
        Every stored summary of the run, by step.
    """
    fs, layout, run_id = run.fs, run.layout, run.config.run_id
    fs.pipe_file(layout.summary(summary.step), json.dumps(summary.to_json(), default=str).encode())
    fs.invalidate_cache()
    history = [json.loads(fs.cat_file(p)) for p in sorted(fs.glob(layout.summaries_glob))]
    everything = artifact_key(run_id, "steps-all")
    create_table_artifact(key=artifact_key(run_id, "steps"), table=narrow_table(history),
                          description=f"post_train {run_id}: per-step figures to scan (all of them: {everything})")
    create_table_artifact(key=everything,
                          table=[{k: str(v) for k, v in x.items() if k != "metrics"} for x in history],
                          description=f"post_train {run_id}: every per-step summary figure")
    report = render_report(run_id, history)
    fs.pipe_file(layout.report, report.encode())
    create_markdown_artifact(key=artifact_key(run_id, "report"), markdown=report,
                             description=f"post_train {run_id}: what needs a look, curves and per-step table")
    return history
