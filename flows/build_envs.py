"""Deployable flow: build the run's environments (task images) and record them as assets.

``python -m flows.build_envs --config configs/quickstart.toml`` or the ``build_envs`` deployment.
"""

from __future__ import annotations

import sys

from prefect import flow

from flows.naming import flow_run_name, tagged
from infra.config import RunConfig
from infra.config_record import claim as claim_config
from infra.run import Run
from tasks.build_envs import build_envs as build_envs_task
from tasks.build_envs import materialize_task_images

DEFAULT_CONFIG = RunConfig()


@flow(name="build_envs", flow_run_name=flow_run_name, log_prints=True)
def build_envs(config: RunConfig = DEFAULT_CONFIG, allow_config_change: bool = False) -> dict:
    """Build every task image of the config and write ``envs.json``.

    Args:
        config: the run config (the form's defaults are the deployment's config; its run_id names the run).
        allow_config_change: continue a stored run whose config.json differs from ``config`` (the old one is
            kept in config-history/); off: such a run is refused, naming the differing fields.

    Returns:
        ``{"catalog": URI, "images": [asset keys]}``.
    """
    with tagged(config), Run.open(config, model=False) as run:
        claim_config(run.fs, config, allow_config_change)
        catalog_uri = build_envs_task(run)
        images = materialize_task_images(run)
    print(f"environments of {config.run_id}: {catalog_uri} ({len(images)} images)")
    return {"catalog": catalog_uri, "images": images}


if __name__ == "__main__":
    from flows.cli import run_flow_cli

    sys.exit(run_flow_cli(build_envs, __doc__, checks={"model": False}))
