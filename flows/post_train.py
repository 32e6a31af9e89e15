"""The main loop as a Prefect flow: build envs → difficulty → rollouts → store → train → publish → evaluate.

Run it: ``python -m flows.post_train --config configs/quickstart.toml`` (``make run`` does this
after bringing up the local services). Each stage is a Prefect task; stages pass URIs. Re-running
the same ``run_id`` resumes after the last published checkpoint.
"""

from __future__ import annotations

import sys

from prefect import flow, get_run_logger

from flows.naming import flow_run_name, tagged
from infra.config import RunConfig, SyncScheduler
from infra.config_record import claim as claim_config
from infra.evaluate import PrecisionMismatch
from infra.run import Run
from infra.summary import StepSummary
from tasks.build_envs import build_envs, materialize_task_images, task_image_assets
from tasks.difficulty import select_step_tasks
from tasks.episodes import publish_step_episodes
from tasks.evaluate import evaluate_published
from tasks.lineage import publish_step_lineage
from tasks.policy import prepare_policy
from tasks.publish import Publisher
from tasks.report import record_step
from tasks.rollouts import rollouts_for_step
from tasks.train import train

DEFAULT_CONFIG = RunConfig()


@flow(name="post_train", flow_run_name=flow_run_name, log_prints=True)
def post_train(config: RunConfig = DEFAULT_CONFIG, allow_config_change: bool = False) -> list[dict]:
    """Run ``config.steps`` GRPO steps of agentic RL post-training; returns one stored summary per step run.

    The inputs are checked first (``Run.open``: S3, Docker, task sources, model; a bad one fails
    here, before any task or write). The config is stored with the run; resuming it with another config
    is refused (``infra.config_record``) unless ``allow_config_change``. Summary keys: see
    ``infra.summary.StepSummary.to_json``.

    Args:
        config: the run config (the form's defaults are the deployment's config; its run_id names the run).
        allow_config_change: continue a stored run whose config.json differs from ``config`` (the old one is
            kept in config-history/); off: such a run is refused, naming the differing fields.
    """
    check_eval_precision(config)
    with tagged(config), Run.open(config) as run, Publisher(run) as publish:
        claim_config(run.fs, config, allow_config_change)
        build_envs(run)
        materialize_task_images(run)
        summaries = []
        for step in range(prepare_policy(run), config.steps):
            selection = select_step_tasks(run, step)
            batch = step_rollouts(run, selection.chosen, step)
            trained = train(run, batch, step)
            published = publish(step, batch.uri)
            evaluated = evaluate_published(run, published)
            summary = StepSummary.of(step, selection, batch, trained, published, evaluated)
            print(summary.line())
            record_step(run, summary)
            episodes = publish_episodes(run, step, batch.uri)
            lineage = publish_step_lineage(run, step, return_state=True, objects={
                "trajectories": batch.uri, "dropped groups": run.layout.dropped(step),
                "checkpoint": published.checkpoint,
                "eval report": run.layout.eval_report(published.version) if evaluated.report else "",
                "episodes": episodes, "summary": run.layout.summary(step), "run report": run.layout.report})
            if not lineage.is_completed():  # it explains the committed step; it is not part of it
                get_run_logger().warning("step %d: lineage artifact not published: %s", step, lineage.message)
            summaries.append(summary.to_json())
    return summaries


def step_rollouts(run: Run, task_ids: list[str], step: int):
    """The step's rollouts (``RolloutStats``).

    With ``rollout.fan_out = "ray"`` and the sync scheduler, one Ray task per group
    (``tasks.fanout.collect_step_on_ray``; a resumed step collects again); else through
    ``tasks.rollouts.rollouts_for_step`` (an earlier attempt's valid file is reused), whose async collector
    runs its episodes on Ray actors under ``fan_out = "ray"``.
    """
    deps = task_image_assets(run, task_ids)
    if run.config.rollout.fan_out == "ray" and isinstance(run.config.rollout.scheduler, SyncScheduler):
        from tasks.fanout import collect_step_on_ray

        return collect_step_on_ray(run, task_ids, step, deps, run.config.rollout.ray_address)[0]
    return rollouts_for_step(run, task_ids, step, deps)


def publish_episodes(run: Run, step: int, trajectories_uri: str) -> str:
    """The step's episode viewer (``tasks.episodes``); returns its URI, or "" when it could not be rendered.

    A viewer that fails (a row its decoder cannot split) is logged and leaves the step as it is: it
    explains the step, it is not part of it.
    """
    state = publish_step_episodes(run, step, trajectories_uri, return_state=True)
    if state.is_completed():
        return state.result()
    get_run_logger().warning("step %d: episode viewer not published: %s", step, state.message)
    return ""


def check_eval_precision(config: RunConfig) -> None:
    """post_train evaluates with its serving engine: refuse another ``eval.dtype``.

    Raises:
        PrecisionMismatch: ``eval.enabled`` with an ``eval.dtype`` other than the serving dtype.
    """
    if config.eval.enabled and config.eval.dtype not in ("serving", config.model.serving_dtype):
        raise PrecisionMismatch(f"eval.dtype={config.eval.dtype}: post_train evaluates with its serving engine "
                                f"({config.model.serving_dtype}); evaluate other precisions with flows.evaluate")


def main(argv: list[str] | None = None) -> int:
    """CLI: ``--config``, ``--run-id``, ``--steps``, ``--seed``, then the flow.

    The config and the run's inputs are checked before anything loads (one ``error:`` line and
    exit 2 on a bad one).
    """
    from flows.cli import run_flow_cli

    return run_flow_cli(post_train, __doc__, argv, precheck=check_eval_precision,
                        config_options=[("--steps", "steps", {"type": int, "help": "override config steps"}),
                                        ("--seed", "rollout.seed", {"type": int, "help": "override rollout.seed"})],
                        show=lambda summaries, config: print(f"post_train {config.run_id}: "
                                                             f"{len(summaries)} step(s) run"))


if __name__ == "__main__":
    sys.exit(main())
