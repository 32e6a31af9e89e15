"""Prefect task: a step's chosen episodes as a markdown artifact and beside the run on S3 (``infra.episodes``)."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from infra.episodes import load_decoder, render_step_episodes
from infra.layout import artifact_key
from infra.model import resolve_model
from infra.run import Run
from infra.store import read_step
from tasks.naming import stage_run_name


@task(name="publish_step_episodes", task_run_name=stage_run_name("publish_step_episodes"),
      cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def publish_step_episodes(run: Run, step: int, trajectories_uri: str) -> str:
    """Render the step's chosen episodes (``render_step_episodes``) and publish them; returns the S3 URI.

    Reads the rows at ``trajectories_uri``, decodes them with the tokenizer of the run's ``model.path``
    (the rollout engine's; checkpoints never change it), writes ``RunLayout.episodes(step)`` and the
    ``<run>-episodes-step-<step>`` markdown artifact. Advantages use the run's ``train.scale_by_std``
    and ``train.baseline``. Idempotent: a retry rewrites the same object.

    Raises:
        SchemaError: the step file does not match the trajectory schema.
        ValueError: no rows, or a row whose replies do not match its commands (``decode_turns``).
    """
    rows = read_step(run.fs, trajectories_uri).to_pylist()
    decode, markers = load_decoder(resolve_model(run.config.model.path))
    train = run.config.train
    markdown = render_step_episodes(rows, decode, run.config.rollout.harness.kind, markers=markers,
                                    scale_by_std=train.scale_by_std, baseline=train.baseline)
    uri = run.layout.episodes(step)
    run.fs.pipe_file(uri, markdown.encode())
    create_markdown_artifact(key=artifact_key(run.config.run_id, f"episodes-step-{step}"), markdown=markdown,
                             description=f"post_train {run.config.run_id}: step {step}'s chosen episodes, "
                                         "turn by turn")
    return uri
