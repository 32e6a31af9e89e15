"""Prefect task: build the run's environments and store the catalog (``envs.json``)."""

from __future__ import annotations

import json
from collections import Counter

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.assets import add_asset_metadata, materialize
from prefect.cache_policies import NO_CACHE

from infra.environments import Catalog, EnvEntry, build_catalog, load_run_tasks
from infra.layout import artifact_key
from infra.run import Run
from infra.task_faults import classify
from tasks.naming import stage_run_name


def image_asset(image: str) -> str:
    """Asset key of a task image."""
    return f"docker://{image}"


@task(name="build_envs", task_run_name=stage_run_name("build_envs"),
      cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def build_envs(run: Run) -> str:
    """Load every task, build images (keyed by build-context hash), validate, write ``envs.json``; returns its URI.

    Tasks that fail to load, build or validate are listed as unusable with the reason; the flow
    goes on. Validation verdicts are cached at ``RunLayout.validation(key)``; build and validation
    logs at ``RunLayout.envs_log(task_id)``.
    """
    tasks, split, errors = load_run_tasks(run.config.tasks)

    def cache_get(key: str) -> dict | None:
        try:
            return json.loads(run.fs.cat_file(run.layout.validation(key)))
        except FileNotFoundError:
            return None

    def cache_put(key: str, value: dict) -> None:
        run.fs.pipe_file(run.layout.validation(key), json.dumps(value).encode())

    t = run.config.tasks
    log = get_run_logger()
    log.info("building and validating %d tasks (%d not loaded)", len(tasks), len(errors))
    entries, logs = build_catalog(run.backend, tasks, split, validate=t.validate_tasks, base_images=t.base_images,
                                  fallback_base=t.fallback_base_image or None, cache_get=cache_get,
                                  cache_put=cache_put, build_network=t.build_network,
                                  registry_mirrors=t.registry_mirrors, reference_less=t.reference_less,
                                  progress=log.info)
    for task_id, text in logs.items():  # build and validation logs, kept next to the catalog
        if text.strip():
            run.fs.pipe_file(run.layout.envs_log(task_id), text.encode())
    uri = run.store_catalog(Catalog(tuple(entries), tuple(errors)))
    log.info("%s", catalog_summary(entries, errors))
    for e in entries:
        if not e.usable:
            log.warning("task %s unusable [%s]: %s. Fix: %s\n%s", e.task_id, e.cause, e.reason[:500], e.fix,
                        logs.get(e.task_id, "")[-2000:])
    for err in errors:
        cause, fix = classify(f"task folder not loaded: {err}", err)
        log.warning("task folder not loaded [%s]: %s. Fix: %s", cause, err, fix)
    create_table_artifact(
        key=artifact_key(run.config.run_id, "envs"),
        table=[{"task": e.task_id, "format": e.task_format, "split": e.split, "image": e.image, "built": e.built,
                "validation": e.validation, "usable": e.usable, "cause": e.cause, "fix": e.fix,
                "reason": e.reason[:300]} for e in entries],
        description=f"Environments of run {run.config.run_id}: {catalog_summary(entries, errors)}",
    )
    return uri


def catalog_summary(entries: list[EnvEntry], load_errors: list[str]) -> str:
    """One line: ``N of M usable (U unverified reference), K not loaded`` and the unusable ones by cause.

    ``unverified reference``: usable tasks without a reference solution (``validation =
    "unverified_reference"``), counted apart from those whose solution passed; named only when there are some.
    """
    causes = Counter(e.cause for e in entries if not e.usable)
    causes.update(classify(f"task folder not loaded: {err}", err)[0] for err in load_errors)
    by_cause = ", ".join(f"{c} {n}" for c, n in causes.most_common())
    unverified = sum(e.usable and e.validation == "unverified_reference" for e in entries)
    apart = f" ({unverified} unverified reference)" if unverified else ""
    return (f"{sum(e.usable for e in entries)} of {len(entries) + len(load_errors)} usable{apart}, "
            f"{len(load_errors)} not loaded" + (f" (unusable by cause: {by_cause})" if by_cause else ""))


def task_image_assets(run: Run, task_ids: list[str]) -> list[str]:
    """Asset keys of the images the usable tasks among ``task_ids`` run in (a rollout file's upstream)."""
    images = run.catalog.images()
    return sorted({image_asset(images[t][0]) for t in task_ids if t in images})


def materialize_task_images(run: Run) -> list[str]:
    """Record one asset materialization per usable task image (the lineage roots); returns the asset keys.

    Image assets are only known once the catalog exists, so the materializing task is made here.
    """
    images = {e.image: e for e in run.catalog.usable()}
    keys = [image_asset(image) for image in images]

    def record() -> None:
        for image, e in images.items():
            add_asset_metadata(image_asset(image), {"digest": e.image_digest, "catalog": run.layout.catalog})

    if keys:
        materialize(*keys, by="docker", cache_policy=NO_CACHE)(record).with_options(name="task_images")()
    return keys
