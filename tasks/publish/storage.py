"""Storage publication (``StoragePublish``): upload the checkpoint, then the engine fetches, verifies and loads it."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from infra.checkpoint import CheckpointError, fetch
from infra.config import RemoteEngine, StoragePublish
from infra.run import Policy, Run
from tasks.naming import stage_run_name
from tasks.publish.checkpoint import loaded, refused
from tasks.publish.direct import stage_on_servers


@task(name="hot_load", task_run_name=stage_run_name("hot_load"), cache_policy=NO_CACHE, retries=1)
def hot_load(run: Run, uri: str) -> dict:
    """Fetch a published checkpoint, verify it against its manifest, and reload the engine's weights.

    Remote servers (``engine.kind = "remote"``) each fetch and verify it from S3 themselves, through
    presigned URLs (:meth:`infra.run.Run.presigned_checkpoint`), while serving, then drain and apply
    as with direct publication (:func:`tasks.publish.direct.stage_on_servers`).

    An incomplete or corrupt checkpoint (no manifest, size or sha256 mismatch) is refused: the
    engine keeps serving the version it has, the refusal is logged and returned, and the run goes
    on (the next rows then carry the older version, which the policy-lag metrics show).

    Returns:
        ``{"version", "pause_s", "transfer_s", "refused"}``: the version now served, how long
        generation was paused, the fetch-and-verify seconds, and the refusal reason (empty when loaded).
    """
    if isinstance(run.config.engine, RemoteEngine):  # servers on other machines fetch it from S3 themselves
        try:
            version, files, urls = run.presigned_checkpoint(uri)
            return stage_on_servers(run, uri, files, version, urls=urls)
        except CheckpointError as e:
            return refused(run, uri, e)
    local = run.layout.work / f"v{run.layout.version_of(uri)}"
    start = time.monotonic()
    try:
        manifest = fetch(run.fs, uri, local)
    except CheckpointError as e:
        shutil.rmtree(local, ignore_errors=True)
        return refused(run, uri, e)
    transfer_s = time.monotonic() - start
    pause_s = run.serve_folder(Policy(manifest["version"], str(local)))
    return loaded(manifest["version"], pause_s, transfer_s)


@dataclass(frozen=True)
class StoragePublication:
    """The checkpoint is uploaded first (on the critical path), then hot-loaded from S3."""

    config: StoragePublish

    def publish(self, run: Run, ckpt: str, version: int, step: int, upload: Task) -> tuple[dict, None]:
        """See :class:`tasks.publish.Publication`; nothing is left in the background."""
        upload(run, ckpt, version, step)
        return hot_load(run, ckpt), None
