"""Kill post_train in the middle of a run and start it again: it resumes after the last committed step."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from infra.layout import RunLayout
from infra.store import read_history

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.integration


def test_kill_mid_step_then_rerun_resumes_without_duplicates(tiny_model, s3, tmp_path):
    run_id = f"resume-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "run.toml"
    config.write_text(f"""
run_id = "{run_id}"
steps = 2
[model]
path = "{tiny_model}"
max_model_len = 1024
kv_cache_gib = 1.0
[tasks]
terminal_eval_ids = ["make-dir"]
humaneval_train = 1
humaneval_eval = 0
[rollout]
tasks_per_step = 2
group_size = 2
max_tokens_per_turn = 16
max_turns = 1
[eval]
enabled = false
[train]
state_storage = "s3"
""")
    env = {**os.environ, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
           "PREFECT_HOME": str(tmp_path / "prefect")}
    cmd = [sys.executable, "-m", "flows.post_train", "--config", str(config)]
    root = f"agentrl/runs/{run_id}"
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        # kill as soon as step 1 has started writing (its trajectory file exists) or, failing that,
        # right after step 0 committed (v1 published)
        while time.monotonic() < deadline and first.poll() is None:
            s3.invalidate_cache()
            if s3.exists(f"{root}/checkpoints/v1/manifest.json"):
                break
            time.sleep(0.5)
        assert first.poll() is None, "the run ended before it could be killed"
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    s3.invalidate_cache()
    assert not s3.exists(f"{root}/checkpoints/v2/manifest.json")
    assert s3.exists(f"{root}/trainer-state/v1/COMPLETE")
    # the rerun is on another machine: this one's saved trainer states are gone, S3's are not
    shutil.rmtree(RunLayout("agentrl", "runs", run_id).work / "trainer-state")

    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"post_train {run_id}: 1 step(s) run" in rerun.stdout  # step 0 was not redone
    s3.invalidate_cache()
    stored = [p.rsplit("/", 1)[1] for p in s3.ls(f"{root}/trajectories")]
    assert sorted(p for p in stored if not p.endswith(".lineage.json")) == ["step-000000.parquet",
                                                                             "step-000001.parquet"]
    assert sorted(p.rsplit("/", 1)[1] for p in s3.ls(f"{root}/checkpoints")
                  if not p.endswith(".lineage.json")) == ["v1", "v2"]
    hist = read_history(s3, RunLayout("agentrl", "runs", run_id), ["episode_id", "step", "min_policy_version"])
    ids = hist.column("episode_id").to_pylist()
    assert len(ids) == len(set(ids))  # no duplicate rows
    by_step = dict(zip(hist.column("step").to_pylist(), hist.column("min_policy_version").to_pylist(), strict=True))
    assert by_step == {0: 0, 1: 1}  # step 1 was sampled by the resumed policy v1
    # the trainer continued from the state saved with v1 (AdamW moments included, fetched from S3), not a
    # fresh optimizer
    import json

    resumed = json.loads(s3.cat_file(f"{root}/summaries/step-000001.json"))
    assert resumed["trainer_state_restored"] == "v1" and resumed["policy_version"] == 2
    assert sorted(p.rsplit("/", 1)[1] for p in s3.ls(f"{root}/trainer-state")) == ["v1", "v2"]
