"""Run a stage as a Prefect materializing task whose lineage is exactly the inputs it declares.

Asset keys are storage URIs (``s3://...``) or image references (``docker://...``), known only
at run time, so the materializing task is made per call from the stage's plain task.

Only declared inputs are recorded. Prefect also infers upstream assets from a task's arguments,
by the ``id()`` of values earlier tasks returned (``prefect.utilities.engine.link_state_to_result``;
for dicts, lists and strings without an identity check). A string shared through the config, or a
freed object whose address a new argument reuses, then made v1's eval report an "input" of the
step-1 trajectories. Every argument is passed as ``prefect.utilities.annotations.quote``, which
Prefect neither traverses nor links; futures stay unquoted so they still resolve.

The lineage is also written beside each ``s3://`` artifact (``RunLayout.lineage``), so it outlives
Prefect's event retention (7 days by default): ``{"asset", "inputs", "flow_run_id", "task_run_id",
"written_at"}``.
"""

from __future__ import annotations

import functools
import json
import time

from prefect import Task
from prefect.assets import materialize
from prefect.futures import PrefectFuture
from prefect.utilities.annotations import quote

from infra.layout import RunLayout


def lineage_record(key: str, inputs: list[str]) -> dict:
    """The record stored beside ``key``: its declared inputs and the Prefect runs that made it."""
    from prefect.context import FlowRunContext, TaskRunContext

    flow_ctx, task_ctx = FlowRunContext.get(), TaskRunContext.get()
    return {"asset": key, "inputs": sorted(inputs),
            "flow_run_id": str(flow_ctx.flow_run.id) if flow_ctx and flow_ctx.flow_run else "",
            "task_run_id": str(task_ctx.task_run.id) if task_ctx else "", "written_at": time.time()}


def write_lineage(fs, key: str, inputs: list[str]) -> str | None:
    """Store :func:`lineage_record` at ``RunLayout.lineage(key)``; returns its URI (None for non-S3 keys)."""
    if not key.startswith("s3://"):
        return None
    uri = RunLayout.lineage(key)
    fs.pipe_file(uri, json.dumps(lineage_record(key, inputs), indent=1).encode())
    return uri


class Materialization:
    """A stage as a materializing task: call it (or ``.submit``) like the task; arguments are quoted."""

    def __init__(self, task: Task) -> None:
        self.task = task

    @staticmethod
    def _quoted(args: tuple, kwargs: dict) -> tuple[list, dict]:
        def q(v):
            return v if isinstance(v, PrefectFuture) else quote(v)
        return [q(a) for a in args], {k: q(v) for k, v in kwargs.items()}

    def __call__(self, *args, **kwargs):
        """Run the task here (as calling a Prefect task does)."""
        args, kwargs = self._quoted(args, kwargs)
        return self.task(*args, **kwargs)

    def submit(self, *args, **kwargs) -> PrefectFuture:
        """Submit the task to the flow's task runner."""
        args, kwargs = self._quoted(args, kwargs)
        return self.task.submit(*args, **kwargs)

    def with_options(self, **options) -> Materialization:
        """The same materialization with other task options."""
        return Materialization(self.task.with_options(**options))


def as_asset(stage: Task, key: str, deps: list[str]) -> Materialization:
    """``stage`` (its first argument: the :class:`~infra.run.Run`) as a materializing task of asset ``key``.

    Its upstream is exactly ``deps``; when the stage returns, the lineage record is written beside ``key``.
    """
    deps = list(deps)
    options = {"cache_policy": stage.cache_policy}
    if stage.result_storage_key is not None:  # a stage persisted under a templated key keeps it
        options = {"result_storage_key": stage.result_storage_key, "persist_result": True,
                   "refresh_cache": stage.refresh_cache}

    @functools.wraps(stage.fn)
    def stage_then_lineage(run, *args, **kwargs):
        result = stage.fn(run, *args, **kwargs)
        write_lineage(run.fs, key, deps)
        return result

    return Materialization(materialize(key, asset_deps=deps, name=stage.name, task_run_name=stage.task_run_name,
                                       retries=stage.retries,
                                       retry_delay_seconds=stage.retry_delay_seconds, **options)(stage_then_lineage))
