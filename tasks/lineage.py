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

from prefect import Task, task
from prefect.assets import materialize
from prefect.cache_policies import NO_CACHE
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


def step_lineage_markdown(run, step: int, objects: dict[str, str], sign_s: int = 7 * 24 * 3600) -> str:
    """Markdown of a step's stored objects (label -> ``s3://`` URI) with their declared inputs.

    Each object that exists gets its URI, a presigned HTTP link valid ``sign_s`` seconds (S3's
    maximum is 7 days; the URI itself is permanent) and its inputs from the stored lineage record.
    """
    fs = run.fs
    fs.invalidate_cache()
    lines = [f"# {run.config.run_id}: step {step}, what it made and from what", "",
             "| object | stored at | open | made from |", "|---|---|---|---|"]
    for label, uri in objects.items():
        if not uri or not fs.exists(uri):
            continue
        inputs = []
        if fs.exists(RunLayout.lineage(uri)):
            inputs = json.loads(fs.cat_file(RunLayout.lineage(uri)))["inputs"]
        target = uri if fs.isfile(uri) else f"{uri.rstrip('/')}/manifest.json"
        try:
            link = f"[open]({fs.sign(target, expiration=sign_s)})"
        except (NotImplementedError, ValueError):
            link = ""
        made_from = "<br>".join(f"`{i}`" for i in inputs) or "(declared none)"
        lines.append(f"| {label} | `{uri}` | {link} | {made_from} |")
    lines += ["", f"Tree of any of them: `python -m flows.lineage <uri>`; an episode: "
              f"`python -m flows.show_episode --config configs/{run.config.name or 'quickstart'}.toml "
              f"--run-id {run.config.run_id} --step {step} --chosen`."]
    return "\n".join(lines)


@task(name="publish_step_lineage", task_run_name="publish_step_lineage step {step}", cache_policy=NO_CACHE,
      retries=2, retry_delay_seconds=2)
def publish_step_lineage(run, step: int, objects: dict[str, str]) -> str:
    """The ``<run>-step-<step>-lineage`` markdown artifact (:func:`step_lineage_markdown`); returns its key."""
    from prefect.artifacts import create_markdown_artifact

    from infra.layout import artifact_key

    key = artifact_key(run.config.run_id, f"step-{step}-lineage")
    create_markdown_artifact(key=key, markdown=step_lineage_markdown(run, step, objects),
                             description=f"{run.config.run_id} step {step}: trajectories, checkpoint, eval report")
    return key
