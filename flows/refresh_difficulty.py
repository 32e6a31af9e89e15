"""Deployable flow: per-task pass rates from stored trajectories and the task sample for a step.

``python -m flows.refresh_difficulty --config configs/quickstart.toml`` or the ``refresh_difficulty``
deployment. Uses the run's existing ``envs.json`` (run ``build_envs`` first).
"""

from __future__ import annotations

import sys

from prefect import flow

from infra.config import RunConfig
from tasks.difficulty import refresh_difficulty as refresh_task
from tasks.runtime import run_uri

DEFAULT_CONFIG = RunConfig()


@flow(name="refresh_difficulty", log_prints=True)
def refresh_difficulty(config: RunConfig = DEFAULT_CONFIG, step: int = 0) -> dict:
    """Choose the tasks of ``step`` from past pass rates (see ``infra.difficulty``)."""
    selection = refresh_task(config, f"{run_uri(config)}/envs.json", step)
    print(f"step {step}: chosen {selection['chosen']}, skipped {selection['skipped']}, "
          f"revisited {selection['revisited']}")
    return selection


if __name__ == "__main__":
    from flows.cli import run_flow_cli

    sys.exit(run_flow_cli(refresh_difficulty, __doc__, checks={"docker": False, "model": False, "tasks": False}))
