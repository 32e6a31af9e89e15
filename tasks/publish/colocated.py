"""Colocated publication (``ColocatedPublish``): the in-process engine loads the trainer's tensors from memory."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture

from infra.config import ColocatedPublish
from infra.run import Policy, Run
from tasks.naming import stage_run_name
from tasks.publish.checkpoint import export_weights, loaded


@task(name="load_colocated", task_run_name=stage_run_name("load_colocated"), cache_policy=NO_CACHE)
def load_colocated(run: Run, version: int) -> dict:
    """The in-process engine loads the trainer's float32 tensors from memory.

    Returns:
        ``{"version", "pause_s", "transfer_s", "refused"}`` (``transfer_s``: the copy of the state dict).
    """
    start = time.monotonic()
    state = run.trainer.fp32_state_dict()
    transfer_s = time.monotonic() - start
    pause_s = run.serve(Policy(version, ""), lambda: run.engine.load_tensors(state, version))
    return loaded(version, pause_s, transfer_s)


@dataclass(frozen=True)
class ColocatedPublication:
    """Load from memory first; export and upload the S3 checkpoint in the background."""

    config: ColocatedPublish

    def publish(self, run: Run, ckpt: str, version: int, step: int, upload: Task) -> tuple[dict, PrefectFuture]:
        """See :class:`tasks.publish.Publication`."""
        result = load_colocated(run, version)
        return result, upload.submit(run, ckpt, version, step, export_weights(run, version))
