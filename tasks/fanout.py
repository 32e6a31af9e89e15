"""Fan a step's rollout collection out to workers: one Prefect task per group, run by a task runner (Ray).

Each worker builds its own HTTP client to the run's vLLM OpenAI servers (``engine.kind = "servers"``,
routed by its ``routing``) and its own Docker client, collects one group (G attempts), and returns
the rows; the flow stores them as the step's Parquet file. With ``prefect_ray.RayTaskRunner`` the
groups run as Ray tasks, on a local Ray instance (started for the run) or an existing cluster
(``ray_address``). Workers need the project importable, a dockerd, and the servers' URLs reachable.
"""

from __future__ import annotations

import os
import time

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from envs.task import Task
from infra.config import RunConfig
from infra.environments import BASE_IMAGE
from infra.rollout.collector import Collector, CollectSettings
from infra.rollout.engine_auth import TOKEN_ENV
from tasks.naming import stage_run_name


@task(name="collect_group", task_run_name=stage_run_name("collect_group"), cache_policy=NO_CACHE)
def collect_group(config: RunConfig, servers: list[dict], policy_version: int, task_obj: Task, group_index: int,
                  step: int, images: dict[str, tuple[str, str]],
                  shipped: dict[str, tuple[str, str]] | None = None) -> dict:
    """One group on a fan-out worker: its rows (retries included, as Collector.collect), pid, images loaded.

    Returns ``{"rows", "pid", "loaded": refs this worker's engine loaded from S3}``.

    ``servers``: ``RemoteServer`` fields (url, model_dir, max_model_len, dtype) of the run's engines, their
    token in ``$AGENTRL_ENGINE_TOKEN``; ``config.engine`` is ``servers`` or ``remote`` (its ``routing`` applies).
    ``shipped``: the images staged on S3 (``infra.sandbox.image_ship``); the worker's engine (``DOCKER_HOST``)
    loads those it lacks, from S3 (``AGENTRL_S3_ENDPOINT`` and ``AWS_*`` of the worker).
    """
    from transformers import AutoTokenizer

    from infra.reaper import ensure_watchdog
    from infra.rollout.servers import RemoteServer, ServerEngine
    from infra.sandbox.docker_backend import DockerBackend

    r = config.rollout
    token = os.environ.get(TOKEN_ENV)  # set by ray_task_runner(env=...): a token is never a task parameter
    handles = RemoteServer.all_of(servers, token)
    engine = ServerEngine(handles, AutoTokenizer.from_pretrained(handles[0].model_dir), config.engine.routing,
                          policy_version=policy_version, declare_version=False)
    # A worker on a cluster node is no child of the run, so no run's watchdog covers it: it gets its own,
    # which removes this worker's sandboxes when the worker ends (Ray kills a job's workers when its driver
    # dies, SIGKILL included). No reap_orphans here: its host:pid test is only sound in the flow's own
    # PID namespace, and a node (a container with the host's name) may have another.
    ensure_watchdog()
    try:
        backend, loaded = DockerBackend(), []
        if shipped:
            from infra.sandbox.image_ship import ensure_images
            from infra.storage import s3_filesystem

            loaded = ensure_images(s3_filesystem(config.storage.bucket), backend.client, shipped)
        collector = Collector(engine, backend, CollectSettings.of(r), code_image=BASE_IMAGE)
        try:
            rows = collector.collect(config.run_id, step, [task_obj], images, first_group=group_index)
        finally:
            collector.close()
        return {"rows": rows, "pid": os.getpid(), "loaded": loaded}
    finally:
        engine.close()


@flow(name="collect_groups_fan_out")
def collect_groups(config: RunConfig, servers: list[dict], policy_version: int, tasks: list[Task], step: int,
                   images: dict[str, tuple[str, str]], shipped: dict[str, tuple[str, str]] | None = None) -> dict:
    """Submit one ``collect_group`` per task to this flow's task runner and gather the rows.

    Returns:
        ``{"rows": all rows, by group, "wall_s": seconds until the last group came back,
        "worker_pids": the process of each group, "loaded": images loaded by a worker's engine}``.
    """
    start = time.monotonic()
    futures = [collect_group.submit(config, servers, policy_version, t, i, step, images, shipped)
               for i, t in enumerate(tasks)]
    parts = [f.result() for f in futures]
    return {"rows": [row for p in parts for row in p["rows"]], "wall_s": time.monotonic() - start,
            "worker_pids": [p["pid"] for p in parts], "loaded": sorted({i for p in parts for i in p["loaded"]})}


def collect_step_on_ray(run, task_ids: list[str], step: int, deps: list[str], ray_address: str = ""):
    """A step's rollouts on Ray: one ``collect_group`` per task, the rows stored as the step's Parquet file.

    The run's servers start here on first use; their token reaches the workers in their environment, never as
    a task parameter (Prefect stores those). The task images (and the base image) are staged on S3 by image
    id once, and a worker whose engine lacks one loads it. Every group runs to its end (the sync scheduler's
    semantics); a stored file of an earlier attempt of this step is overwritten, never appended to.

    Returns:
        ``(RolloutStats, {"fan_out": "ray", "worker_pids": [...], "images_loaded": [...]})``.
    """
    from dataclasses import replace

    from tasks.lineage import as_asset
    from tasks.rollouts import store_step

    start = time.monotonic()
    servers, token, shipped = run.ray_handoff()
    runner = ray_task_runner(ray_address, env={TOKEN_ENV: token} if token else None)
    fan = collect_groups.with_options(task_runner=runner)
    images = run.catalog.images()
    gathered = fan(run.config, servers, run.policy.version, [run.tasks[t] for t in task_ids], step, images, shipped)
    store = task(name="store_rollouts", cache_policy=NO_CACHE)(store_step)
    result = as_asset(store, run.layout.trajectories(step), deps)(run, step, gathered["rows"], [], {},
                                                                  gathered["wall_s"])
    get_run_logger().info("step %d: %d rows from %d groups on Ray, reward mean %.3f, %s", step, result.rows,
                          len(task_ids), result.reward_mean, result.outcomes)
    return (replace(result, stage_s=time.monotonic() - start),
            {"fan_out": "ray", "worker_pids": gathered["worker_pids"], "images_loaded": gathered["loaded"]})


def ray_task_runner(address: str = "", env: dict[str, str] | None = None):
    """A ``RayTaskRunner``: on the cluster at ``address``, or a local Ray instance (no dashboard, small store).

    ``env``: environment variables of every worker (Ray's ``runtime_env``), e.g. the engines' token.
    """
    from prefect_ray import RayTaskRunner

    runtime = {"runtime_env": {"env_vars": dict(env)}} if env else {}
    if address:
        return RayTaskRunner(address=address, init_kwargs=runtime)
    # "local": a new instance even when this machine runs a cluster (`ray start`), which ray.init() would join
    return RayTaskRunner(address="local", init_kwargs={"include_dashboard": False,
                                                       "object_store_memory": 256 * 1024**2, "log_to_driver": False,
                                                       **runtime})
