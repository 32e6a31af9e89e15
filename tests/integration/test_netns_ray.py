"""Rollouts on a Ray worker node in another network namespace, in sandboxes on that node's own Docker engine.

The Ray head runs on the flow machine's bridge address with no CPUs, so every group lands on the
node; the node's dockerd (its own data root and socket, started in the namespace) has none of the
task images: the flow stages them on S3 by image id and the node's workers load them. The node
reaches S3 through a forwarder on the bridge and the run's vLLM server at its bridge address.
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

pytestmark = pytest.mark.integration  # Ray, two dockerds, a vLLM server, S3, a network namespace (root)

SUBNET = "10.231.10"  # not another netns test file's: they may run at once
HOST = f"{SUBNET}.1"


def _nsenter(node) -> list[str]:
    """Enter the node's network namespace only (``ip netns exec`` remounts /sys: dockerd then finds no cgroups)."""
    return ["nsenter", f"--net=/var/run/netns/{node.netns}"]


def _stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 60) -> None:
    """Signal ``proc``'s process group (it started a session) and wait for ``proc``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _ports() -> list[str]:
    """Free ports for a Ray node's fixed-port services (defaults such as 52365 and 10001 would collide with
    another Ray on this machine, e.g. test_ray's, running at the same time)."""
    names = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
             "runtime-env-agent-port", "node-manager-port", "object-manager-port")
    return [f"--{n}={free_port()}" for n in names]


def _forget_cluster(address: str) -> None:
    """Remove Ray's record of the cluster ``ray start --head`` made (a plain ray.init() would try to join it)."""
    record = Path("/tmp/ray/ray_current_cluster")
    if record.exists() and address in record.read_text():
        record.unlink()


def _creates(client, since: float, until: float, episodes: set[str]) -> int:
    """Containers of ``episodes`` (ids) created on ``client``'s engine between ``since`` and ``until``."""
    events = client.events(since=int(since), until=int(until) + 1, decode=True,
                           filters={"type": "container", "event": "create"})
    return sum(1 for e in events if e["Actor"]["Attributes"].get("agentrl.episode") in episodes)


def _ray_auth(env: dict) -> None:
    """Set Ray's auth variables (a value of None removes one) and make this process read them again.

    Ray reads ``RAY_AUTH_*`` once per process (an earlier Ray user in this pytest worker fixes the mode at
    disabled); re-reading is what Ray's own tests do (``ray._private.authentication_test_utils``).
    """
    from ray._raylet import AuthenticationTokenLoader, Config

    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    Config.initialize("")  # the config first, then the token cache (a draining gRPC thread may reload it)
    AuthenticationTokenLoader.instance().reset_cache()


