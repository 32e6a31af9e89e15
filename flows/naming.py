"""How a flow run is found in the Prefect UI: named by its run id (and step or version), tagged with run and config.

Tags: ``run:{run_id}`` and ``config:{config.name}`` (the TOML's stem, or the deployment's config) on
the flow run and every task run in it, so the UI's tag filter finds a run's whole history,
resumes included.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from infra.config import RunConfig


def flow_run_name() -> str:
    """``flow_run_name`` of the flows: ``{run_id}``, plus `` step {step}`` / `` v{version}`` when given."""
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    config = params.get("config")
    run_id = config.get("run_id") if isinstance(config, dict) else getattr(config, "run_id", None)
    name = run_id or RunConfig().run_id
    if isinstance(params.get("step"), int):
        name += f" step {params['step']}"
    if isinstance(params.get("version"), int):
        name += f" v{params['version']}"
    return name


def run_tags(config: RunConfig) -> list[str]:
    """The tags of a run's flow and task runs."""
    return [f"run:{config.run_id}", *([f"config:{config.name}"] if config.name else [])]


@contextmanager
def tagged(config: RunConfig) -> Iterator[list[str]]:
    """Tag the current flow run with :func:`run_tags` and every task run started inside the block.

    The flow run is also recorded for the watchdog of ``infra.prefect_backend.flow_backend``.
    """
    from prefect import tags
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    from infra.prefect_backend import record_flow_run

    wanted = run_tags(config)
    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow_run is not None:
        record_flow_run(str(ctx.flow_run.id))  # the watchdog crashes it if this process dies mid-run
        missing = [t for t in wanted if t not in ctx.flow_run.tags]
        if missing:
            with get_client(sync_client=True) as client:
                client.update_flow_run(ctx.flow_run.id, tags=[*ctx.flow_run.tags, *missing])
    with tags(*wanted):
        yield wanted
