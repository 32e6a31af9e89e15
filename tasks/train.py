"""Prefect task: one GRPO step on DeepSpeed from a stored trajectory file."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.config import RunConfig
from infra.store import read_step
from tasks.runtime import runtime


@task(name="train_step", cache_policy=NO_CACHE)
def train_step(config: RunConfig, trajectories_uri: str) -> dict:
    """Read the step's rows back from storage and run one GRPO step on them.

    Returns:
        Trainer metrics (see ``GRPOTrainer.step``) plus ``policy_lag_max`` (trainer version minus
        the oldest behaviour version among trained rows).
    """
    rt = runtime(config)
    rows = read_step(rt.fs, trajectories_uri).to_pylist()
    metrics = rt.trainer.step(rows)
    sampled = [r["min_policy_version"] for r in rows if r["min_policy_version"] >= 0]
    metrics["policy_lag_max"] = float(rt.policy_version - min(sampled)) if sampled else 0.0
    return metrics
