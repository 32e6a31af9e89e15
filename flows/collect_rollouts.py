"""Deployable flow: collect one step's rollouts with the newest published policy, without training.

``python -m flows.collect_rollouts --config configs/quickstart.toml`` or the ``collect_rollouts``
deployment. Writes ``trajectories/step-N.parquet`` for the given step; an earlier attempt of the same
step whose stored rollouts are still valid is reused (see ``tasks.rollouts.rollouts_for_step``).
"""

from __future__ import annotations

import sys

from prefect import flow

from infra.config import RunConfig
from tasks.build_envs import task_image_assets
from tasks.difficulty import refresh_difficulty
from tasks.policy import prepare_policy
from tasks.rollouts import rollouts_for_step
from tasks.runtime import run_uri

DEFAULT_CONFIG = RunConfig()


@flow(name="collect_rollouts", log_prints=True)
def collect_rollouts(config: RunConfig = DEFAULT_CONFIG, step: int | None = None) -> dict:
    """Sample G attempts for each chosen task with the newest policy; ``step`` defaults to the next one.

    Returns:
        The collection summary (URI, rows, time to batch, outcomes, reward mean).
    """
    catalog_uri = f"{run_uri(config)}/envs.json"
    policy = prepare_policy(config)
    step = policy["next_step"] if step is None else step
    selection = refresh_difficulty(config, catalog_uri, step)
    deps = task_image_assets(config, catalog_uri, selection["chosen"])
    result = rollouts_for_step(config, catalog_uri, selection["chosen"], step, deps, policy["version"])
    print(f"step {step}: {result['rows']} rows, reward mean {result['reward_mean']:.3f}, {result['outcomes']}"
          f"{' (reused: stored by an earlier attempt of this step)' if result['reused'] else ''}")
    return result


if __name__ == "__main__":
    from flows.cli import run_flow_cli

    sys.exit(run_flow_cli(collect_rollouts, __doc__))
