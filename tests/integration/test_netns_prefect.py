"""A stage run by a Prefect worker on another machine (a network namespace), its result read back through S3.

The Prefect server and S3 stay on the flow machine's loopback; the node reaches them only through
forwarders on the bridge. The worker polls a work pool of its own; the stage (``build_envs``, deployed
from ``prefect.yaml`` onto that pool) persists its return value to the ``RemoteFileSystem`` block of
``infra.prefect_results``, and the flow machine reads it from S3 (its own local result folder never
holds it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from infra.net import free_port
from tests.integration import netns

pytestmark = pytest.mark.integration  # a Prefect server and worker, S3, Docker, a network namespace (root)

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.231.9"  # neither test_netns_engine's nor test_netns_trainer's: the files may run at once
POOL = "stages-elsewhere"


def test_a_stage_on_a_worker_in_another_namespace_returns_its_result_through_s3(services_env, s3, tmp_path,
                                                                                 monkeypatch):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from infra import prefect_server
    from infra.prefect_results import SLUG, save_s3_result_storage

    prefect = str(Path(sys.executable).with_name("prefect"))
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    state = tmp_path / "prefect-state"
    api = prefect_server.start(state, port=free_port(), home=tmp_path / "home")
    worker = None
    try:
        api_at, s3_at = urlsplit(api), urlsplit(services_env["AGENTRL_S3_ENDPOINT"])
        with netns.nodes(1, SUBNET) as (node,), \
                netns.forward((api_at.hostname, api_at.port), host=f"{SUBNET}.1") as api_port, \
                netns.forward((s3_at.hostname, s3_at.port), host=f"{SUBNET}.1") as s3_port, \
                temporary_settings({PREFECT_API_URL: api}):
            endpoint = f"http://{SUBNET}.1:{s3_port}"  # S3 as every machine reaches it, the flow machine too
            assert save_s3_result_storage("agentrl", endpoint) == SLUG
            env = {**os.environ, "PREFECT_API_URL": api, "AGENTRL_ROOT": str(ROOT)}
            for cmd in (["work-pool", "create", POOL, "--type", "process"],
                        ["--no-prompt", "deploy", "--name", "build_envs", "--pool", POOL]):
                done = subprocess.run([prefect, *cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                                      timeout=300)
                assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            node_env = {**os.environ, "PREFECT_API_URL": f"http://{SUBNET}.1:{api_port}/api",
                        "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": SLUG, "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
                        "AGENTRL_S3_ENDPOINT": endpoint, "PREFECT_WORKER_QUERY_SECONDS": "2",
                        "PREFECT_HOME": str(tmp_path / "node-home")}
            worker = subprocess.Popen([*node.launcher, prefect, "worker", "start", "--pool", POOL, "--type", "process",
                                       "--name", "elsewhere"], cwd=ROOT, env=node_env,
                                      stdout=open(tmp_path / "worker.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115

            run_id = f"elsewhere-{uuid.uuid4().hex[:8]}"
            params = {"config": {"run_id": run_id, "tasks": {"humaneval_train": 1, "humaneval_eval": 0}}}
            flow_run = run_deployment("build_envs/build_envs", parameters=params, timeout=420)
            log = (tmp_path / "worker.log").read_text()
            assert flow_run.state.is_completed(), f"{flow_run.state}\n{log[-3000:]}"
            assert flow_run.work_pool_name == POOL and "elsewhere" in log
            result = flow_run.state.result()  # read through the block: from S3
            assert result["catalog"] == f"s3://agentrl/runs/{run_id}/envs.json"
            meta = flow_run.state.data  # Prefect's record of where the result went: the block, a key under it
            from prefect.filesystems import RemoteFileSystem

            assert meta.storage_block_id == RemoteFileSystem.load(SLUG.split("/")[1])._block_document_id
            s3.invalidate_cache()
            assert s3.exists(f"agentrl/prefect-results/{meta.storage_key}")
            # (the namespaces share this machine's disk: the check that nothing went to a local folder)
            assert not [p for home in ("home", "node-home") for p in (tmp_path / home).rglob(meta.storage_key)]
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(30)
        prefect_server.stop(state)
