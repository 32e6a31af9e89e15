"""A ``post_train`` run across three nodes (the flow machine and two network namespaces), killed and resumed.

The flow machine runs the flow (trainer rank 0, the async scheduler) and the Ray head with no CPUs; the
episodes run on an actor of the worker node (``infra.rollout.ray_episodes``), their tokens stamped with the
version the engine reports (the actor's own client never learns of an update). Node ``engine`` serves the
run from a vLLM server bound to its bridge address (no S3 keys: it fetches each checkpoint from S3 itself).
Node ``worker`` runs a Ray worker node with its own dockerd (its own data root and socket, started with no
image: the flow stages the task images on S3 by image id and the node's workers load them) and trainer
rank 1, a Ray actor the run places there (``train.launch = "ray"``, ``infra.train.ranks.RayRanks``). S3 and
the Prefect server stay on the flow machine's loopback; the nodes reach them through forwarders on the
bridge. The run is SIGKILLed in step 1's rollouts, then rerun.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from infra.net import free_port
from tests.integration import netns

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration  # Ray, two dockerds, a vLLM server, S3, a network namespace (root)

SUBNET = "10.231.10"  # not another netns test file's: they may run at once
HOST = f"{SUBNET}.1"


def _creates(client, since: float, until: float, episodes: set[str]) -> int:
    """Containers of ``episodes`` (ids) created on ``client``'s engine between ``since`` and ``until``."""
    events = client.events(since=int(since), until=int(until) + 1, decode=True,
                           filters={"type": "container", "event": "create"})
    return sum(1 for e in events if e["Actor"]["Attributes"].get("agentrl.episode") in episodes)


def _ray_ranks(node) -> list[int]:
    """Processes of trainer ranks started as Ray actors (``infra.train.ranks._RayRank``) in ``node``'s namespace."""
    pids = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            if b"_RayRank" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:  # ended meanwhile
            pass
    return found


def _ours(client) -> list:
    """Sandbox containers (any run's) on ``client``'s engine."""
    return client.containers.list(all=True, ignore_removed=True, filters={"label": "agentrl=1"})


