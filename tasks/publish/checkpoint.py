"""Prefect tasks every publication shares: export the trainer's weights, upload them as the S3 checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

from prefect import get_run_logger, task
from prefect.assets import add_asset_metadata
from prefect.cache_policies import NO_CACHE

from infra.checkpoint import publish
from infra.run import Run
from tasks.naming import stage_run_name


@task(name="export_weights", task_run_name=stage_run_name("export_weights"), cache_policy=NO_CACHE)
def export_weights(run: Run, version: int) -> str:
    """Write the trainer's weights and the tokenizer as an HF safetensors folder; returns its path."""
    local = run.layout.work / f"export-v{version}"
    shutil.rmtree(local, ignore_errors=True)
    run.trainer.export(local)
    # Tokenizer files travel with the weights so the checkpoint is a complete HF folder.
    run.engine.tokenizer.save_pretrained(local)
    return str(local)


@task(name="publish_checkpoint", task_run_name=stage_run_name("publish_checkpoint"), cache_policy=NO_CACHE)
def publish_checkpoint(run: Run, uri: str, version: int, step: int, export_dir: str = "") -> dict:
    """Upload an exported folder (exported now when ``export_dir`` is empty) with the manifest last.

    Run as a materializing task (asset ``uri``, upstream the step's trajectories and the parent weights,
    whose key the manifest's ``parent`` names). The export folder is removed afterwards.

    Returns:
        The manifest.
    """
    local = Path(export_dir or export_weights.fn(run, version))
    manifest = publish(run.fs, local, uri, version=version, parent_version=version - 1, step=step,
                       dtype="float32", parent=run.policy_asset(version - 1))
    shutil.rmtree(local, ignore_errors=True)
    add_asset_metadata(uri, {"version": version, "parent_version": manifest["parent_version"],
                             "parent": manifest["parent"], "step": step,
                             "sha256": {k: v["sha256"] for k, v in manifest["files"].items()}})
    return manifest


def loaded(version: int, pause_s: float, transfer_s: float, refused: str = "") -> dict:
    """A load task's result: the version served now, the apply pause and transfer in s, the refusal ('' if none)."""
    return {"version": version, "pause_s": pause_s, "transfer_s": transfer_s, "refused": refused}


def refused(run: Run, source: str, err: Exception) -> dict:
    """The load result of a checkpoint refused at ``source`` (logged): the engine keeps serving its version."""
    get_run_logger().warning("refused checkpoint %s, still serving v%d: %s", source, run.policy.version, err)
    return loaded(run.policy.version, 0.0, 0.0, str(err))
