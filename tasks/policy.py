"""Prefect task: find where the run stands and prepare the policy it continues from."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.run import Run
from tasks.naming import stage_run_name


@task(name="prepare_policy", task_run_name=stage_run_name("prepare_policy"), cache_policy=NO_CACHE)
def prepare_policy(run: Run) -> int:
    """Serve the newest published checkpoint, or the configured model (``Run.resume``); returns the next step.

    The rollout engine is started here when steps remain, so that time to batch does not include
    its start-up.
    """
    next_step = run.resume()
    if next_step < run.config.steps:
        run.engine  # noqa: B018 -- start it now
    return next_step