def test_post_train_spans_three_nodes_and_resumes_after_sigkill_leaving_nothing(tiny_model, s3, services_env,
                                                                                  tmp_path):
    """One run, 2 steps: rollouts on a Ray node in sandboxes on that node's engine only; the engine on a third
    node hot-loads each version from S3; 2 trainer ranks on two nodes (rank 1 a Ray actor). SIGKILLed in step 1's
    rollouts: rank 1 ends, the node's sandboxes are removed; the rerun (a new rank 1) resumes at step 1 and loses and
    duplicates nothing."""
    import json
    import secrets

    import docker

    from infra import prefect_server
    from infra.environments import BASE_IMAGE, Catalog
    from infra.layout import RunLayout, repo_root
    from infra.reaper import unmarked_env
    from infra.rollout.engine_auth import TOKEN_ENV
    from infra.store import read_history, read_step

    terminal = tmp_path / "terminal"
    shutil.copytree(repo_root() / "envs/terminal/hello-file", terminal / "hello-file")
    run_id = f"threenode-{uuid.uuid4().hex[:8]}"
    root = f"agentrl/runs/{run_id}"
    ray = str(Path(sys.executable).with_name("ray"))  # to make the auth token
    # Token auth with this machine's Ray token (~/.ray/auth_token, made if missing) for the head, the node and the
    # flow's driver; this process starts no Ray of its own
    token = subprocess.run([ray, "get-auth-token", "--generate"], capture_output=True, text=True, check=True)
    ray_auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token.stdout.strip().splitlines()[-1]}
    engine_token = secrets.token_urlsafe(16)
    s3_at = urlsplit(services_env["AGENTRL_S3_ENDPOINT"])
    base_env = {k: v for k, v in unmarked_env().items() if not k.startswith(("PREFECT_API", "RAY_"))}
    with ExitStack() as stack:
        engine_node, worker_node = stack.enter_context(netns.nodes(2, SUBNET))
        s3_port = stack.enter_context(netns.forward((s3_at.hostname, s3_at.port), host=HOST))
        state = tmp_path / "prefect-state"
        api = prefect_server.start(state, port=free_port(), home=tmp_path / "prefect-home")
        stack.callback(prefect_server.stop, state)
        api_at = urlsplit(api)
        api_port = stack.enter_context(netns.forward((api_at.hostname, api_at.port), host=HOST))
        node_docker, node_socket = netns.node_dockerd(
            worker_node, Path(f"/tmp/agentrl-node-docker-{uuid.uuid4().hex[:6]}"),  # short: a socket path has a limit
            tmp_path / "dockerd.log", stack)
        assert not node_docker.images.list()  # the node's engine starts with no image at all
        flow_docker = docker.from_env()
        node_env = {**base_env, **ray_auth, "DOCKER_HOST": node_socket,
                    "AGENTRL_S3_ENDPOINT": f"http://{HOST}:{s3_port}", "PREFECT_API_URL": f"http://{HOST}:{api_port}/api"}
        ray_address = netns.ray_cluster(HOST, worker_node, {**base_env, **ray_auth}, node_env, tmp_path, stack)

        # the engine's node has no S3 keys: it fetches checkpoints through presigned URLs
        engine_env = {k: v for k, v in base_env.items() if not k.startswith(("AWS_", "AGENTRL_S3"))}
        engine_port = free_port()
        server = subprocess.Popen([*engine_node.launcher, sys.executable, "-m", "infra.rollout.servers", "--model",
                                   str(tiny_model), "--host", engine_node.address, "--port", str(engine_port),
                                   "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-gib", "1",
                                   "--threads", "1", "--log", str(tmp_path / "vllm.log")],
                                  env={**engine_env, TOKEN_ENV: engine_token}, stdout=subprocess.PIPE, text=True,
                                  start_new_session=True)
        stack.callback(netns.stop_group, server)
        url = f"http://{engine_node.address}:{engine_port}"
        ready = server.stdout.readline()
        assert ready.startswith(f"serving {tiny_model} at {url}"), (tmp_path / "vllm.log").read_text()

        master = f"{HOST}:{free_port(HOST)}"
        config = tmp_path / "run.toml"
        config.write_text(f"""
run_id = "{run_id}"
steps = 2
[model]
path = "{tiny_model}"
max_model_len = 1024
kv_cache_gib = 1.0
[tasks]
terminal_dir = "{terminal}"
humaneval_train = 1
humaneval_eval = 0
sandbox_network = "none"
[engine]
kind = "remote"
urls = ["{url}"]
[rollout]
tasks_per_step = 2
group_size = 2
max_tokens_per_turn = 16
max_turns = 1
fan_out = "ray"
ray_address = "{ray_address}"
warm_pool = false
[rollout.scheduler]
kind = "async"
[eval]
enabled = false
[publish]
kind = "storage"
endpoint = "http://{HOST}:{s3_port}"
[train]
world_size = 2
master = "{master}"
launch = "ray"
ray_address = "{ray_address}"
ranks_timeout_s = 300
state_storage = "s3"
""")
        # the API as every machine reaches it: the node's Ray workers get the flow's settings with their tasks
        flow_env = {**base_env, **ray_auth, TOKEN_ENV: engine_token, "PREFECT_API_URL": node_env["PREFECT_API_URL"],
                    "PREFECT_HOME": str(tmp_path / "prefect-home")}
        cmd = [sys.executable, "-m", "flows.post_train", "--config", str(config)]

        started = time.time()
        first = subprocess.Popen(cmd, cwd=ROOT, env=flow_env, stdout=open(tmp_path / "first.log", "w"),  # noqa: SIM115
                                 stderr=subprocess.STDOUT, start_new_session=True)
        stack.callback(netns.stop_group, first, signal.SIGKILL)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and first.poll() is None:  # kill in step 1's rollouts, on the node
            s3.invalidate_cache()
            if s3.exists(f"{root}/checkpoints/v1/manifest.json") and _ours(node_docker):
                break
            time.sleep(0.1)
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert _ray_ranks(worker_node)  # trainer rank 1: a Ray actor the run placed on the node
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        killed = time.time()
        deadline = time.monotonic() + 120  # Ray ends the dead driver's actors: rank 1 does not hang on
        while _ray_ranks(worker_node) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _ray_ranks(worker_node)
        deadline = time.monotonic() + 60  # the node's sandboxes go with the Ray workers that started them
        while _ours(node_docker) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _ours(node_docker), [c.labels for c in _ours(node_docker)]
        s3.invalidate_cache()
        assert not s3.exists(f"{root}/checkpoints/v2/manifest.json")
        layout = RunLayout("agentrl", "runs", run_id)
        staged = {p: s3.info(p)["LastModified"] for p in s3.ls(layout.images_dir)}
        assert staged
        # step 1 was sampling on v1: the engine fetched it from S3, for the flow machine holds no copy of it
        assert not (layout.work / "v1").exists()

        rerun = subprocess.Popen(cmd, cwd=ROOT, env=flow_env, stdout=open(tmp_path / "rerun.log", "w"),  # noqa: SIM115
                                 stderr=subprocess.STDOUT, start_new_session=True)
        stack.callback(netns.stop_group, rerun, signal.SIGKILL)
        ranks_seen, deadline = False, time.monotonic() + 900
        while rerun.poll() is None and time.monotonic() < deadline:
            ranks_seen = ranks_seen or bool(_ray_ranks(worker_node))
            time.sleep(0.5)
        ended, out = time.time(), (tmp_path / "rerun.log").read_text()
        assert rerun.returncode == 0, out[-6000:]
        assert f"post_train {run_id}: 1 step(s) run" in out  # step 0 was not redone
        deadline = time.monotonic() + 30
        while _ray_ranks(worker_node) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ranks_seen and not _ray_ranks(worker_node)  # the new rank 1 ran on the node and ended with the run

        s3.invalidate_cache()
        stored = [p.rsplit("/", 1)[1] for p in s3.ls(f"{root}/trajectories")]
        assert sorted(p for p in stored if not p.endswith(".lineage.json")) == ["step-000000.parquet",
                                                                                 "step-000001.parquet"]
        assert sorted(p.rsplit("/", 1)[1] for p in s3.ls(f"{root}/checkpoints")
                      if not p.endswith(".lineage.json")) == ["v1", "v2"]
        history = read_history(s3, layout, ["episode_id", "step", "group_id", "sample_index", "min_policy_version",
                                            "engine_replica", "outcome"]).to_pylist()
        for step in (0, 1):  # nothing lost, nothing twice: 2 groups x G = 2 per step, each sample once
            samples = [(r["group_id"], r["sample_index"]) for r in history if r["step"] == step]
            assert len(samples) == len(set(samples)) == 4, samples
        assert {r["min_policy_version"] for r in history if r["step"] == 1} == {1}  # v1, loaded from S3 there
        assert {r["engine_replica"] for r in history if r["outcome"] != "infra_failure"} == {url}
        assert not [r for r in history if r["outcome"] == "infra_failure"]
        step1 = {r["episode_id"] for r in read_step(s3, layout.trajectories(1)).to_pylist()}
        assert _creates(node_docker, killed, ended, step1) == len(step1)  # a sandbox per episode, on the node
        assert _creates(flow_docker, started, ended, {r["episode_id"] for r in history}) == 0  # none here
        # the images went by S3 once per image id: the rerun staged none again; the node's engine loaded them
        assert {p: s3.info(p)["LastModified"] for p in staged} == staged
        catalog = Catalog.from_json(json.loads(s3.cat_file(layout.catalog)), layout.catalog)
        images = {tag for tag, _ in catalog.images().values()} | {BASE_IMAGE}
        assert images <= {t for i in node_docker.images.list() for t in i.tags}
        assert (tmp_path / "vllm.log").read_text().count("POST /collective_rpc") >= 6  # v1, v1 on resume, v2
        episodes = {r["episode_id"] for r in history}
        assert not _ours(node_docker)
        assert not [c for c in _ours(flow_docker) if c.labels.get("agentrl.episode") in episodes]
