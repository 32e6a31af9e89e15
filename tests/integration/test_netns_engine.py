"""An engine on another machine: a real vLLM server in a network namespace, bound to its bridge address.

Reached from the flow's namespace with the run's token only, it serves and reloads weights in place;
nothing of it is reachable on the flow machine's loopback or without the token.
"""

from __future__ import annotations

import secrets
import subprocess

import httpx
import pytest

from infra.net import free_port
from infra.rollout.engine import SampleRequest
from tests.integration import netns

pytestmark = pytest.mark.integration  # a real vLLM server, network namespaces (root)


def test_an_engine_in_another_namespace_serves_the_run_with_its_token_only(tiny_model, tiny_tokenizer, tmp_path):
    from infra.rollout.servers import ServerEngine, VLLMServer

    with netns.nodes(1) as (node,):
        port = free_port()  # free here too, so a connection on this machine's loopback is refused
        server = VLLMServer(str(tiny_model), port, tmp_path / "vllm.log", max_model_len=1024, kv_cache_gib=1.0,
                            threads=1, host=node.address, token=secrets.token_urlsafe(16), launcher=node.launcher)
        server.start()
        engine = None
        try:
            server.wait_ready(300)
            assert server.url == f"http://{node.address}:{port}"
            ns = subprocess.run(["ip", "netns", "identify", str(server.proc.pid)], capture_output=True, text=True)
            assert ns.stdout.strip() == node.netns  # it runs on the other node
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            for path, body in (("/collective_rpc", {"method": "staged_weights"}), ("/v1/completions", {})):
                assert httpx.post(server.url + path, json=body, timeout=10).status_code == 401, path
            assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
            assert httpx.post(server.url + "/reset_prefix_cache", timeout=10).status_code == 401

            engine = ServerEngine([server], tiny_tokenizer)
            prompt = tiny_tokenizer("hello from the flow machine")["input_ids"]
            (before,) = engine.generate([SampleRequest(prompt, 6, 1.0, 1.0, 0)], ["t0"])
            assert len(before.token_ids) > 0 and before.policy_version == 0 and before.replica == server.url
            assert engine.load_weights(str(tiny_model), 1) > 0  # /collective_rpc with the token: in-place reload
            (after,) = engine.generate([SampleRequest(prompt, 6, 1.0, 1.0, 0)], ["t1"])
            assert after.policy_version == 1 and len(after.token_ids) > 0
        finally:
            if engine is not None:
                engine.close()
            server.stop()
        assert server.proc.pid not in node.pids()


def test_post_train_on_a_remote_engine_that_fetches_its_checkpoints_from_s3(tiny_model, s3, prefect_harness,
                                                                            tmp_path, monkeypatch):
    """``engine.kind = "remote"``: a server started with ``python -m infra.rollout.servers`` on another node
    serves a ``post_train`` step, then fetches v1 from S3 itself (presigned URLs, no S3 keys, no shared
    folder), and a resumed run loads v1 into it the same way. The step trains on 2 ranks: the flow's
    process and ``python -m infra.train.ranks`` on a third node (the loss scale: test_netns_trainer)."""
    import os
    import sys
    import time
    import uuid
    from urllib.parse import urlsplit

    from flows.post_train import post_train
    from infra.config import (
        EvalConfig,
        ModelConfig,
        RemoteEngine,
        RolloutConfig,
        RunConfig,
        StoragePublish,
        TaskSetConfig,
        TrainConfig,
    )
    from infra.rollout.engine_auth import TOKEN_ENV
    from infra.run import Run
    from infra.store import read_step

    token = secrets.token_urlsafe(16)
    monkeypatch.setenv(TOKEN_ENV, token)
    s3_at = urlsplit(os.environ["AGENTRL_S3_ENDPOINT"])
    with netns.nodes(2) as (node, trainer_node), netns.forward((s3_at.hostname, s3_at.port)) as s3_port:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "AGENTRL_S3"))}  # no S3 keys there
        master = f"{netns.HOST}:{free_port(netns.HOST)}"  # free there: the forwarder also binds there
        rank1 = subprocess.Popen([*trainer_node.launcher, sys.executable, "-m", "infra.train.ranks", "--master",
                                  master, "--rank", "1", "--world-size", "2"], env=env,
                                 stdout=open(tmp_path / "rank1.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
        cli = subprocess.Popen([*node.launcher, sys.executable, "-m", "infra.rollout.servers", "--model",
                                str(tiny_model), "--host", node.address, "--port", str(port), "--dtype", "float32",
                                "--max-model-len", "1024", "--kv-cache-gib", "1", "--threads", "1",
                                "--log", str(tmp_path / "vllm.log")], env=env, stdout=subprocess.PIPE, text=True)
        url = f"http://{node.address}:{port}"
        try:
            ready = cli.stdout.readline()
            assert ready.startswith(f"serving {tiny_model} at {url}"), (tmp_path / "vllm.log").read_text()
            config = RunConfig(
                run_id=f"remote-{uuid.uuid4().hex[:8]}", steps=1,
                model=ModelConfig(path=str(tiny_model), max_model_len=1024, kv_cache_gib=1.0),
                tasks=TaskSetConfig(humaneval_train=2, humaneval_eval=0),
                engine=RemoteEngine(urls=[url]),
                rollout=RolloutConfig(tasks_per_step=2, group_size=2, max_tokens_per_turn=16, max_turns=1),
                eval=EvalConfig(enabled=False),
                publish=StoragePublish(endpoint=f"http://{netns.HOST}:{s3_port}"),
                train=TrainConfig(world_size=2, master=master, ranks_timeout_s=300),
            )
            (summary,) = post_train(config)
            assert summary["policy_version"] == 1 and not summary["checkpoint_refused"]
            assert rank1.wait(60) == 0  # the run's end closed its trainer, and rank 1 with it
            assert "rank 1: step" in (tmp_path / "rank1.log").read_text()
            assert os.environ.get("WORLD_SIZE") in (None, "1")  # rank 0's group and environment are gone
            assert summary["publish_transfer_s"] > 0
            with Run.open(config) as run:
                rows = read_step(s3, run.layout.trajectories(0)).to_pylist()
                assert rows and {r["engine_replica"] for r in rows if r["outcome"] != "infra_failure"} == {url}
                assert not (run.layout.work / "v1").exists()  # the flow machine never fetched the checkpoint
                assert run.resume() == 1
                engine = run.engine  # the server reloads v1 from S3 (it cannot read this machine's folders)
                (sample,) = engine.generate([SampleRequest([1, 2, 3], 4, 1.0, 1.0, 0)], ["t"])
                assert sample.policy_version == 1 and sample.replica == url
            log = (tmp_path / "vllm.log").read_text()
            assert log.count("POST /collective_rpc") >= 4  # stage + poll + apply, twice
        finally:
            rank1.kill()
            cli.terminate()  # the command line stops its server on SIGTERM
            cli.wait(timeout=60)
            deadline = time.monotonic() + 30
            while node.pids() and time.monotonic() < deadline:
                time.sleep(0.5)
            assert node.pids() == []
