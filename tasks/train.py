"""Prefect tasks: one GRPO step on DeepSpeed from a stored trajectory file, and the trainer's saved state."""

from __future__ import annotations

import shutil
import time
from dataclasses import replace

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.layout import TRAINER_STATE_COMPLETE
from infra.run import Run
from infra.store import read_step, write_divergence
from infra.summary import RolloutStats, TrainStats
from tasks.naming import stage_run_name


def train(run: Run, batch: RolloutStats, step: int) -> TrainStats:
    """The training stage: :func:`train_step`, then :func:`save_trainer_state` (``v{step + 1}``).

    The state is saved when ``train.save_optimizer_state``; ``stage_s`` covers both tasks.
    """
    start = time.monotonic()
    trained = train_step(run, batch, step)
    state_s = save_trainer_state(run, step + 1) if run.config.train.save_optimizer_state else 0.0
    return replace(trained, trainer_state_s=state_s, trainer_state_restored=run.trainer_restored,
                   stage_s=time.monotonic() - start)


@task(name="train_step", task_run_name=stage_run_name("train_step"), cache_policy=NO_CACHE)
def train_step(run: Run, batch: RolloutStats, step: int) -> TrainStats:
    """Read the step's rows back from storage and run one GRPO step on them.

    The per-row divergence decisions (KL estimates k1/k3 of behaviour vs current policy, weight,
    ``keep``/``drop``/``downweight``) are written to ``RunLayout.divergence(step)``.
    ``policy_lag_max``: the served version minus the oldest behaviour version among the rows.
    """
    rows = read_step(run.fs, batch.uri).to_pylist()
    metrics = run.trainer.step(rows, run.policy.version)  # the trainer holds the served version's weights
    decisions = run.trainer.last_row_decisions
    if decisions:
        write_divergence(run.fs, run.layout.divergence(step), decisions)
    sampled = [r["min_policy_version"] for r in rows if r["min_policy_version"] >= 0]
    lag = float(run.policy.version - min(sampled)) if sampled else 0.0
    return TrainStats(metrics, lag, 0.0, run.trainer_restored)


@task(name="save_trainer_state", task_run_name=stage_run_name("save_trainer_state"), cache_policy=NO_CACHE)
def save_trainer_state(run: Run, version: int) -> float:
    """Save the trainer's state under tag ``v{version}`` (the weights of checkpoint vN); keep the newest two tags.

    Returns the seconds taken. Called before checkpoint vN is published; the previous tag is kept
    until the next save, so the newest *published* version still has its state if this run dies
    before vN's manifest lands. With ``train.state_storage = "s3"`` the folder is also uploaded
    (:func:`upload_trainer_state`); otherwise a resume on another machine starts the optimizer fresh.
    """
    root = run.trainer_state_dir
    start = time.monotonic()
    run.trainer.save_state(root, f"v{version}")
    saved = sorted((p for p in root.iterdir() if p.is_dir() and p.name[1:].isdigit()), key=lambda p: int(p.name[1:]))
    for old in saved[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    if run.config.train.state_storage == "s3":
        upload_trainer_state(run, version)
    return time.monotonic() - start


def upload_trainer_state(run: Run, version: int) -> None:
    """Copy the local state ``v{version}`` to ``RunLayout.trainer_state(version)``; keep the newest two there."""
    local, uri = run.trainer_state_dir / f"v{version}", run.layout.trainer_state(version)
    if run.fs.exists(uri):
        run.fs.rm(uri, recursive=True)  # a step redone after a crash: no file of the earlier save stays
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        run.fs.put_file(str(path), f"{uri}/{path.relative_to(local)}")
    run.fs.pipe_file(f"{uri}/{TRAINER_STATE_COMPLETE}", b"")
    parent = uri.rsplit("/", 1)[0]
    tags = sorted((p.rsplit("/", 1)[1] for p in run.fs.ls(parent, refresh=True)), key=lambda t: int(t[1:]))
    for old in tags[:-2]:
        run.fs.rm(f"{parent}/{old}", recursive=True)
