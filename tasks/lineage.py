"""Run a stage as a Prefect materializing task, so it records an asset event with its upstream assets.

Asset keys are storage URIs (``s3://...``) or image references (``docker://...``), known only
at run time, so the materializing task is made per call from the stage's plain task.
"""

from __future__ import annotations

from prefect import Task
from prefect.assets import materialize


def as_asset(stage: Task, key: str, deps: list[str]) -> Task:
    """``stage`` as a materializing task of asset ``key`` depending on ``deps``."""
    options = {"cache_policy": stage.cache_policy}
    if stage.result_storage_key is not None:  # a stage persisted under a templated key keeps it
        options = {"result_storage_key": stage.result_storage_key, "persist_result": True,
                   "refresh_cache": stage.refresh_cache}
    return materialize(key, asset_deps=list(deps), name=stage.name, retries=stage.retries,
                       retry_delay_seconds=stage.retry_delay_seconds, **options)(stage.fn)
