"""Prefect tasks: get trained version N to the rollout engine by the configured pattern (``infra/publish``).

- storage: ``publish_checkpoint`` (export, upload, manifest last), then ``hot_load`` (fetch, verify, load);
- direct: ``export_weights``, then ``load_direct`` (the engine pulls the files from the trainer's
  HTTP source and verifies them), while ``publish_checkpoint`` uploads the export in the background;
- colocated: ``load_colocated`` (the in-process engine loads the trainer's tensors from memory), then
  ``export_weights`` and the background upload.

:class:`Publisher` is the stage: it runs the pattern's tasks, times them, and awaits each background
upload before the next publication and when the block ends.
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
from infra.publish import DirectSource, pull
from infra.run import Policy, Run
from infra.summary import PublishResult
from tasks.lineage import as_asset


@task(name="export_weights", cache_policy=NO_CACHE)
def export_weights(run: Run, version: int) -> str:
    """Write the trainer's weights and the tokenizer as an HF safetensors folder; returns its path."""
    local = run.layout.work / f"export-v{version}"
    shutil.rmtree(local, ignore_errors=True)
    run.trainer.export(local)
    # Tokenizer files travel with the weights so the checkpoint is a complete HF folder.
    run.engine.tokenizer.save_pretrained(local)
    return str(local)


@task(name="publish_checkpoint", cache_policy=NO_CACHE)
def publish_checkpoint(run: Run, uri: str, version: int, step: int, export_dir: str = "") -> dict:
    """Upload an exported folder (exported now when ``export_dir`` is empty) with the manifest last.

    Run as a materializing task (asset ``uri``, upstream the step's trajectories). The export
    folder is removed afterwards.

    Returns:
        The manifest.
    """
    local = Path(export_dir or export_weights.fn(run, version))
    manifest = publish(run.fs, local, uri, version=version, parent_version=version - 1, step=step,
                       dtype="float32")
    shutil.rmtree(local, ignore_errors=True)
    add_asset_metadata(uri, {"version": version, "parent_version": manifest["parent_version"], "step": step,
                             "sha256": {k: v["sha256"] for k, v in manifest["files"].items()}})
    return manifest


def _refused(run: Run, source: str, err: Exception) -> dict:
    get_run_logger().warning("refused checkpoint %s, still serving v%d: %s", source, run.policy.version, err)
    return {"version": run.policy.version, "pause_s": 0.0, "transfer_s": 0.0, "refused": str(err)}


@task(name="hot_load", cache_policy=NO_CACHE, retries=1)
def hot_load(run: Run, uri: str) -> dict:
    """Fetch a published checkpoint, verify it against its manifest, and reload the engine's weights.

    An incomplete or corrupt checkpoint (no manifest, size or sha256 mismatch) is refused: the
    engine keeps serving the version it has, the refusal is logged and returned, and the run goes
    on (the next rows then carry the older version, which the policy-lag metrics show).

    Returns:
        ``{"version", "pause_s", "transfer_s", "refused"}``: the version now served, how long
        generation was paused, the fetch-and-verify seconds, and the refusal reason (empty when loaded).
    """
    local = run.layout.work / f"v{run.layout.version_of(uri)}"
    start = time.monotonic()
    try:
        manifest = fetch(run.fs, uri, local)
    except CheckpointError as e:
        shutil.rmtree(local, ignore_errors=True)
        return _refused(run, uri, e)
    transfer_s = time.monotonic() - start
    pause_s = run.serve_folder(Policy(manifest["version"], str(local)))
    return {"version": manifest["version"], "pause_s": pause_s, "transfer_s": transfer_s, "refused": ""}


