"""Prefect task: one GRPO step on DeepSpeed from a stored trajectory file."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.config import RunConfig
from infra.store import read_step, write_divergence
from tasks.runtime import runtime


def divergence_uri(trajectories_uri: str) -> str:
    """Where a step's per-row divergence decisions are stored."""
    head, _, name = trajectories_uri.rpartition("/trajectories/")
    return f"{head}/divergence/{name}"


@task(name="train_step", cache_policy=NO_CACHE)
def train_step(config: RunConfig, trajectories_uri: str) -> dict:
    """Read the step's rows back from storage and run one GRPO step on them.

    The per-row divergence decisions (KL estimates k1/k3 of behaviour vs current policy, weight,
    ``keep``/``drop``/``downweight``) are written to ``{run}/divergence/step-NNNNNN.parquet``.

    Returns:
        Trainer metrics (see ``GRPOTrainer.step``) plus ``policy_lag_max`` (trainer version minus
        the oldest behaviour version among trained rows).
    """
    rt = runtime(config)
    rows = read_step(rt.fs, trajectories_uri).to_pylist()
    metrics = rt.trainer.step(rows)
    decisions = rt.trainer.last_row_decisions
    if decisions:
        write_divergence(rt.fs, divergence_uri(trajectories_uri), decisions)
    sampled = [r["min_policy_version"] for r in rows if r["min_policy_version"] >= 0]
    metrics["policy_lag_max"] = float(rt.policy_version - min(sampled)) if sampled else 0.0
    return metrics


def trainer_state_dir(config: RunConfig):
    """Local folder of the run's saved trainer states (``$AGENTRL_STATE/work/{run_id}/trainer-state``)."""
    from tasks.runtime import work_dir

    return work_dir(config.run_id) / "trainer-state"


@task(name="save_trainer_state", cache_policy=NO_CACHE)
def save_trainer_state(config: RunConfig, version: int) -> float:
    """Save the trainer's state under tag ``v{version}`` (the weights of checkpoint vN); keep the newest two tags.

    Returns the seconds taken. Called before checkpoint vN is published; the previous tag is kept
    until the next save, so the newest *published* version still has its state if this run dies
    before vN's manifest lands (a resume on another machine starts the optimizer fresh).
    """
    import shutil
    import time

    rt = runtime(config)
    root = trainer_state_dir(config)
    start = time.monotonic()
    rt.trainer.save_state(root, f"v{version}")
    tags = sorted((p for p in root.iterdir() if p.is_dir() and p.name[1:].isdigit()), key=lambda p: int(p.name[1:]))
    for old in tags[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    return time.monotonic() - start
