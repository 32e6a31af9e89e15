"""Deployable flow: collect one step's rollouts with the newest published policy, without training.

``python -m flows.collect_rollouts --config configs/quickstart.toml`` or the ``collect_rollouts``
deployment. Writes ``trajectories/step-N.parquet`` for the given step; an earlier attempt of the same
step whose stored rollouts are still valid is reused (see ``tasks.rollouts.rollouts_for_step``).
"""

from __future__ import annotations

import sys
from typing import Literal

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from infra.config import RunConfig
from tasks.build_envs import task_image_assets
from tasks.difficulty import refresh_difficulty
from tasks.policy import prepare_policy
from tasks.rollouts import rollouts_for_step
from tasks.runtime import run_uri

DEFAULT_CONFIG = RunConfig()


@flow(name="collect_rollouts", log_prints=True)
def collect_rollouts(config: RunConfig = DEFAULT_CONFIG, step: int | None = None,
                     fan_out: Literal["local", "ray"] = "local", ray_address: str = "") -> dict:
    """Sample G attempts for each chosen task with the newest policy; ``step`` defaults to the next one.

    ``fan_out="ray"`` runs one Prefect task per group on Ray (``prefect-ray``; a local Ray instance,
    or the cluster at ``ray_address``); it needs ``rollout.engine = "servers"``, whose vLLM
    servers this flow starts and the workers reach over HTTP.

    Returns:
        The collection summary (URI, rows, time to batch, outcomes, reward mean).

    Raises:
        ValueError: ``fan_out="ray"`` without ``rollout.engine = "servers"``.
    """
    if fan_out == "ray" and config.rollout.engine != "servers":
        raise ValueError("collect_rollouts: fan_out=\"ray\" needs rollout.engine = \"servers\" (Ray workers reach "
                         "the engines over HTTP; an in-process engine cannot be shared)")
    catalog_uri = f"{run_uri(config)}/envs.json"
    policy = prepare_policy(config)
    step = policy["next_step"] if step is None else step
    selection = refresh_difficulty(config, catalog_uri, step)
    deps = task_image_assets(config, catalog_uri, selection["chosen"])
    if fan_out == "ray":
        return _collect_on_ray(config, catalog_uri, selection["chosen"], step, deps, policy["version"], ray_address)
    result = rollouts_for_step(config, catalog_uri, selection["chosen"], step, deps, policy["version"])
    print(f"step {step}: {result['rows']} rows, reward mean {result['reward_mean']:.3f}, {result['outcomes']}"
          f"{' (reused: stored by an earlier attempt of this step)' if result['reused'] else ''}")
    return result


def _collect_on_ray(config: RunConfig, catalog_uri: str, task_ids: list[str], step: int, deps: list[str],
                    version: int, ray_address: str) -> dict:
    from infra.rollout.servers import RemoteServer
    from tasks.fanout import collect_groups, ray_task_runner
    from tasks.lineage import as_asset
    from tasks.rollouts import store_step
    from tasks.runtime import runtime

    rt = runtime(config)
    servers = [vars(RemoteServer.of(s)) for s in rt.engine.servers.values()]  # starts them on first use
    catalog = rt.load_catalog(catalog_uri)
    images = {e["task_id"]: (e["image"], e["image_digest"]) for e in catalog["tasks"] if e["usable"]}
    fan = collect_groups.with_options(task_runner=ray_task_runner(ray_address))
    gathered = fan(config, servers, version, [rt.tasks[t] for t in task_ids], step, images)
    uri = f"{run_uri(config)}/trajectories/step-{step:06d}.parquet"
    store = task(name="store_rollouts", cache_policy=NO_CACHE)(store_step)
    result = as_asset(store, uri, deps)(config, step, gathered["rows"], [], {}, gathered["wall_s"])
    print(f"step {step}: {result['rows']} rows from {len(task_ids)} groups on Ray, reward mean "
          f"{result['reward_mean']:.3f}, {result['outcomes']}")
    return {**result, "reused": False, "fan_out": "ray", "worker_pids": gathered["worker_pids"]}


if __name__ == "__main__":
    from flows.cli import run_flow_cli

    sys.exit(run_flow_cli(collect_rollouts, __doc__))
