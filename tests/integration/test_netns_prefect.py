"""A stage run by a Prefect worker on another machine (a network namespace), its result read back through S3.

The Prefect server binds the flow machine's bridge address (``infra.prefect_server.start(host=...)``), with
Prefect's basic auth on every route but the health probes; S3 stays on loopback and the node reaches it
through a forwarder on the bridge. The worker polls a work pool of its own; the stage (``build_envs``, deployed
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
    import httpx

    from infra import prefect_server

    prefect = str(Path(sys.executable).with_name("prefect"))
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    state = tmp_path / "prefect-state"
    s3_at = urlsplit(services_env["AGENTRL_S3_ENDPOINT"])
    with netns.nodes(1, SUBNET) as (node,), \
            netns.forward((s3_at.hostname, s3_at.port), host=f"{SUBNET}.1") as s3_port:
        try:
            port = free_port(f"{SUBNET}.1")
            api = prefect_server.start(state, port=port, home=tmp_path / "home", host=f"{SUBNET}.1")
            auth = prefect_server.auth_string(state)
            assert api == f"http://{SUBNET}.1:{port}/api" and auth
            assert httpx.post(f"{api}/flows/filter", json={}).status_code == 401  # not without the auth string
            assert httpx.post(f"{api}/flows/filter", json={}, auth=tuple(auth.split(":", 1))).status_code == 200
            with pytest.raises(httpx.ConnectError):  # nothing of it on loopback
                httpx.get(f"http://127.0.0.1:{port}/api/health")
            _stage_elsewhere(api, auth, node, s3_port, s3, tmp_path, prefect)
        finally:
            prefect_server.stop(state)


def _stage_elsewhere(api, auth, node, s3_port, s3, tmp_path, prefect):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from infra.prefect_results import SLUG, save_s3_result_storage

    worker = None
    try:
        with temporary_settings({PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: auth}):
            endpoint = f"http://{SUBNET}.1:{s3_port}"  # S3 as every machine reaches it, the flow machine too
            assert save_s3_result_storage("agentrl", endpoint) == SLUG
            env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_API_AUTH_STRING": auth, "AGENTRL_ROOT": str(ROOT)}
            for cmd in (["work-pool", "create", POOL, "--type", "process"],
                        ["--no-prompt", "deploy", "--name", "build_envs", "--pool", POOL]):
                done = subprocess.run([prefect, *cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                                      timeout=300)
                assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            node_env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_API_AUTH_STRING": auth,
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
