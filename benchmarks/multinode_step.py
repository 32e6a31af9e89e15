"""One ``post_train`` step on one node against the same step spread over three network namespaces.

``1-node``: the flow, one vLLM server (``engine.kind = "servers"``) and one trainer rank on this machine.
``3-ns``: the flow (its scheduler) and trainer rank 0 here, the Ray head with no CPUs; the vLLM server on
node A (``python -m infra.rollout.servers`` bound to its bridge address, fetching checkpoints from S3 through a
forwarder); on node B a dockerd of its own, a Ray worker node running the episodes
(``rollout.fan_out = "ray"``) and trainer rank 1 (``python -m infra.train.ranks``). Both use storage publication
and the same tasks, seeds and batch; B's nodes are kept across rounds (its images load in the first run).
Layouts alternate within each round (the first run after a pause is slower on these machines). Prints
each run's stage seconds (``rollout_s``, ``train_s``, ``publish_s``, ``step_s``) and the 3-ns / 1-node
ratio of the medians. Needs root (namespaces), ``make up`` services and the model.

The step is the first of ``--config`` (default the quickstart: SmolLM2-135M, mixed rewards, so the
optimizer steps), without evaluation.

Usage: ``python -m benchmarks.multinode_step [--rounds 2] [--config configs/quickstart.toml]``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from infra.net import free_port

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("rollout_s", "train_s", "publish_s", "step_s")


def _config(base: Path, engine, world_size: int = 1, master: str = "127.0.0.1:29500", publish_endpoint: str = ""):
    """``base`` (one step, no evaluation) under a fresh run id, with this layout's engine, ranks and endpoint."""
    from infra.config import load_config

    c = load_config(base, steps=1, **{"eval.enabled": False})
    return c.model_copy(update={
        "run_id": f"bench-mn-{uuid.uuid4().hex[:8]}", "engine": engine,
        "train": c.train.model_copy(update={"world_size": world_size, "master": master}),
        "publish": c.publish.model_copy(update={"endpoint": publish_endpoint} if publish_endpoint else {})})


def _run(config) -> dict:
    from flows.post_train import post_train

    start = time.monotonic()
    (summary,) = post_train(config)
    out = {k: summary[k] for k in STAGES[:-1]}
    out["step_s"] = round(time.monotonic() - start, 2)
    out["rows_trained"] = summary["rows_trained"]
    return out


def one_node(base: Path) -> dict:
    """The step with everything on this machine; its stage seconds."""
    from infra.config import ServersEngine

    return _run(_config(base, ServersEngine(count=1, threads=1)))


