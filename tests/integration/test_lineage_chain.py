"""Lineage that follows the policy, on a real 2-step run (tiny Llama, dockerd, SeaweedFS, vLLM, DeepSpeed, Prefect).

From checkpoint v2 the chain reaches the base model: v2 ← v1 ← base, each checkpoint made from its parent and its
step's trajectories, each trajectory file from its task images and every policy version that sampled its tokens
(with the counts, checked against the file's own per-token versions), the eval report from its checkpoint and the
held-out task images in the serving dtype. The S3 records, Prefect's asset events and the step's lineage artifact
say the same; a second run started from v2 continues the chain across runs.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter

import httpx
import pytest

from infra.config import EvalConfig, ModelConfig, RolloutConfig, RunConfig, TaskSetConfig
from infra.store import read_step
from tests.helpers import asset_events, related_assets

pytestmark = pytest.mark.integration


def _config(run_id: str, model_path: str, steps: int, evaluate: bool) -> RunConfig:
    return RunConfig(run_id=run_id, steps=steps,
                     model=ModelConfig(path=model_path, max_model_len=1024, kv_cache_gib=1.0),
                     tasks=TaskSetConfig(terminal_eval_ids=["make-dir"], humaneval_train=1, humaneval_eval=0),
                     rollout=RolloutConfig(tasks_per_step=1, group_size=2, max_tokens_per_turn=16, max_turns=1),
                     eval=EvalConfig(enabled=evaluate, max_tokens=16))


@pytest.fixture(scope="module")
def two_runs(tiny_model, s3, prefect_harness):
    """A 2-step run from the tiny model, then a 1-step run whose model.path is the first run's v2."""
    from flows.post_train import post_train

    first = _config(f"chain-{uuid.uuid4().hex[:8]}", str(tiny_model), 2, True)
    post_train(first)
    v2 = f"s3://agentrl/runs/{first.run_id}/checkpoints/v2"
    second = _config(f"from-v2-{uuid.uuid4().hex[:8]}", v2, 1, False)
    post_train(second)
    return first, second


def _tokens_by_version(s3, uri: str) -> Counter:
    rows = read_step(s3, uri).to_pylist()
    return Counter(v for r in rows for v, m in zip(r["policy_versions"], r["loss_mask"], strict=True) if m)


