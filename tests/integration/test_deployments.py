"""prefect.yaml against a real Prefect server and process worker: deploy all, run one, it completes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from infra.net import free_port

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory, services_env):
    from infra import prefect_server

    state = tmp_path_factory.mktemp("prefect-state")
    env_before = dict(os.environ)
    os.environ["PREFECT_HOME"] = str(state / "home")
    api_url = prefect_server.start(state, port=free_port())
    try:
        yield api_url
    finally:
        stopped = prefect_server.stop(state)
        os.environ.clear()
        os.environ.update(env_before)
        assert stopped == ["prefect-worker", "prefect-server"]


def test_deploy_all_and_run_build_envs(server):
    prefect = str(Path(sys.executable).with_name("prefect"))
    env = {**os.environ, "PREFECT_API_URL": server, "AGENTRL_ROOT": str(ROOT)}
    deployed = subprocess.run([prefect, "--no-prompt", "deploy", "--all"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    names = {d["name"] for d in httpx.post(f"{server}/deployments/filter", json={}, timeout=10).json()}
    configs = {p.stem for p in (ROOT / "configs").glob("*.toml")}
    assert names == configs | {"build_envs", "refresh_difficulty", "collect_rollouts", "evaluate"}
    quickstart = next(d for d in httpx.post(f"{server}/deployments/filter", json={}, timeout=10).json()
                      if d["name"] == "quickstart")
    # the pydantic run config is the parameter form, its defaults the config's values, with help text
    schema = quickstart["parameter_openapi_schema"]
    assert "config" in schema["properties"]
    assert quickstart["parameters"]["config"]["tasks"]["task_sets"][0] == "envs/multiturn"
    assert quickstart["tags"] == ["config:quickstart"]
    run_config = (schema.get("definitions") or schema["$defs"])["RunConfig"]["properties"]
    assert "resumes it" in run_config["run_id"]["description"]

    run_id = f"dep-{uuid.uuid4().hex[:8]}"
    params = {"config": {"run_id": run_id, "tasks": {"humaneval_train": 1, "humaneval_eval": 0}}}
    started = subprocess.run([prefect, "deployment", "run", "build_envs/build_envs", "--params", json.dumps(params)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)
    deadline = time.monotonic() + 300
    while True:
        state = httpx.get(f"{server}/flow_runs/{flow_run_id}", timeout=10).json()["state"]["type"]
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert state == "COMPLETED"
    from infra.storage import s3_filesystem

    fs = s3_filesystem("agentrl")
    catalog = json.loads(fs.cat_file(f"agentrl/runs/{run_id}/envs.json"))
    assert {e["task_id"] for e in catalog["tasks"]} >= {"tb/hello-file", "humaneval/HumanEval/0"}