@task(name="load_direct", cache_policy=NO_CACHE)
def load_direct(run: Run, export_dir: str, version: int, files: dict | None = None) -> dict:
    """Direct publication: serve ``export_dir`` over HTTP; the engine pulls it, verifies it, and loads it.

    ``files`` (default: computed from ``export_dir``) is the manifest the engine verifies against.
    A server engine pulls inside its workers while serving; the in-process engine pulls into a
    local folder first. A file that fails verification is refused as in :func:`hot_load`.

    Returns:
        ``{"version", "pause_s", "transfer_s", "refused"}``.
    """
    engine = run.engine
    files = files if files is not None else file_entries(Path(export_dir))
    with DirectSource(Path(export_dir), host=run.config.publish.host) as source:
        start = time.monotonic()
        try:
            if hasattr(engine, "stage_direct"):  # servers: each replica pulls while serving, then drain + apply
                transfer_s = engine.stage_direct(source.url, files, version)

                def apply() -> float:
                    t0 = time.monotonic()
                    try:
                        return engine.apply_staged(version)
                    except httpx.HTTPError as e:  # failed replicas are out of rotation; the others serve it
                        if not engine.router.live:
                            raise
                        get_run_logger().warning("v%d applied on the surviving replicas only: %s", version, e)
                        return time.monotonic() - t0

                pause_s = run.serve(Policy(version, ""), apply)
                return {"version": version, "pause_s": pause_s, "transfer_s": transfer_s, "refused": ""}
            local = pull(source.url, files, run.layout.work / f"v{version}")
        except CheckpointError as e:
            return _refused(run, source.url, e)
    transfer_s = time.monotonic() - start
    pause_s = run.serve_folder(Policy(version, str(local)))
    return {"version": version, "pause_s": pause_s, "transfer_s": transfer_s, "refused": ""}


@task(name="load_colocated", cache_policy=NO_CACHE)
def load_colocated(run: Run, version: int) -> dict:
    """Colocated publication: the in-process engine loads the trainer's float32 tensors from memory.

    Returns:
        ``{"version", "pause_s", "transfer_s", "refused"}`` (``transfer_s``: the copy of the state dict).
    """
    start = time.monotonic()
    state = run.trainer.fp32_state_dict()
    transfer_s = time.monotonic() - start
    pause_s = run.serve(Policy(version, ""), lambda: run.engine.load_tensors(state, version))
    return {"version": version, "pause_s": pause_s, "transfer_s": transfer_s, "refused": ""}


class Publisher:
    """The publication stage of a run: ``with Publisher(run) as publish: publish(step, trajectories_uri)``.

    Leaving the block awaits the last background upload (raises if it failed).
    """

    def __init__(self, run: Run):
        """Publish ``run``'s trained versions by ``run.config.publish.pattern``."""
        self.run = run
        self._upload = None  # the previous version's background upload (direct and colocated)
        self._load = {"storage": self._storage, "direct": self._direct, "colocated": self._colocated}[
            run.config.publish.pattern]

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.wait()

    def wait(self) -> float:
        """Await the previous background upload; returns the seconds waited (raises if it failed)."""
        start = time.monotonic()
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.result()
        return time.monotonic() - start

    def __call__(self, step: int, trajectories_uri: str) -> PublishResult:
        """Get version ``step + 1`` (trained on ``trajectories_uri``) to the engine."""
        start = time.monotonic()
        wait_s = self.wait()
        version = step + 1
        ckpt = self.run.layout.checkpoint(version)
        t_publish = time.monotonic()
        loaded = self._load(ckpt, version, step, as_asset(publish_checkpoint, ckpt, [trajectories_uri]))
        end = time.monotonic()
        return PublishResult(ckpt, loaded["version"], self.run.config.publish.pattern, loaded["pause_s"],
                             loaded["transfer_s"], loaded["refused"], end - t_publish, wait_s, end - start)

    def _storage(self, ckpt: str, version: int, step: int, upload) -> dict:
        upload(self.run, ckpt, version, step)
        return hot_load(self.run, ckpt)

    def _direct(self, ckpt: str, version: int, step: int, upload) -> dict:
        export_dir = export_weights(self.run, version)
        loaded = load_direct(self.run, export_dir, version)
        self._upload = upload.submit(self.run, ckpt, version, step, export_dir)
        return loaded

    def _colocated(self, ckpt: str, version: int, step: int, upload) -> dict:
        loaded = load_colocated(self.run, version)
        export_dir = export_weights(self.run, version)
        self._upload = upload.submit(self.run, ckpt, version, step, export_dir)
        return loaded
