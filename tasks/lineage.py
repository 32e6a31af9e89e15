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
Prefect's event retention (7 days by default): ``infra.lineage.record``, the same inputs and payload as
the event.
"""

from __future__ import annotations

import functools
import json

from prefect import Task, task
from prefect.assets import Asset, AssetProperties, materialize
from prefect.cache_policies import NO_CACHE
from prefect.context import AssetContext
from prefect.futures import PrefectFuture
from prefect.utilities.annotations import quote

from infra import lineage
from infra.layout import RunLayout
from infra.lineage import ModelAsset


def _run_ids() -> tuple[str, str]:
    from prefect.context import FlowRunContext, TaskRunContext

    flow_ctx, task_ctx = FlowRunContext.get(), TaskRunContext.get()
    return (str(flow_ctx.flow_run.id) if flow_ctx and flow_ctx.flow_run else "",
            str(task_ctx.task_run.id) if task_ctx else "")


def write_lineage(fs, key: str, inputs: list[str], properties: dict | None = None) -> str | None:
    """Store :func:`infra.lineage.record` at ``RunLayout.lineage(key)``; returns its URI (None for non-S3 keys)."""
    if not key.startswith("s3://"):
        return None
    uri = RunLayout.lineage(key)
    fs.pipe_file(uri, json.dumps(lineage.record(key, inputs, properties or {}, *_run_ids()), indent=1,
                                 default=str).encode())
    return uri


def declare_inputs(keys) -> None:
    """Add inputs to the materialization running now, known only once the stage has its result.

    They join the task's ``asset_deps`` in Prefect's event (``AssetContext.direct_asset_dependencies``, the
    set ``emit_events`` reads when the task ends) and the record :func:`as_asset` stores.

    Raises:
        RuntimeError: not inside a materializing task.
    """
    ctx = AssetContext.get()
    if ctx is None or not ctx.downstream_assets:
        raise RuntimeError("declare_inputs: not inside a materializing task (tasks.lineage.as_asset)")
    ctx.direct_asset_dependencies.update(k if isinstance(k, Asset) else Asset(key=k) for k in keys)


def policy_input(run, version: int) -> Asset:
    """The weights of policy ``version`` as an input (``Run.policy_asset``).

    A base model folder carries its folder and digest as the asset's name and description, and its record
    is stored in the run folder (``infra.lineage.BASE_MODEL_RECORD``).
    """
    key = run.policy_asset(version)
    if not key.startswith("model://"):
        return Asset(key=key)
    model: ModelAsset = run.base_model
    folder, digest = model.properties["folder"], model.properties["weights_sha256"]
    record_uri = f"{run.layout.root}/{lineage.BASE_MODEL_RECORD}"
    if not run.fs.exists(record_uri):
        run.fs.pipe_file(record_uri, json.dumps(lineage.record(key, [], model.properties, *_run_ids()),
                                                indent=1).encode())
    return Asset(key=key, properties=AssetProperties(name=key.removeprefix("model://").split("@", 1)[0],
                                                     description=f"base model: HF folder {folder}, "
                                                                 f"weights sha256 {digest}"))


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


def as_asset(stage: Task, key: str, deps: list) -> Materialization:
    """``stage`` (its first argument: the :class:`~infra.run.Run`) as a materializing task of asset ``key``.

    Its upstream is exactly ``deps`` (keys or :class:`~prefect.assets.Asset`) and what the stage adds with
    :func:`declare_inputs`; when the stage returns, the record is written beside ``key``: those inputs and,
    as ``properties``, the metadata the stage attached (``add_asset_metadata``, the event's payload).
    """
    deps = list(deps)
    options = {"cache_policy": stage.cache_policy}
    if stage.result_storage_key is not None:  # a stage persisted under a templated key keeps it
        options = {"result_storage_key": stage.result_storage_key, "persist_result": True,
                   "refresh_cache": stage.refresh_cache}

    @functools.wraps(stage.fn)
    def stage_then_lineage(run, *args, **kwargs):
        result = stage.fn(run, *args, **kwargs)
        ctx = AssetContext.get()
        write_lineage(run.fs, key, [a.key for a in ctx.direct_asset_dependencies],
                      ctx.materialization_metadata.get(key, {}))
        return result

    return Materialization(materialize(key, asset_deps=deps, name=stage.name, task_run_name=stage.task_run_name,
                                       retries=stage.retries,
                                       retry_delay_seconds=stage.retry_delay_seconds, **options)(stage_then_lineage))


def step_lineage_markdown(run, step: int, objects: dict[str, str], sign_s: int = 7 * 24 * 3600) -> str:
    """Markdown of a step's stored objects (label -> ``s3://`` URI) with their declared inputs.

    Each object that exists gets its URI, a presigned HTTP link valid ``sign_s`` seconds (S3's
    maximum is 7 days; the URI itself is permanent) and its inputs from the stored lineage record, each
    with what the record says of it (the policy version that sampled N tokens, the parent weights) and
    of the object itself (its tokens by policy version, an eval report's dtype).
    """
    fs = run.fs
    fs.invalidate_cache()
    lines = [f"# {run.config.run_id}: step {step}, what it made and from what"]
    for label, uri in objects.items():  # one section each, inputs listed below: long keys stay readable
        if not uri or not fs.exists(uri):
            continue
        rec = {}
        if fs.exists(RunLayout.lineage(uri)):
            rec = json.loads(fs.cat_file(RunLayout.lineage(uri)))
        properties = rec.get("properties", {})
        target = uri if fs.isfile(uri) else f"{uri.rstrip('/')}/manifest.json"
        try:
            link = f" · [open]({fs.sign(target, expiration=sign_s)})"
        except (NotImplementedError, ValueError):
            link = ""
        own = lineage.node_note(properties, uri)
        lines += ["", f"### {label}{f' ({own})' if own else ''}", "", f"`{uri}`{link}", ""]
        if not rec:
            lines.append("no lineage record (not a materialized asset)")
            continue
        lines += ["made from:", ""] if rec["inputs"] else ["made from: (declared none)"]
        lines += [f"- `{i}`" + (f" ({note})" if (note := lineage.edge_note(properties, i)) else "")
                  for i in rec["inputs"]]
    lines += ["", f"The whole tree of an object with a record: `python -m flows.lineage <uri>`; an episode: "
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
