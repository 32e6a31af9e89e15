"""Preflight of a run's inputs: every input a run needs is checked before anything is built or written.

The S3 endpoint and bucket, the Docker engine, the task sources and the model folder; a bad one
raises :class:`RunInputError` naming it (the CLI prints it as one ``error:`` line, exit 2). Checking
takes seconds, not the minutes after which a flow would otherwise fail inside a task, retried.
"""

from __future__ import annotations

import os

from infra.config import RemoteEngine, RunConfig
from infra.layout import RunLayout


class RunInputError(ValueError):
    """An input of the run (endpoint, engine, task source, model) cannot be used; the message names it."""


def preflight(config: RunConfig, *, docker: bool = True, model: bool = True, tasks: bool = True):
    """Check that the run's inputs are reachable and readable; writes nothing; returns the S3 filesystem.

    Args:
        config: the run config.
        docker: check the Docker engine (``DOCKER_HOST`` or the default socket) answers a ping.
        model: check ``model.path`` is an HF model folder (or the built-in SmolLM2 name), unless the
            run already published a version (a resumed run starts from its newest checkpoint); and, for
            ``engine.kind = "remote"``, that every server answers with the token.
        tasks: load the configured task sources (fatal errors only; a broken task is reported
            by ``build_envs`` and does not stop the others).

    Raises:
        RunInputError: the first input that cannot be used, by name.
    """
    from infra.storage import StorageError, s3_filesystem

    try:
        fs = s3_filesystem(config.storage.bucket)
    except StorageError as e:
        raise RunInputError(f"storage: {e}") from e
    if docker:
        import docker as docker_sdk

        where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        try:
            client = docker_sdk.from_env(timeout=10)
            client.ping()
            client.close()
        except Exception as e:  # docker raises DockerException, requests' ConnectionError, OSError...
            raise RunInputError(f"Docker engine at {where} not reachable (DOCKER_HOST): {e}; "
                                "run `make up` and source .state/services.env") from e
    if tasks:
        from envs.task import TaskError
        from infra.environments import load_run_tasks

        try:
            load_run_tasks(config.tasks)
        except (TaskError, ValueError, TypeError) as e:
            raise RunInputError(f"tasks: {e}") from e
    if model and isinstance(config.engine, RemoteEngine):  # the servers answer, with the token
        from infra.rollout.servers import connect_remote

        try:
            connect_remote(config.engine.urls, os.environ.get(config.engine.token_env, ""),
                           config.model.serving_dtype, config.engine.token_env)
        except RuntimeError as e:
            raise RunInputError(str(e)) from e
    if model:
        from infra.checkpoint import published_versions
        from infra.model import SMOLLM2, resolve_model

        s = config.storage
        # the built-in model is prepared on first use; a resumed run never reads model.path
        if config.model.path != SMOLLM2 and not published_versions(fs, RunLayout(s.bucket, s.prefix, config.run_id)):
            try:
                resolve_model(config.model.path)
            except FileNotFoundError as e:
                raise RunInputError(str(e)) from e
    return fs
