"""Deployable flow: collect one step's rollouts with the newest published policy, without training.

``python -m flows.collect_rollouts --config configs/quickstart.toml`` or the ``collect_rollouts``
deployment. Writes ``trajectories/step-N.parquet`` for the given step; an earlier attempt of the same
step whose stored rollouts are still valid is reused (see ``tasks.rollouts.rollouts_for_step``).
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Literal

from prefect import flow

from flows.naming import flow_run_name, tagged
from infra.config import RemoteEngine, RunConfig, ServersEngine, SyncScheduler
from infra.config_record import claim as claim_config
from infra.run import Run
from tasks.build_envs import task_image_assets
from tasks.difficulty import refresh_difficulty
from tasks.policy import prepare_policy
from tasks.rollouts import rollouts_for_step

DEFAULT_CONFIG = RunConfig()


@flow(name="collect_rollouts", flow_run_name=flow_run_name, log_prints=True)
def collect_rollouts(config: RunConfig = DEFAULT_CONFIG, step: int | None = None,
                     fan_out: Literal["local", "ray"] | None = None, ray_address: str | None = None,
                     allow_config_change: bool = False) -> dict:
    """Sample G attempts for each chosen task with the newest policy; ``step`` defaults to the next one.

    ``fan_out="ray"`` runs one Prefect task per group on Ray (``prefect-ray``; a local Ray instance,
    or the cluster at ``ray_address``; ``tasks.fanout.collect_step_on_ray``); it needs a ``servers`` or
    ``remote`` engine, which the workers reach over HTTP. When the config itself says ``rollout.fan_out = "ray"``
    with the async scheduler, the run's collector runs the episodes on Ray actors instead
    (``infra.rollout.ray_episodes``).

    Args:
        config: the run config (the form's defaults are the deployment's config; its run_id names the run).
        step: the step to collect (default: the next one after the newest published checkpoint).
        fan_out: ``local`` (this process) or ``ray`` (one task per group on Ray); default: ``rollout.fan_out``.
        ray_address: the Ray cluster for ``fan_out="ray"`` (empty: a local Ray instance); default:
            ``rollout.ray_address``.
        allow_config_change: continue a stored run whose config.json differs from ``config`` (the old one is
            kept in config-history/); off: such a run is refused, naming the differing fields.

    Returns:
        The collection summary (``infra.summary.RolloutStats`` fields: URI, rows, time to batch,
        outcomes, reward mean, ...; with Ray also ``fan_out`` and ``worker_pids``).

    Raises:
        ValueError: ``fan_out="ray"`` with an in-process engine (``engine.kind = "inproc"``); ``fan_out="local"``
            against a config's ``fan_out = "ray"`` with the async scheduler.
    """
    fan_out = fan_out or config.rollout.fan_out
    ray_address = config.rollout.ray_address if ray_address is None else ray_address
    # the run's async collector runs its episodes on Ray actors when the config says so; else one task per group
    per_group = isinstance(config.rollout.scheduler, SyncScheduler) or \
        (fan_out, ray_address) != (config.rollout.fan_out, config.rollout.ray_address)
    if fan_out == "local" and config.rollout.fan_out == "ray" and not isinstance(config.rollout.scheduler,
                                                                                 SyncScheduler):
        raise ValueError("collect_rollouts: fan_out=\"local\" cannot override rollout.fan_out = \"ray\" with the async "
                         "scheduler (the run's collector is built from the config); set it in the config")
    if fan_out == "ray" and not isinstance(config.engine, ServersEngine | RemoteEngine):
        raise ValueError(f"collect_rollouts: fan_out=\"ray\" needs engine.kind = \"servers\" or \"remote\", not "
                         f"{config.engine.kind!r} (Ray workers reach the engines over HTTP; an in-process engine "
                         "cannot be shared)")
    with tagged(config), Run.open(config) as run:
        claim_config(run.fs, config, allow_config_change)
        next_step = prepare_policy(run)
        step = next_step if step is None else step
        selection = refresh_difficulty(run, step)
        deps = task_image_assets(run, selection.chosen)
        if fan_out == "ray" and per_group:
            from tasks.fanout import collect_step_on_ray

            result, placed = collect_step_on_ray(run, selection.chosen, step, deps, ray_address)
            return {**asdict(result), **placed}
        result = rollouts_for_step(run, selection.chosen, step, deps)
    print(f"step {step}: {result.rows} rows, reward mean {result.reward_mean:.3f}, {result.outcomes}"
          f"{' (reused: stored by an earlier attempt of this step)' if result.reused else ''}")
    return asdict(result)


if __name__ == "__main__":
    from flows.cli import run_flow_cli

    sys.exit(run_flow_cli(collect_rollouts, __doc__))
