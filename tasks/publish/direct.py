"""Direct publication (``DirectPublish``): the engine pulls the trainer's export over HTTP and verifies it.

How it pulls depends on the engine (``config.engine``): vLLM servers pull inside their workers while
they keep serving, then drain and apply; the in-process engine pulls into a local folder, then loads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import assert_never

import httpx
from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture

from infra.checkpoint import CheckpointError, file_entries
from infra.config import DirectPublish, InprocEngine, RemoteEngine, ServersEngine
from infra.publish import DirectSource, pull
from infra.run import Policy, Run
from tasks.naming import stage_run_name
from tasks.publish.checkpoint import export_weights, loaded, refused


@task(name="load_direct", task_run_name=stage_run_name("load_direct"), cache_policy=NO_CACHE)
def load_direct(run: Run, export_dir: str, version: int, files: dict | None = None, host: str = "127.0.0.1") -> dict:
    """Serve ``export_dir`` over HTTP on ``host``; the engine pulls it, verifies it, and loads it.

    ``files`` (default: computed from ``export_dir``) is the manifest the engine verifies against.
    A file that fails verification is refused as in :func:`tasks.publish.storage.hot_load`.

    Returns:
        ``{"version", "pause_s", "transfer_s", "refused"}``.
    """
    files = files if files is not None else file_entries(Path(export_dir))
    with DirectSource(Path(export_dir), host=host) as source:
        try:
            match run.config.engine:
                case ServersEngine() | RemoteEngine():
                    return stage_on_servers(run, source.url, files, version)
                case InprocEngine():
                    return _pull_then_load(run, source.url, files, version)
                case other:
                    assert_never(other)
        except CheckpointError as e:
            return refused(run, source.url, e)


def stage_on_servers(run: Run, url: str, files: dict, version: int, urls: dict[str, str] | None = None) -> dict:
    """Each replica pulls while serving, then all drain and apply (failed replicas leave the rotation).

    ``urls``: one URL per file (S3 presigned GETs) instead of ``url``'s files.
    """
    engine = run.engine
    transfer_s = engine.stage_direct(url, files, version, urls=urls)

    def apply() -> float:
        t0 = time.monotonic()
        try:
            return engine.apply_staged(version)
        except httpx.HTTPError as e:  # failed replicas are out of rotation; the others serve it
            if not engine.router.live:
                raise
            get_run_logger().warning("v%d applied on the surviving replicas only: %s", version, e)
            return time.monotonic() - t0

    return loaded(version, run.serve(Policy(version, ""), apply), transfer_s)


def _pull_then_load(run: Run, url: str, files: dict, version: int) -> dict:
    """Pull and verify into the run's work folder, then serve it from there."""
    start = time.monotonic()
    local = pull(url, files, run.layout.work / f"v{version}")
    transfer_s = time.monotonic() - start
    return loaded(version, run.serve_folder(Policy(version, str(local))), transfer_s)


@dataclass(frozen=True)
class DirectPublication:
    """Export, the engine pulls it; the S3 checkpoint is uploaded from the same export in the background."""

    config: DirectPublish

    def publish(self, run: Run, ckpt: str, version: int, step: int, upload: Task) -> tuple[dict, PrefectFuture]:
        """See :class:`tasks.publish.Publication`."""
        export_dir = export_weights(run, version)
        result = load_direct(run, export_dir, version, host=self.config.host)
        return result, upload.submit(run, ckpt, version, step, export_dir)
