"""Prefect tasks: publish the trained weights as checkpoint v{N}, and hot-load them into the engine."""

from __future__ import annotations

import shutil

from prefect import get_run_logger, task
from prefect.assets import add_asset_metadata
from prefect.cache_policies import NO_CACHE

from infra.checkpoint import CheckpointError, fetch, publish
from infra.config import RunConfig
from tasks.runtime import runtime, work_dir


@task(name="publish_checkpoint", cache_policy=NO_CACHE)
def publish_checkpoint(config: RunConfig, uri: str, version: int, step: int) -> dict:
    """Export the trainer's weights (HF safetensors) and upload them with the manifest last.

    Run as a materializing task (asset ``uri``, upstream the step's trajectories).

    Returns:
        The manifest.
    """
    rt = runtime(config)
    local = work_dir(config.run_id) / f"export-v{version}"
    shutil.rmtree(local, ignore_errors=True)
    rt.trainer.export(local)
    # Tokenizer files travel with the weights so the checkpoint is a complete HF folder.
    rt.engine.tokenizer.save_pretrained(local)
    manifest = publish(rt.fs, local, uri, version=version, parent_version=rt.policy_version, step=step,
                       dtype="float32")
    shutil.rmtree(local, ignore_errors=True)
    add_asset_metadata(uri, {"version": version, "parent_version": manifest["parent_version"], "step": step,
                             "sha256": {k: v["sha256"] for k, v in manifest["files"].items()}})
    return manifest


@task(name="hot_load", cache_policy=NO_CACHE, retries=1)
def hot_load(config: RunConfig, uri: str) -> dict:
    """Fetch a published checkpoint, verify it against its manifest, and reload the engine's weights.

    An incomplete or corrupt checkpoint (no manifest, size or sha256 mismatch) is refused: the
    engine keeps serving the version it has, the refusal is logged and returned, and the run goes
    on (the next rows then carry the older version, which the policy-lag metrics show).

    Returns:
        ``{"version", "pause_s", "refused"}``: the version now served, how long generation was
        paused, and the refusal reason (empty when loaded).
    """
    rt = runtime(config)
    local = work_dir(config.run_id) / f"v{manifest_version(uri)}"
    try:
        manifest = fetch(rt.fs, uri, local)
    except CheckpointError as e:
        shutil.rmtree(local, ignore_errors=True)
        get_run_logger().warning("refused checkpoint %s, still serving v%d: %s", uri, rt.policy_version, e)
        return {"version": rt.policy_version, "pause_s": 0.0, "refused": str(e)}
    pause_s = rt.load_weights(str(local), manifest["version"])
    rt.policy_dir, rt.policy_version = str(local), manifest["version"]
    return {"version": manifest["version"], "pause_s": pause_s, "refused": ""}


def manifest_version(uri: str) -> int:
    """The version number in a checkpoint URI (``.../checkpoints/v{N}``)."""
    return int(uri.rstrip("/").rsplit("/v", 1)[1])
