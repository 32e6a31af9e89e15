"""Prefect task: find where the run stands and prepare the policy it continues from."""

from __future__ import annotations

import shutil
import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.checkpoint import checkpoint_uri, fetch, published_versions
from infra.config import RunConfig
from infra.model import resolve_model
from tasks.runtime import runtime, work_dir
from tasks.train import trainer_state_dir


@task(name="prepare_policy", cache_policy=NO_CACHE)
def prepare_policy(config: RunConfig) -> dict:
    """Resume from the newest published checkpoint of the run, or start from the configured model.

    Step ``s`` is committed when checkpoint ``v{s+1}`` has a complete manifest, so the next step
    is the number of published versions; a step interrupted before publication is re-run (its
    trajectory file is replaced, not duplicated). When the trainer state saved with that version is
    on this machine (``train.save_optimizer_state``), the trainer restores it (AdamW moments
    included); otherwise the optimizer starts fresh from the checkpoint's weights.

    Returns:
        ``{"model_dir", "version", "next_step", "engine_start_s", "trainer_state"}`` (the saved
        state to restore, empty if none); the rollout engine is started
        here (when steps remain) so that time to batch does not include its start-up.
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
    if rt._engine is not None and rt.engine.policy_version != version:
        rt.engine.load_weights(model_dir, version)  # an engine of this run already lives in this process
    rt.policy_dir, rt.policy_version = model_dir, version
    state = trainer_state_dir(config) / f"v{version}"
    if version and rt._trainer is None and config.train.save_optimizer_state and state.is_dir():
        rt.trainer_state = (str(state.parent), state.name)  # restored when the trainer starts
    start = time.monotonic()
    if version < config.steps:
        rt.engine  # noqa: B018 -- start the rollout engine now, so its start-up is not counted as time to batch
    return {"model_dir": model_dir, "version": version, "next_step": version,
            "engine_start_s": time.monotonic() - start, "trainer_state": "/".join(rt.trainer_state)}
