"""The compose override a multi-service sandbox runs with (infra/sandbox/compose.py): logic only, no engine."""

from __future__ import annotations

from envs.task import ComposeServices
from infra.sandbox.compose import override, service_names

COMPOSE = """\
services:
  client:
    build: {context: client}
    command: ["sh", "-c", "sleep infinity"]
    networks: [app-network]
  server:
    build: {context: server}
    ports: ["8000"]
    networks: [app-network]
  cache:
    build: {context: cache}
networks:
  app-network: {driver: bridge}
"""


def _services(tmp_path, text=COMPOSE):
    path = tmp_path / "docker-compose.yaml"
    path.write_text(text)
    return ComposeServices(file=path, main="client")


def test_agent_service_is_isolated_and_the_others_keep_their_own(tmp_path):
    s = _services(tmp_path)
    tags = {n: f"img-{n}" for n in service_names(s)}
    out = override(s, tags, {"agentrl": "1"}, {"pids_limit": 1024, "mem_limit": "512m"}, False, "agentrl-internet")
    client, server, cache = (out["services"][n] for n in ("client", "server", "cache"))
    assert client["image"] == "img-client" and client["command"] == ["sleep", "infinity"] and client["init"] is True
    assert client["cap_drop"] == ["ALL"] and client["security_opt"] == ["no-new-privileges"]
    assert (client["pids_limit"], client["mem_limit"]) == (1024, "512m")
    assert "cap_drop" not in server and "command" not in server  # a server keeps what its file gives it
    assert all(svc["labels"] == {"agentrl": "1"} for svc in (client, server, cache))
    # every network of the project is internal: the services reach each other, not the host nor the outside
    assert out["networks"] == {"app-network": {"internal": True}, "default": {"internal": True}}
    assert client["networks"] == ["app-network"] and cache["networks"] == ["default"]
    assert "version" not in out


def test_network_adds_the_outside_bridge_to_every_service(tmp_path):
    s = _services(tmp_path, "version: '2.4'\n" + COMPOSE)
    out = override(s, {n: n for n in service_names(s)}, {}, {}, True, "agentrl-internet")
    assert out["version"] == "2.4"  # compose refuses two files of different versions
    assert out["networks"]["agentrl-internet"] == {"external": True}
    assert out["services"]["client"]["networks"] == ["app-network", "agentrl-internet"]
    assert out["services"]["cache"]["networks"] == ["default", "agentrl-internet"]


def test_behind_the_egress_proxy_every_service_gets_the_proxy_its_siblings_direct(tmp_path):
    text = COMPOSE.replace("    ports: [\"8000\"]\n", "    ports: [\"8000\"]\n    environment: [\"MODE=prod\"]\n")
    s = _services(tmp_path, text)
    egress = {"HTTPS_PROXY": "http://tok:x@172.31.251.1:39000", "NO_PROXY": "localhost", "no_proxy": "localhost",
              "SSL_CERT_FILE": "/etc/agentrl/egress-ca-bundle.pem", "agentrl_ca_bundle": "/cache/ca-bundle.pem"}
    out = override(s, {n: n for n in service_names(s)}, {}, {}, True, "agentrl-egress", egress)
    server = out["services"]["server"]
    assert server["networks"] == ["app-network", "agentrl-egress"]
    assert server["environment"]["MODE"] == "prod"  # the service's own environment is kept
    assert server["environment"]["HTTPS_PROXY"] == "http://tok:x@172.31.251.1:39000"
    assert server["environment"]["NO_PROXY"] == "localhost,client,server,cache"  # siblings are reached directly
    assert "agentrl_ca_bundle" not in server["environment"]
    assert server["volumes"] == ["/cache/ca-bundle.pem:/etc/agentrl/egress-ca-bundle.pem:ro"]
    assert "environment" not in override(s, {n: n for n in service_names(s)}, {}, {}, True, "agentrl-internet")[
        "services"]["client"]
