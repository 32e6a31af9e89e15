"""Prefect tasks: get trained version N to the rollout engine, by the type of ``config.publish``.

One :class:`Publication` per kind, each in its own module:

- ``storage`` (:mod:`.storage`): ``publish_checkpoint`` (export, upload, manifest last), then
  ``hot_load`` (fetch, verify, load);
- ``direct`` (:mod:`.direct`): ``export_weights``, then ``load_direct`` (the engine pulls the files
  from the trainer's HTTP source and verifies them), while ``publish_checkpoint`` uploads the export
  in the background;
- ``colocated`` (:mod:`.colocated`): ``load_colocated`` (the in-process engine loads the trainer's
  tensors from memory), then ``export_weights`` and the background upload.

:class:`Publisher` is the stage: it runs the publication, times it, and awaits each background
upload before the next publication and when the block ends.
"""

from __future__ import annotations

import time
from typing import Protocol, assert_never

from prefect import Task
from prefect.futures import PrefectFuture

from infra.config import ColocatedPublish, DirectPublish, PublishConfig, StoragePublish
from infra.run import Run
from infra.summary import PublishResult
from tasks.lineage import as_asset, policy_input
from tasks.publish.checkpoint import export_weights, publish_checkpoint
from tasks.publish.colocated import ColocatedPublication, load_colocated
from tasks.publish.direct import DirectPublication, load_direct
from tasks.publish.storage import StoragePublication, hot_load

__all__ = ["Publication", "Publisher", "export_weights", "hot_load", "load_colocated", "load_direct",
           "publication_for", "publish_checkpoint"]


class Publication(Protocol):
    """One way (a ``publish.kind``) to get a trained version to the engine and into S3."""

    def publish(self, run: Run, ckpt: str, version: int, step: int,
                upload: Task) -> tuple[dict, PrefectFuture | None]:
        """Serve ``version`` (trained in ``step``) and upload it as checkpoint ``ckpt`` with ``upload``.

        ``upload`` is ``publish_checkpoint`` as a materializing task of ``ckpt``. Returns the load
        result (``{"version", "pause_s", "transfer_s", "refused"}``) and the upload still running in
        the background (None when it already finished).
        """
        ...


def publication_for(config: PublishConfig) -> Publication:
    """The publication of a ``publish`` config, by its type."""
    match config:
        case StoragePublish():
            return StoragePublication(config)
        case DirectPublish():
            return DirectPublication(config)
        case ColocatedPublish():
            return ColocatedPublication(config)
        case other:
            assert_never(other)


class Publisher:
    """The publication stage of a run: ``with Publisher(run) as publish: publish(step, trajectories_uri)``.

    Leaving the block awaits the last background upload (raises if it failed).
    """

    def __init__(self, run: Run):
        """Publish ``run``'s trained versions by the type of ``run.config.publish``."""
        self.run = run
        self._publication = publication_for(run.config.publish)
        self._upload: PrefectFuture | None = None  # the previous version's background upload

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
        """Get version ``step + 1`` (trained on ``trajectories_uri`` from version ``step``) to the engine.

        The checkpoint's inputs are those trajectories and its parent weights (``Run.policy_asset(step)``:
        checkpoint ``v{step}``, or the base model).
        """
        start = time.monotonic()
        wait_s = self.wait()
        version = step + 1
        ckpt = self.run.layout.checkpoint(version)
        t_publish = time.monotonic()
        inputs = [trajectories_uri, policy_input(self.run, version - 1)]
        loaded, self._upload = self._publication.publish(self.run, ckpt, version, step,
                                                         as_asset(publish_checkpoint, ckpt, inputs))
        end = time.monotonic()
        return PublishResult(ckpt, loaded["version"], self.run.config.publish.kind, loaded["pause_s"],
                             loaded["transfer_s"], loaded["refused"], end - t_publish, wait_s, end - start)
