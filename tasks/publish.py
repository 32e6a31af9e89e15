"""Prefect tasks: get trained version N to the rollout engine by the configured pattern (``infra/publish``).

- storage: ``publish_checkpoint`` (export, upload, manifest last), then ``hot_load`` (fetch, verify, load);
- direct: ``export_weights``, then ``load_direct`` (the engine pulls the files from the trainer's
  HTTP source and verifies them), while ``publish_checkpoint`` uploads the export in the background;
- colocated: ``load_colocated`` (the in-process engine loads the trainer's tensors from memory), then
  ``export_weights`` and the background upload.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
from prefect import get_run_logger, task
from prefect.assets import add_asset_metadata
from prefect.cache_policies import NO_CACHE

from infra.checkpoint import CheckpointError, fetch, file_entries, publish
from infra.config import RunConfig
from infra.publish import DirectSource, pull
from tasks.runtime import runtime, work_dir


@task(name="export_weights", cache_policy=NO_CACHE)
def export_weights(config: RunConfig, version: int) -> str:
    """Write the trainer's weights and the tokenizer as an HF safetensors folder; returns its path."""
    rt = runtime(config)
    local = work_dir(config.run_id) / f"export-v{version}"
    shutil.rmtree(local, ignore_errors=True)
    rt.trainer.export(local)
    # Tokenizer files travel with the weights so the checkpoint is a complete HF folder.
    rt.engine.tokenizer.save_pretrained(local)
    return str(local)


@task(name="publish_checkpoint", cache_policy=NO_CACHE)
def publish_checkpoint(config: RunConfig, uri: str, version: int, step: int, export_dir: str = "") -> dict:
    """Upload an exported folder (exported now when ``export_dir`` is empty) with the manifest last.

    Run as a materializing task (asset ``uri``, upstream the step's trajectories). The export
    folder is removed afterwards.

    Returns:
        The manifest.
    """
    rt = runtime(config)
    local = Path(export_dir or export_weights.fn(config, version))
    manifest = publish(rt.fs, local, uri, version=version, parent_version=version - 1, step=step,
                       dtype="float32")
    shutil.rmtree(local, ignore_errors=True)
    add_asset_metadata(uri, {"version": version, "parent_version": manifest["parent_version"], "step": step,
                             "sha256": {k: v["sha256"] for k, v in manifest["files"].items()}})
    return manifest


def _refused(config: RunConfig, source: str, err: Exception) -> dict:
    rt = runtime(config)
    get_run_logger().warning("refused checkpoint %s, still serving v%d: %s", source, rt.policy_version, err)
    return {"version": rt.policy_version, "pause_s": 0.0, "transfer_s": 0.0, "refused": str(err)}


@task(name="hot_load", cache_policy=NO_CACHE, retries=1)
def hot_load(config: RunConfig, uri: str) -> dict:
    """Fetch a published checkpoint, verify it against its manifest, and reload the engine's weights.

    An incomplete or corrupt checkpoint (no manifest, size or sha256 mismatch) is refused: the
    engine keeps serving the version it has, the refusal is logged and returned, and the run goes
    on (the next rows then carry the older version, which the policy-lag metrics show).

    Returns:
        ``{"version", "pause_s", "transfer_s", "refused"}``: the version now served, how long
        generation was paused, the fetch-and-verify seconds, and the refusal reason (empty when loaded).
    """
    rt = runtime(config)
    local = work_dir(config.run_id) / f"v{manifest_version(uri)}"
    start = time.monotonic()
    try:
        manifest = fetch(rt.fs, uri, local)
    except CheckpointError as e:
        shutil.rmtree(local, ignore_errors=True)
        return _refused(config, uri, e)
    transfer_s = time.monotonic() - start
    pause_s = rt.load_weights(str(local), manifest["version"])
    rt.policy_dir, rt.policy_version = str(local), manifest["version"]
    return {"version": manifest["version"], "pause_s": pause_s, "transfer_s": transfer_s, "refused": ""}


@task(name="load_direct", cache_policy=NO_CACHE)
def load_direct(config: RunConfig, export_dir: str, version: int, files: dict | None = None) -> dict:
    """Direct publication: serve ``export_dir`` over HTTP; the engine pulls it, verifies it, and loads it.

    ``files`` (default: computed from ``export_dir``) is the manifest the engine verifies against.
    A server engine pulls inside its workers while serving; the in-process engine pulls into a
    local folder first. A file that fails verification is refused as in :func:`hot_load`.

    Returns:
        ``{"version", "pause_s", "transfer_s", "refused"}``.
    """
    rt = runtime(config)
    files = files if files is not None else file_entries(Path(export_dir))
    with DirectSource(Path(export_dir), host=config.publish.host) as source:
        start = time.monotonic()
        try:
            if hasattr(rt.engine, "stage_direct"):  # servers: each replica pulls while serving, then drain + apply
                transfer_s = rt.engine.stage_direct(source.url, files, version)
                start = time.monotonic()
                try:
                    pause_s = rt.apply_weights(lambda: rt.engine.apply_staged(version), version)
                except httpx.HTTPError as e:  # failed replicas are out of rotation; the others serve the version
                    if not rt.engine.router.live:
                        raise
                    get_run_logger().warning("v%d applied on the surviving replicas only: %s", version, e)
                    pause_s = time.monotonic() - start
                rt.policy_version = version
                return {"version": version, "pause_s": pause_s, "transfer_s": transfer_s, "refused": ""}
            local = pull(source.url, files, work_dir(config.run_id) / f"v{version}")
        except CheckpointError as e:
            return _refused(config, source.url, e)
    transfer_s = time.monotonic() - start
    pause_s = rt.load_weights(str(local), version)
    rt.policy_dir, rt.policy_version = str(local), version
    return {"version": version, "pause_s": pause_s, "transfer_s": transfer_s, "refused": ""}


@task(name="load_colocated", cache_policy=NO_CACHE)
def load_colocated(config: RunConfig, version: int) -> dict:
    """Colocated publication: the in-process engine loads the trainer's float32 tensors from memory.

    Returns:
        ``{"version", "pause_s", "transfer_s", "refused"}`` (``transfer_s``: the copy of the state dict).
    """
    rt = runtime(config)
    start = time.monotonic()
    state = rt.trainer.fp32_state_dict()
    transfer_s = time.monotonic() - start
    pause_s = rt.apply_weights(lambda: rt.engine.load_tensors(state, version), version)
    rt.policy_version = version
    return {"version": version, "pause_s": pause_s, "transfer_s": transfer_s, "refused": ""}


def manifest_version(uri: str) -> int:
    """The version number in a checkpoint URI (``.../checkpoints/v{N}``)."""
    return int(uri.rstrip("/").rsplit("/v", 1)[1])
