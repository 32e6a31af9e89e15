"""Rollout collection fanned out on a local Ray instance through prefect-ray (real servers, dockerd, S3)."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

from infra.config import EvalConfig, InprocEngine, ModelConfig, RolloutConfig, RunConfig, ServersEngine, TaskSetConfig
from infra.store import read_step

pytestmark = pytest.mark.integration


def test_collect_rollouts_fans_out_groups_on_ray(tiny_model, s3, prefect_harness, tmp_path, monkeypatch):
    from flows.build_envs import build_envs
    from flows.collect_rollouts import collect_rollouts
    from infra.layout import repo_root
    from tests.integration.test_post_train_servers import engine_at_close

    terminal = tmp_path / "terminal"
    shutil.copytree(repo_root() / "envs/terminal/hello-file", terminal / "hello-file")
    config = RunConfig(
        run_id=f"ray-{uuid.uuid4().hex[:8]}", steps=1,
        model=ModelConfig(path=str(tiny_model), max_model_len=1024, kv_cache_gib=1.0),
        tasks=TaskSetConfig(terminal_dir=str(terminal), humaneval_train=1, humaneval_eval=0),
        engine=ServersEngine(count=1),
        rollout=RolloutConfig(tasks_per_step=2, group_size=2, max_tokens_per_turn=16, max_turns=1),
        eval=EvalConfig(enabled=False),
    )
    with pytest.raises(ValueError, match="needs engine.kind"):
        collect_rollouts(config.model_copy(update={"engine": InprocEngine()}), step=0, fan_out="ray")
    engine = engine_at_close(monkeypatch)
    build_envs(config)
    result = collect_rollouts(config, step=0, fan_out="ray")
    (url,) = [s.url for s in engine["servers"]]
    assert not engine["servers"][0].alive()  # the flow's run stopped its server
    assert result["fan_out"] == "ray" and len(result["worker_pids"]) == 2
    assert os.getpid() not in result["worker_pids"]  # the groups ran in Ray worker processes
    rows = read_step(s3, result["uri"]).to_pylist()
    assert len(rows) == result["rows"] >= 4
    groups = {r["group_id"] for r in rows}
    assert groups == {f"{config.run_id}/0/tb/hello-file", f"{config.run_id}/0/humaneval/HumanEval/0"}
    assert len({r["seed"] for r in rows if r["attempt"] == 0}) == 4  # seeds differ across groups
    assert {r["engine_replica"] for r in rows if r["outcome"] != "infra_failure"} == {url}
    assert all(r["max_policy_version"] == 0 for r in rows)
    # the engines' token reached the workers in their environment, never as a parameter Prefect stores
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        fan_outs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["collect_groups_fan_out"])))
    (token,) = {s.token for s in engine["servers"]}
    stored = [str(r.parameters) for r in fan_outs]
    assert token and any(url in p for p in stored) and not any(token in p for p in stored)
