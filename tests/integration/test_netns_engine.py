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


# post_train on a remote engine that fetches its checkpoints from S3, with trainer ranks on two nodes and
# rollouts on a third, killed and resumed: test_netns_ray.py
