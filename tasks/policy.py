"""Prefect task: find where the run stands and prepare the policy it continues from."""

from __future__ import annotations

import shutil

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.checkpoint import checkpoint_uri, fetch, published_versions
from infra.config import RunConfig
from infra.model import resolve_model
from tasks.runtime import runtime, work_dir


@task(name="prepare_policy", cache_policy=NO_CACHE)
def prepare_policy(config: RunConfig) -> dict:
    """Resume from the newest published checkpoint of the run, or start from the configured model.

    Step ``s`` is committed when checkpoint ``v{s+1}`` has a complete manifest, so the next step
    is the number of published versions; a step interrupted before publication is re-run (its
    trajectory file is replaced, not duplicated). Optimizer state is not restored on resume.

    Returns:
        ``{"model_dir", "version", "next_step"}``.
    """
    rt = runtime(config)
    s = config.storage
    versions = published_versions(rt.fs, s.bucket, s.prefix, config.run_id)
    if versions:
        version = versions[-1]
        local = work_dir(config.run_id) / f"v{version}"
        shutil.rmtree(local, ignore_errors=True)
        fetch(rt.fs, checkpoint_uri(s.bucket, s.prefix, config.run_id, version), local)
        model_dir = str(local)
    else:
        version, model_dir = 0, str(resolve_model(config.model.path))
    rt.policy_dir, rt.policy_version = model_dir, version
    return {"model_dir": model_dir, "version": version, "next_step": version}