def test_checkpoint_v2_reaches_the_base_model_through_v1_with_each_steps_producers(two_runs, tiny_model, s3,
                                                                                     capsys):
    from prefect.settings import PREFECT_API_URL

    from flows.lineage import main, payload_of, upstream_of
    from infra.lineage import StoredLineage, model_asset

    first, _ = two_runs
    root = f"s3://agentrl/runs/{first.run_id}"
    base = model_asset(tiny_model).key
    v1, v2 = f"{root}/checkpoints/v1", f"{root}/checkpoints/v2"
    t0, t1 = f"{root}/trajectories/step-000000.parquet", f"{root}/trajectories/step-000001.parquet"
    stored = StoredLineage(s3)
    api = PREFECT_API_URL.value()
    asset_events(f"{v2}/eval.json")  # events land asynchronously: wait for the last one

    policy = {0: base, 1: v1}
    for traj in (t0, t1):
        produced = {policy[v]: n for v, n in _tokens_by_version(s3, traj).items()}  # from the file's own columns
        assert produced and stored.properties(traj)["policy_version_tokens"] == produced
        assert set(produced) <= set(stored.inputs(traj))
        assert payload_of(api, traj)["policy_version_tokens"] == produced  # the event says the same
    assert set(_tokens_by_version(s3, t0)) == {0}  # step 0 could only be sampled by the base model

    # each checkpoint: its parent and its step's trajectories, nothing else; the manifest names the parent
    assert set(stored.inputs(v1)) == {base, t0} and set(stored.inputs(v2)) == {v1, t1}
    s3.invalidate_cache()
    assert json.loads(s3.cat_file(f"{v2}/manifest.json"))["parent"] == v1
    assert json.loads(s3.cat_file(f"{v1}/manifest.json"))["parent"] == base
    # the eval report: its checkpoint and the held-out task's image, in the serving dtype
    report = f"{v2}/eval.json"
    (image,) = set(stored.inputs(report)) - {v2}
    assert v2 in stored.inputs(report) and image.startswith("docker://agentrl-task-") and "make-dir" in image
    assert stored.properties(report)["dtype"] == first.model.serving_dtype == stored.properties(report)["serving_dtype"]
    assert stored.properties(base)["weights_sha256"] in base  # the base model's record, in the run folder

    for uri in (t0, t1, v1, v2, report):  # S3 records and Prefect's events agree, edge for edge
        assert upstream_of(api, uri) == set(stored.inputs(uri)), uri
    (v1_event,) = asset_events(v1)
    assert base in related_assets(v1_event)

    assert main([v2]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"  ├── {v1}  · parent weights" in out
    assert any(f"{base}  · parent weights; base model, folder " in line for line in out)
    assert any(f"{t1}  · tokens by policy: " in line for line in out)
    assert main([v2, "--depth", "1"]) == 0
    shallow = capsys.readouterr().out.splitlines()
    assert not any(base in line for line in shallow[:shallow.index(v2)])  # two levels up: not shown
    assert main([v2, "--source", "prefect"]) == 0
    from_events = capsys.readouterr().out.splitlines()
    assert [line for line in from_events if "model://" in line] and f"  ├── {v1}  · parent weights" in from_events


def test_the_step_lineage_artifact_names_the_parent_and_the_tokens_each_version_produced(two_runs, s3):
    from prefect.settings import PREFECT_API_URL

    from infra.layout import artifact_key

    first, _ = two_runs
    root = f"s3://agentrl/runs/{first.run_id}"
    found = httpx.post(f"{PREFECT_API_URL.value()}/artifacts/filter", json={"artifacts": {"key": {
        "any_": [artifact_key(first.run_id, "step-1-lineage")]}}}, timeout=10).json()
    markdown = found[0]["data"]
    n = _tokens_by_version(s3, f"{root}/trajectories/step-000001.parquet")[1]
    assert f"`{root}/checkpoints/v1` (parent weights)" in markdown
    assert f"`{root}/checkpoints/v1` (policy that sampled {n} tokens)" in markdown


def test_a_run_started_from_another_runs_checkpoint_continues_its_chain(two_runs, tiny_model, s3, capsys):
    from flows.lineage import main
    from infra.lineage import StoredLineage, model_asset

    first, second = two_runs
    other_v2 = f"s3://agentrl/runs/{first.run_id}/checkpoints/v2"
    root = f"s3://agentrl/runs/{second.run_id}"
    stored = StoredLineage(s3)
    assert set(stored.inputs(f"{root}/checkpoints/v1")) == {other_v2, f"{root}/trajectories/step-000000.parquet"}
    assert list(stored.properties(f"{root}/trajectories/step-000000.parquet")["policy_version_tokens"]) == [other_v2]
    assert main([f"{root}/checkpoints/v1"]) == 0  # up through the first run's records to its base model
    out = capsys.readouterr().out
    assert other_v2 in out and f"s3://agentrl/runs/{first.run_id}/checkpoints/v1" in out
    assert model_asset(tiny_model).key in out
    assert f"tokens by policy: {first.run_id} v2 " in out  # another run's version is named with its run
    # and down: what was made from the first run's v2 includes the second run's checkpoint and trajectories
    assert {f"{root}/checkpoints/v1", f"{root}/trajectories/step-000000.parquet"} <= set(
        StoredLineage(s3).outputs(other_v2))
    assert main([model_asset(tiny_model).key, "--depth", "1"]) == 0  # a base model is looked up by its key
    below = capsys.readouterr().out.split("used by (outputs):")[1]
    assert f"s3://agentrl/runs/{first.run_id}/checkpoints/v1  · parent weights" in below
