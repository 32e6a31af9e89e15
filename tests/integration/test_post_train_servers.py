"""post_train with the rollout engine as vLLM OpenAI servers (routed) and direct weight publication."""

from __future__ import annotations

import uuid

import pytest

from infra.config import (
    ColocatedPublish,
    DirectPublish,
    EvalConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    ServersEngine,
    TaskSetConfig,
)
from infra.store import read_step

pytestmark = pytest.mark.integration


def engine_at_close(monkeypatch) -> dict:
    """What the run's engine looked like when the flow closed its run: ``{"servers", "versions"}``."""
    from infra.run import Run

    seen: dict = {}
    real_close = Run.close

    def close(run) -> None:
        if run.engine_started and not seen:
            seen.update(servers=list(run.engine.servers.values()), versions=dict(run.engine.versions))
        real_close(run)

    monkeypatch.setattr(Run, "close", close)
    return seen


def test_post_train_on_two_servers_with_direct_publication(tiny_model, s3, prefect_harness, monkeypatch):
    from flows.post_train import post_train

    config = RunConfig(
        run_id=f"srv-{uuid.uuid4().hex[:8]}", steps=1,
        model=ModelConfig(path=str(tiny_model), max_model_len=1024, kv_cache_gib=1.0),
        tasks=TaskSetConfig(terminal_eval_ids=["make-dir"], humaneval_train=1, humaneval_eval=0),
        engine=ServersEngine(count=2),
        rollout=RolloutConfig(tasks_per_step=2, group_size=2, max_tokens_per_turn=16, max_turns=2),
        eval=EvalConfig(max_tokens=16), publish=DirectPublish(),
    )
    engine = engine_at_close(monkeypatch)
    try:
        (summary,) = post_train(config)
        urls = {s.url for s in engine["servers"]}
        # every replica pulled v1 from the trainer and serves it
        assert summary["policy_version"] == 1 and summary["checkpoint_refused"] == ""
        assert summary["publish_pattern"] == "direct" and set(engine["versions"].values()) == {1}
        assert 0 < summary["reload_pause_s"] <= summary["publish_latency_s"]
        assert summary["generation_tokens_per_s"] > 0 and summary["eval_pass_at_1"] is not None
        rows = read_step(s3, f"s3://agentrl/runs/{config.run_id}/trajectories/step-000000.parquet").to_pylist()
        assert len(rows) == 4 and {r["engine_replica"] for r in rows} <= urls
        assert all(r["max_policy_version"] == 0 for r in rows)
        s3.invalidate_cache()  # the background upload finished before the flow returned
        assert s3.exists(f"agentrl/runs/{config.run_id}/checkpoints/v1/manifest.json")
    finally:
        servers = engine.get("servers", [])
    assert servers and not any(s.alive() for s in servers)  # the flow's run stopped the servers it started


def test_colocated_with_servers_is_refused():
    with pytest.raises(ValueError, match="colocated.*needs engine.kind"):
        RunConfig(engine=ServersEngine(), publish=ColocatedPublish())