@contextmanager
def three_namespaces(base: Path, log_dir: Path):
    """The nodes of the 3-ns layout, kept for every round; yields a function that runs the step once on them.

    Node A serves (``python -m infra.rollout.servers``, no S3 keys: it fetches checkpoints from S3 through a
    forwarder); node B runs a dockerd of its own (started with no image), a Ray worker node (the flow machine
    is the Ray head, with no CPUs) and trainer rank 1 for each run. Episodes run on B's actor, in sandboxes on
    B's engine, under the config's own scheduler; the task images reach B through S3 in the first run.
    """
    from infra.config import RemoteEngine, load_config
    from infra.model import resolve_model
    from infra.rollout.engine_auth import TOKEN_ENV
    from tests.integration import netns

    m = load_config(base).model
    model = str(resolve_model(m.path))
    os.environ[TOKEN_ENV] = secrets.token_urlsafe(16)
    ray = str(Path(sys.executable).with_name("ray"))
    token = subprocess.run([ray, "get-auth-token", "--generate"], capture_output=True, text=True, check=True)
    ray_auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token.stdout.strip().splitlines()[-1]}
    os.environ.update(ray_auth)  # the flow (this process) joins the cluster with it
    s3_at = urlsplit(os.environ["AGENTRL_S3_ENDPOINT"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "AGENTRL_S3"))}  # no S3 keys there
    with ExitStack() as stack:
        engine_node, worker_node = stack.enter_context(netns.nodes(2))
        s3_port = stack.enter_context(netns.forward((s3_at.hostname, s3_at.port)))
        port = free_port()
        server = subprocess.Popen([*engine_node.launcher, sys.executable, "-m", "infra.rollout.servers", "--model",
                                   model, "--host", engine_node.address, "--port", str(port),
                                   "--dtype", m.serving_dtype,
                                   "--max-model-len", str(m.max_model_len), "--kv-cache-gib", str(m.kv_cache_gib),
                                   "--threads", "1",
                                   "--log", str(log_dir / "vllm.log")], env=env, stdout=subprocess.PIPE, text=True,
                                  cwd=ROOT)
        stack.callback(lambda: (server.terminate(), server.wait(60)))
        url = f"http://{engine_node.address}:{port}"
        if not server.stdout.readline().startswith(f"serving {model} at {url}"):
            raise RuntimeError(f"the server on {engine_node.netns} did not start: {log_dir / 'vllm.log'}")
        _, node_socket = netns.node_dockerd(worker_node, Path(f"/tmp/bench-mn-docker-{uuid.uuid4().hex[:6]}"),
                                            log_dir / "node-dockerd.log", stack)
        node_env = {**os.environ, "DOCKER_HOST": node_socket,
                    "AGENTRL_S3_ENDPOINT": f"http://{netns.HOST}:{s3_port}"}
        ray_address = netns.ray_cluster(netns.HOST, worker_node, dict(os.environ), node_env, log_dir, stack)

        def run_once() -> dict:
            import ray as ray_api

            master = f"{netns.HOST}:{free_port()}"
            rank1 = subprocess.Popen([*worker_node.launcher, sys.executable, "-m", "infra.train.ranks", "--master",
                                      master, "--rank", "1", "--world-size", "2"], env=env, cwd=ROOT,
                                     stdout=open(log_dir / "rank1.log", "a"), stderr=subprocess.STDOUT)  # noqa: SIM115
            try:
                c = _config(base, RemoteEngine(urls=[url]), 2, master, f"http://{netns.HOST}:{s3_port}")
                c = c.model_copy(update={"rollout": c.rollout.model_copy(update={"fan_out": "ray",
                                                                                 "ray_address": ray_address})})
                return _run(c)
            finally:
                rank1.kill()
                ray_api.shutdown()  # the next run joins again

        yield run_once


def main() -> None:
    """Alternate the two layouts ``--rounds`` times; print each run and the medians' ratios; save them as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--config", type=Path, default=ROOT / "configs/quickstart.toml",
                        help="the run config whose first step is timed (its engine and ranks are replaced)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/multinode_step.json")
    a = parser.parse_args()
    import signal
    import tempfile

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark still removes its namespaces
    work = Path(tempfile.mkdtemp(prefix="bench-mn-"))
    runs: dict[str, list[dict]] = {"1-node": [], "3-ns": []}
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # Prefect's own, if no API
    with three_namespaces(a.config, work) as on_three:
        for r in range(a.rounds):
            order = ("1-node", "3-ns") if r % 2 == 0 else ("3-ns", "1-node")
            for layout in order:
                result = one_node(a.config) if layout == "1-node" else on_three()
                runs[layout].append(result)
                print(f"round {r} {layout}: {json.dumps(result)}", flush=True)
    medians = {lay: {k: statistics.median(x[k] for x in rs) for k in STAGES} for lay, rs in runs.items()}
    for k in STAGES:
        print(f"{k}: 1-node {medians['1-node'][k]:.1f}  3-ns {medians['3-ns'][k]:.1f}  "
              f"ratio 3-ns/1-node {medians['3-ns'][k] / max(medians['1-node'][k], 1e-9):.2f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"runs": runs, "medians": medians, "config": a.config.name}, indent=1))


if __name__ == "__main__":
    main()
