"""The engines' bearer token: every route but /health refused without it; servers beyond loopback need one."""

import importlib

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from infra.rollout.engine_auth import TOKEN_ENV, EngineTokenMiddleware
from infra.rollout.servers import VLLMServer, server_middleware


def _app(monkeypatch, token="s3cret"):
    monkeypatch.setenv(TOKEN_ENV, token)

    def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in
                            ("/health", "/collective_rpc", "/v1/completions", "/reset_prefix_cache")])
    for path in server_middleware(token=True):  # as vLLM's --middleware adds a server's, in its order
        module, name = path.rsplit(".", 1)
        app.add_middleware(getattr(importlib.import_module(module), name))
    return TestClient(app)


def test_control_and_inference_routes_need_the_token(monkeypatch):
    client = _app(monkeypatch)
    assert client.post("/agentrl/pause").status_code == 401  # the version gate's routes sit behind the token
    assert client.post("/agentrl/resume", params={"version": 9}).status_code == 401
    assert client.get("/agentrl/version", headers={"Authorization": "Bearer s3cret"}).json()["version"] == 0
    for path in ("/collective_rpc", "/v1/completions", "/reset_prefix_cache"):
        assert client.post(path).status_code == 401, path  # vLLM's --api-key leaves /collective_rpc open
        assert client.post(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.post(path, headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert client.post(path, headers={"Authorization": "Bearer s3cret"}).text == "ok"
    stamped = client.post("/v1/completions", headers={"Authorization": "Bearer s3cret"})
    assert "x-agentrl-policy-version" in stamped.headers
    assert client.get("/health").text == "ok"  # readiness probes stay open


def test_a_server_without_a_token_refuses_to_start(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match="AGENTRL_ENGINE_TOKEN is not set"):
        EngineTokenMiddleware(lambda *a: None)


def test_binding_beyond_loopback_needs_a_token_and_a_wildcard_an_advertised_address(tmp_path):
    with pytest.raises(ValueError, match="beyond loopback needs a token"):
        VLLMServer("m", 8000, tmp_path / "log", host="10.0.0.2")
    with pytest.raises(ValueError, match="advertise"):
        VLLMServer("m", 8000, tmp_path / "log", host="0.0.0.0", token="t")
    assert VLLMServer("m", 8000, tmp_path / "log", host="0.0.0.0", advertise="10.0.0.2", token="t").url == \
        "http://10.0.0.2:8000"
    assert VLLMServer("m", 8000, tmp_path / "log").url == "http://127.0.0.1:8000"  # loopback: a token is optional


def test_remote_servers_need_the_token_and_name_what_is_wrong(monkeypatch, tmp_path):
    import httpx

    from infra.config import RemoteEngine
    from infra.rollout.servers import connect_remote

    with pytest.raises(RuntimeError, match=r"\$AGENTRL_ENGINE_TOKEN is not set"):
        connect_remote(["http://127.0.0.1:9"], "", "float32")
    with pytest.raises(RuntimeError, match="engine.urls: http://127.0.0.1:9 cannot be reached"):
        connect_remote(["http://127.0.0.1:9/"], "t", "float32")
    with pytest.raises(ValueError, match="engine.urls: '10.0.0.7:8000' is not a server's base URL"):
        RemoteEngine(urls=["10.0.0.7:8000"])
    with pytest.raises(ValueError):
        RemoteEngine(urls=[])

    def models(request: httpx.Request) -> httpx.Response:  # a server's /v1/models, behind its token
        if request.headers.get("authorization") != "Bearer right":
            return httpx.Response(401)
        return httpx.Response(200, json={"data": [{"id": "/models/smollm2", "max_model_len": 2048}]})

    real_get = httpx.get
    monkeypatch.setattr(httpx, "get", lambda url, **kw: httpx.Client(transport=httpx.MockTransport(models)).get(
        url, **kw) if "10.0.0.7" in url else real_get(url, **kw))
    with pytest.raises(RuntimeError, match="http://10.0.0.7:8000 refuses the token in \\$AGENTRL_ENGINE_TOKEN"):
        connect_remote(["http://10.0.0.7:8000"], "wrong", "bfloat16")
    (handle,) = connect_remote(["http://10.0.0.7:8000/"], "right", "bfloat16")
    assert (handle.url, handle.model_dir, handle.max_model_len, handle.dtype, handle.token) == (
        "http://10.0.0.7:8000", "/models/smollm2", 2048, "bfloat16", "right")