def test_rollouts_run_on_a_ray_node_with_its_own_docker_engine(tiny_model, s3, services_env, tmp_path):
    import docker
    import psutil

    from flows.build_envs import build_envs
    from flows.collect_rollouts import collect_rollouts
    from infra.config import EvalConfig, ModelConfig, RolloutConfig, RunConfig, ServersEngine, TaskSetConfig
    from infra.environments import BASE_IMAGE
    from infra.layout import repo_root
    from infra.run import Run
    from infra.sandbox.image_ship import stage_images
    from infra.store import read_step

    terminal = tmp_path / "terminal"
    shutil.copytree(repo_root() / "envs/terminal/hello-file", terminal / "hello-file")
    run_id = f"raynode-{uuid.uuid4().hex[:8]}"
    config = RunConfig(
        run_id=run_id, steps=1, model=ModelConfig(path=str(tiny_model), max_model_len=1024, kv_cache_gib=1.0),
        tasks=TaskSetConfig(terminal_dir=str(terminal), humaneval_train=1, humaneval_eval=0, sandbox_network="none"),
        engine=ServersEngine(count=1, host=HOST),
        rollout=RolloutConfig(tasks_per_step=2, group_size=2, max_tokens_per_turn=16, max_turns=1),
        eval=EvalConfig(enabled=False))
    ray = str(Path(sys.executable).with_name("ray"))
    # Token auth with this machine's Ray token (~/.ray/auth_token, made if missing): Ray caches the token a
    # process used, so a token of our own would break a later local ray.init() in this pytest worker
    token = subprocess.run([ray, "get-auth-token", "--generate"], capture_output=True, text=True, check=True)
    before = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    s3_at = urlsplit(services_env["AGENTRL_S3_ENDPOINT"])
    docker_dir = Path(f"/tmp/agentrl-node-docker-{uuid.uuid4().hex[:6]}")  # short: the socket path has a limit
    with ExitStack() as stack:
        stack.callback(_ray_auth, before)  # last out: this process's own Ray settings again
        _ray_auth({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token.stdout.strip().splitlines()[-1]})
        (node,) = stack.enter_context(netns.nodes(1, SUBNET))
        s3_port = stack.enter_context(netns.forward((s3_at.hostname, s3_at.port), host=HOST))
        stack.callback(shutil.rmtree, docker_dir, ignore_errors=True)
        socket = f"unix://{docker_dir}/docker.sock"
        dockerd = subprocess.Popen([*_nsenter(node), "dockerd", "--data-root", str(docker_dir / "data"), "--exec-root",
                                    str(docker_dir / "exec"), "--pidfile", str(docker_dir / "pid"), "-H", socket,
                                    "--bridge=none", "--iptables=false", "--ip6tables=false"],
                                   stdout=open(tmp_path / "dockerd.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                   start_new_session=True)
        stack.callback(_stop, dockerd)
        deadline = time.monotonic() + 60
        while True:
            try:
                node_docker = docker.DockerClient(base_url=socket, timeout=120)  # asks the engine's API version
                break
            except Exception:  # noqa: BLE001 - not up yet
                assert time.monotonic() < deadline and dockerd.poll() is None, (tmp_path / "dockerd.log").read_text()
                time.sleep(0.5)
        assert not node_docker.images.list()  # the node's engine starts with no image at all

        port = free_port()
        head = subprocess.Popen([ray, "start", "--head", f"--node-ip-address={HOST}", f"--port={port}", "--num-cpus=0",
                                 "--include-dashboard=false", "--disable-usage-stats", "--block",
                                 f"--object-store-memory={200 * 1024**2}", f"--ray-client-server-port={free_port()}",
                                 *_ports()],
                                stdout=open(tmp_path / "ray-head.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                start_new_session=True)
        head_tree: list = []
        stack.callback(_forget_cluster, f"{HOST}:{port}")
        stack.callback(lambda: [p.kill() for p in head_tree if p.is_running()])
        stack.callback(_stop, head, signal.SIGKILL)
        node_env = {**os.environ, "DOCKER_HOST": socket, "AGENTRL_S3_ENDPOINT": f"http://{HOST}:{s3_port}"}
        worker = subprocess.Popen([*_nsenter(node), ray, "start", f"--address={HOST}:{port}",
                                   f"--node-ip-address={node.address}", "--num-cpus=2", "--disable-usage-stats",
                                   "--block", f"--object-store-memory={200 * 1024**2}", *_ports()], env=node_env,
                                  stdout=open(tmp_path / "ray-node.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                  start_new_session=True)
        stack.callback(_stop, worker, signal.SIGKILL)

        build_envs(config)  # on the flow machine's engine
        head_tree[:] = psutil.Process(head.pid).children(recursive=True)
        started = time.time()
        # the node's Ray workers report their task runs to the Prefect API: reachable on the bridge only
        from prefect.settings import PREFECT_API_URL, temporary_settings

        api = PREFECT_API_URL.value()
        if api:
            api_at = urlsplit(api)
            api_port = stack.enter_context(netns.forward((api_at.hostname, api_at.port), host=HOST))
            stack.enter_context(temporary_settings({PREFECT_API_URL: f"http://{HOST}:{api_port}{api_at.path}"}))
        result = collect_rollouts(config, step=0, fan_out="ray", ray_address=f"{HOST}:{port}")
        ended = time.time()

        assert result["worker_pids"] and os.getpid() not in result["worker_pids"]
        with Run.open(config) as run:
            images, images_dir = {tag for tag, _ in run.catalog.images().values()} | {BASE_IMAGE}, run.layout.images_dir
        assert set(result["images_loaded"]) == images  # shipped through S3, loaded there
        flow_docker = docker.from_env()
        archives = {f"{images_dir}/{flow_docker.images.get(i).id.removeprefix('sha256:')}.tar" for i in images}
        s3.invalidate_cache()
        uploaded = {a: s3.info(a)["LastModified"] for a in archives}
        assert {a for _, a in stage_images(s3, flow_docker, images, images_dir).values()} == archives
        s3.invalidate_cache()
        assert {a: s3.info(a)["LastModified"] for a in archives} == uploaded  # once per image id: not again
        rows = read_step(s3, result["uri"]).to_pylist()
        assert len(rows) == result["rows"] >= 4 and not [r for r in rows if r["outcome"] == "infra_failure"]
        episodes = {r["episode_id"] for r in rows}
        assert _creates(node_docker, started, ended, episodes) == len(episodes)  # a sandbox per episode, there
        assert _creates(flow_docker, started, ended, episodes) == 0  # none on the flow machine's engine
        node_docker.close()
