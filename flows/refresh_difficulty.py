"""Deployable flow: per-task pass rates from stored trajectories and the task sample for a step.

``python -m flows.refresh_difficulty --config configs/quickstart.toml`` or the ``refresh_difficulty``
deployment. Uses the run's existing ``envs.json`` (run ``build_envs`` first).
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from prefect import flow

from flows.naming import flow_run_name, tagged
from infra.config import RunConfig
from infra.run import Run
from tasks.difficulty import refresh_difficulty as refresh_task

DEFAULT_CONFIG = RunConfig()


@flow(name="refresh_difficulty", flow_run_name=flow_run_name, log_prints=True)
def refresh_difficulty(config: RunConfig = DEFAULT_CONFIG, step: int = 0) -> dict:
    """Choose the tasks of ``step`` from past pass rates (see ``infra.difficulty``).

    Args:
        config: the run config (the form's defaults are the deployment's config; its run_id names the run).
        step: the step whose task sample to draw (the sample is seeded by the step).
    """
    with tagged(config), Run.open(config, docker=False, model=False, tasks=False) as run:
        selection = refresh_task(run, step)
    print(f"step {step}: chosen {selection.chosen}, skipped {selection.skipped}, revisited {selection.revisited}")
    return asdict(selection)


if __name__ == "__main__":
    from flows.cli import run_flow_cli

    sys.exit(run_flow_cli(refresh_difficulty, __doc__, checks={"docker": False, "model": False, "tasks": False}))
