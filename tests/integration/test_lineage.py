"""Lineage records only declared inputs (a real Prefect server and SeaweedFS), and lasts beside the artifacts on S3."""

from __future__ import annotations

import uuid

import pytest
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from tests.helpers import asset_events, related_assets

pytestmark = pytest.mark.integration


@task(name="evaluate", cache_policy=NO_CACHE)
def report_stage(run, uri: str) -> dict:
    """Like tasks.evaluate.evaluate: a report whose values include a string the config holds too."""
    return {"dtype": run.config.model.serving_dtype, "uri": uri}


@task(name="collect_rollouts", cache_policy=NO_CACHE)
def rollout_stage(run, dtypes: list[str]) -> int:
    return len(dtypes)


def test_materializations_record_only_declared_inputs(s3, prefect_harness, capsys):
    """Prefect links a task's return values (one level deep) by id(); a later task given one of those objects
    (here the config's dtype string, which the report holds) gets the report as an upstream asset. Ours
    must record exactly the declared inputs: on the code before tasks.lineage quoted the arguments, the
    step-1 trajectories listed v1's eval report."""
    from flows.lineage import main
    from infra.config import RunConfig
    from infra.layout import RunLayout
    from infra.run import Run
    from tasks.lineage import as_asset

    run = Run(RunConfig(run_id=f"lin-{uuid.uuid4().hex[:8]}"), s3)
    report_uri, traj = run.layout.eval_report(1), run.layout.trajectories(1)
    image = "docker://agentrl-task-make-dir:0123456789abcdef"

    @flow
    def two_stages() -> None:
        as_asset(report_stage, report_uri, [run.layout.checkpoint(1)])(run, report_uri)
        as_asset(rollout_stage, traj, [image])(run, [run.config.model.serving_dtype])

    two_stages()
    assert [related_assets(e) for e in asset_events(traj, timeout_s=30)] == [{image}]
    assert [related_assets(e) for e in asset_events(report_uri, timeout_s=30)] == [{run.layout.checkpoint(1)}]

    # the same lineage, stored beside each artifact, outlives the event retention; the CLI reads it as a tree
    s3.invalidate_cache()
    assert s3.exists(RunLayout.lineage(traj)) and s3.exists(RunLayout.lineage(report_uri))
    assert main([traj]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["made from (inputs):", f"  └── {image}", traj, "used by (outputs):", "  (none recorded)"]
    assert main([run.layout.checkpoint(1)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["made from (inputs):", "  (none recorded)", run.layout.checkpoint(1)]
    assert out[3:] == ["used by (outputs):", f"  └── {report_uri}"]
    assert main([f"{run.layout.root}/trajectories/step-000009.parquet"]) == 2
    assert "no lineage record" in capsys.readouterr().err
