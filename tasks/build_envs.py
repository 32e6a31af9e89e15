"""Prefect task: build the run's environments and store the catalog (``envs.json``)."""

from __future__ import annotations

import json

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.assets import add_asset_metadata, materialize
from prefect.cache_policies import NO_CACHE

from infra.config import RunConfig
from infra.environments import build_catalog, catalog_to_json
from tasks.runtime import artifact_key, load_run_tasks, run_uri, runtime


def image_asset(image: str) -> str:
    """Asset key of a task image."""
    return f"docker://{image}"


@task(name="build_envs", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def build_envs(config: RunConfig) -> str:
    """Load every task, build images (keyed by build-context hash), validate, write ``envs.json``; returns its URI.

    Tasks that fail to load, build or validate are listed as unusable with the reason; the flow
    goes on. Validation verdicts are cached under ``s3://{bucket}/validation/{key}.json``; build
    and validation logs are kept at ``{run}/envs-logs/{task id, / as __}.log``.
    """
    rt = runtime(config)
    tasks, split, errors = load_run_tasks(config)
    cache_root = f"s3://{config.storage.bucket}/validation"

    def cache_get(key: str) -> dict | None:
        try:
            return json.loads(rt.fs.cat_file(f"{cache_root}/{key}.json"))
        except FileNotFoundError:
            return None

    def cache_put(key: str, value: dict) -> None:
        rt.fs.pipe_file(f"{cache_root}/{key}.json", json.dumps(value).encode())

    t = config.tasks
    entries, logs = build_catalog(rt.backend, tasks, split, validate=t.validate_tasks, base_images=t.base_images,
                                  fallback_base=t.fallback_base_image or None, cache_get=cache_get,
                                  cache_put=cache_put)
    catalog = catalog_to_json(entries, errors)
    for task_id, text in logs.items():  # build and validation logs, kept next to the catalog
        if text.strip():
            rt.fs.pipe_file(f"{run_uri(config)}/envs-logs/{task_id.replace('/', '__')}.log", text.encode())
    uri = f"{run_uri(config)}/envs.json"
    rt.fs.pipe_file(uri, json.dumps(catalog, indent=1).encode())
    log = get_run_logger()
    for e in entries:
        if not e.usable:
            log.warning("task %s unusable: %s\n%s", e.task_id, e.reason, logs.get(e.task_id, "")[-2000:])
    for err in errors:
        log.warning("task folder not loaded: %s", err)
    create_table_artifact(
        key=artifact_key(config.run_id, "envs"),
        table=[{"task": e.task_id, "format": e.task_format, "split": e.split, "image": e.image, "built": e.built,
                "validation": e.validation, "usable": e.usable, "reason": e.reason[:300]} for e in entries],
        description=f"Environments of run {config.run_id}: {sum(e.usable for e in entries)}/{len(entries)} usable",
    )
    return uri


def task_image_assets(config: RunConfig, catalog_uri: str, task_ids: list[str]) -> list[str]:
    """Asset keys of the images the usable tasks among ``task_ids`` run in (a rollout file's upstream)."""
    catalog = runtime(config).load_catalog(catalog_uri)
    image_of = {e["task_id"]: e["image"] for e in catalog["tasks"] if e["usable"]}
    return sorted({image_asset(image_of[t]) for t in task_ids if t in image_of})


def materialize_task_images(config: RunConfig, catalog_uri: str) -> list[str]:
    """Record one asset materialization per usable task image (the lineage roots); returns the asset keys.

    Image assets are only known once the catalog exists, so the materializing task is made here.
    """
    catalog = runtime(config).load_catalog(catalog_uri)
    images = {e["image"]: e for e in catalog["tasks"] if e["usable"]}
    keys = [image_asset(image) for image in images]

    def record() -> None:
        for image, e in images.items():
            add_asset_metadata(image_asset(image), {"digest": e["image_digest"], "catalog": catalog_uri})

    if keys:
        materialize(*keys, by="docker", cache_policy=NO_CACHE)(record).with_options(name="task_images")()
    return keys
