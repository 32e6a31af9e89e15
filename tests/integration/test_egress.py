"""The egress layer on real parts: mitmproxy, dockerd's agentrl-egress network, real sandboxes, a real task.

Every request here goes through the proxy to hosts this machine reaches (PyPI, Debian's archive) or is
answered by it (a denial, the cache, a mirror); nothing is sent to any other address.
"""

import hashlib
import json
import os
import ssl
import urllib.request
from pathlib import Path

import pytest

from envs.taskset import load_taskset
from infra.egress.ca import egress_home, host_bundle
from infra.egress.policy import Mirror
from infra.egress.proxy import EGRESS_GATEWAY, EgressProxy, EgressSettings
from infra.environments import BASE_IMAGE, build_catalog
from infra.store import validate_rows
from tests.helpers import run_scripted_episode

pytestmark = pytest.mark.integration

CSV_TO_PARQUET = Path(__file__).resolve().parents[1] / "fixtures" / "real_tasks" / "terminal-bench" / "csv-to-parquet"
# GET each URL through whatever proxy the environment names; print "<status> <first bytes>" per URL
FETCH = r"""python3 - "$@" <<'EOF'
import sys, urllib.request, urllib.error
for url in sys.argv[1:]:
    try:
        r = urllib.request.urlopen(url, timeout=60)
        print(r.status, r.read()[:120])
    except urllib.error.HTTPError as e:
        print(e.code, e.read()[:400])
    except Exception as e:
        print("error", type(e).__name__, e)
EOF"""


def fetch(box, *urls: str, env: dict | None = None) -> list[str]:
    """One line per URL: status and the body's first bytes, fetched inside ``box``."""
    r = box.exec(f"set -- {' '.join(urls)}\n{FETCH}", timeout_s=120, env=env)
    assert r.exit_code == 0, r.output
    return r.output.strip().splitlines()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf-mirror")
    (folder / "org" / "tiny" / "resolve" / "abc123").mkdir(parents=True)
    (folder / "org" / "tiny" / "resolve" / "abc123" / "config.json").write_text('{"model_type": "llama"}')
    return folder


@pytest.fixture(scope="module")
def egress_backend(services_env, hf_folder):
    from infra.sandbox.docker_backend import DockerBackend

    proxy = EgressProxy(EGRESS_GATEWAY, EgressSettings(
        mirrors=(Mirror("uv"), Mirror("folder", "https://huggingface.co/", str(hf_folder)))))
    yield DockerBackend(egress=proxy)
    proxy.close()


def test_allowlisted_sandbox_reaches_its_hosts_only_through_the_proxy_and_each_phase_is_recorded(egress_backend):
    box = egress_backend.start(BASE_IMAGE, {"agentrl.task": "harbor/allowlisted"}, network=True,
                               egress_hosts=("pypi.org",))
    try:
        allowed, denied, plain = fetch(box, "https://pypi.org/simple/six/", "https://deb.debian.org/debian/",
                                       "http://deb.debian.org/debian/")
        assert allowed.startswith("200 ")
        assert denied.startswith("error URLError") and "Tunnel connection failed: 403" in denied  # at CONNECT
        # a plain-http request gets the body that names the policy
        assert plain.startswith("403 ") and "host deb.debian.org is not allowed for harbor/allowlisted" in plain
        assert "the task's allowlist" in plain and "allowed: pypi.org" in plain
        # the sandbox has no way out but the proxy: without the proxy variables nothing is reached
        (direct,) = fetch(box, "https://pypi.org/simple/six/",
                          env={"HTTPS_PROXY": "", "https_proxy": "", "ALL_PROXY": "", "all_proxy": ""})
        assert direct.startswith("error "), direct
        box.phase = "verifier"  # what envs.verify sets before the tests run
        (tests,) = fetch(box, "https://pypi.org/simple/six/")
        assert tests.startswith("200 ")
        record = box.egress_record()
    finally:
        box.close()
    agent, verifier = record["agent"], record["verifier"]
    assert (agent["requests"], agent["hosts"], agent["denied"]) == (3, ["pypi.org", "deb.debian.org"],
                                                                   ["deb.debian.org"])
    assert (verifier["requests"], verifier["hosts"], verifier["denied"]) == (1, ["pypi.org"], [])
    assert agent["bytes"] > 0 and verifier["bytes"] > 0


def test_the_proxy_reaches_no_internal_address_and_tunnels_only_web_ports(egress_backend):
    """A task that allows any host still reaches neither this machine's own services (the S3 server on
    loopback, the egress bridge's address) nor a tunnel to another port than 80 or 443."""
    s3 = os.environ["AGENTRL_S3_ENDPOINT"]
    box = egress_backend.start(BASE_IMAGE, {"agentrl.task": "tb/any-host"}, network=True)
    try:
        loopback, bridge = fetch(box, f"{s3}/", f"http://{EGRESS_GATEWAY}:{egress_backend.egress.port}/",
                                 env={"NO_PROXY": "", "no_proxy": ""})  # asked of the proxy, not the sandbox's lo
        tunnel = box.exec("python3 -c \"import http.client, os, urllib.parse; p = urllib.parse.urlsplit("
                          "os.environ['HTTPS_PROXY']); c = http.client.HTTPConnection(p.hostname, p.port, timeout=30); "
                          "c.set_tunnel('pypi.org', 22, headers={'Proxy-Authorization': 'Basic ' + __import__('base64')"
                          ".b64encode(f'{p.username}:x'.encode()).decode()}); c.connect()\"", timeout_s=60)
        record = box.egress_record()["agent"]
    finally:
        box.close()
    for line in (loopback, bridge):
        assert line.startswith("502 ") and "internal address" in line, line
    assert tunnel.exit_code != 0 and "403" in tunnel.output, tunnel.output
    assert record["requests"] == 3 and record["denied"] == ["pypi.org"]


def test_agent_allow_keeps_an_agent_whose_task_allows_any_host_from_other_hosts(services_env):
    """tasks.egress.agent_allow: the agent of a Terminal-Bench task (any host) reaches only PyPI; its tests
    keep the task's access."""
    from infra.sandbox.docker_backend import DockerBackend

    proxy = EgressProxy(EGRESS_GATEWAY, EgressSettings(agent_allow=("pypi.org", "files.pythonhosted.org")))
    backend = DockerBackend(egress=proxy)
    box = backend.start(BASE_IMAGE, {"agentrl.task": "tb/any-host"}, network=True)
    try:
        (agent,) = fetch(box, "http://deb.debian.org/debian/dists/bookworm/Release")
        box.phase = "verifier"
        (tests,) = fetch(box, "http://deb.debian.org/debian/dists/bookworm/Release")
        record = box.egress_record()
    finally:
        box.close()
        proxy.close()
    assert agent.startswith("403 ") and "tasks.egress.agent_allow" in agent
    assert tests.startswith("200 ")
    assert record["agent"]["denied"] == ["deb.debian.org"] and record["verifier"]["denied"] == []


def _pypi_wheel_url(name: str, filename: str) -> str:
    """The files.pythonhosted.org URL of one wheel, from PyPI's simple API (PEP 691 JSON), fetched here."""
    req = urllib.request.Request(f"https://pypi.org/simple/{name}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    bundle = host_bundle()
    context = ssl.create_default_context(cafile=str(bundle) if bundle else None)
    with urllib.request.urlopen(req, timeout=60, context=context) as r:
        files = json.loads(r.read())["files"]
    return next(f["url"] for f in files if f["filename"] == filename)


def test_a_versioned_artifact_is_fetched_once_then_served_from_the_cache(egress_backend):
    url = _pypi_wheel_url("six", "six-1.16.0-py2.py3-none-any.whl")
    (egress_home() / "cache" / "index" / f"{hashlib.sha256(url.encode()).hexdigest()}.json").unlink(missing_ok=True)
    seen = []
    for _ in range(2):  # two sandboxes, as two episodes
        box = egress_backend.start(BASE_IMAGE, {"agentrl.task": "tb/cache"}, network=True)
        try:
            (line,) = fetch(box, url)
            seen.append((line, box.egress_record()["agent"]))
        finally:
            box.close()
    (first, cold), (second, warm) = seen
    assert first.startswith("200 b'PK") and second == first  # the same wheel (a zip) both times
    assert (cold["cached"], warm["cached"]) == (0, 1)
    assert cold["upstream_bytes"] == cold["bytes"] > 10_000 and warm["upstream_bytes"] == 0


def test_declared_mirrors_serve_uvs_installer_from_pypis_wheel_and_a_folder(egress_backend):
    box = egress_backend.start(BASE_IMAGE, {"agentrl.task": "tb/mirrors"}, network=True)
    try:
        r = box.exec("python3 -c \"import urllib.request; print(urllib.request.urlopen("
                     "'https://astral.sh/uv/0.7.13/install.sh').read().decode())\" > /tmp/install.sh && "
                     "sh /tmp/install.sh && . $HOME/.local/bin/env && uv --version && uvx --version",
                     timeout_s=300)
        assert r.exit_code == 0, r.output
        assert "served by the uv mirror: uv 0.7.13 from PyPI's uv wheel" in r.output  # visible in the log
        assert "uv 0.7.13" in r.output and "uvx 0.7.13" in r.output
        (config, missing) = fetch(box, "https://huggingface.co/org/tiny/resolve/abc123/config.json",
                                  "https://huggingface.co/org/tiny/resolve/abc123/model.safetensors")
        record = box.egress_record()["agent"]
    finally:
        box.close()
    assert config == """200 b'{"model_type": "llama"}'"""
    assert missing.startswith("404 ") and "has no file for" in missing
    assert [m.split(": ")[0] for m in record["mirrored"]] == ["uv", "uv", "folder https://huggingface.co/",
                                                              "folder https://huggingface.co/"]


def test_exclude_newer_serves_pypi_as_it_was_to_uv_and_to_an_html_client(services_env, tmp_path):
    """The ``exclude-newer`` mirror: uv in a real sandbox resolves ``six`` to the newest release uploaded before
    2020-01-01 (1.13.0; 1.14.0 came on 2020-01-15), the wheel's metadata fetched from PyPI's file host; a client
    that asks for HTML gets the same page as PEP 503 links; each page served is in the record, by name."""
    from infra.sandbox.docker_backend import DockerBackend

    proxy = EgressProxy(EGRESS_GATEWAY, EgressSettings(mirrors=(Mirror("uv"), Mirror("exclude-newer",
                                                                                     source="2020-01-01"))))
    backend = DockerBackend(egress=proxy)
    box = backend.start(BASE_IMAGE, {"agentrl.task": "tb/exclude-newer"}, network=True)
    (tmp_path / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nRUN true\n")
    try:
        # what a build's installs resolve to depends on the cutoff: an image built under it is not reused without
        dated, _, _ = backend.build_image("tb/exclude-newer", tmp_path)
        plain, _, _ = DockerBackend().build_image("tb/exclude-newer", tmp_path)
        r = box.exec("python3 -c \"import urllib.request; print(urllib.request.urlopen("
                     "'https://astral.sh/uv/0.7.13/install.sh').read().decode())\" | sh && . $HOME/.local/bin/env && "
                     "echo six > /tmp/r.in && uv pip compile --no-header --no-cache /tmp/r.in", timeout_s=300)
        (page,) = fetch(box, "https://pypi.org/simple/six/")
        (missing,) = fetch(box, "https://pypi.org/simple/no-such-project-agentrl-test/")
        record = box.egress_record()["agent"]
    finally:
        box.close()
        proxy.close()
    for image in backend.client.images.list(name="agentrl-task-tb-exclude-newer"):
        backend.client.images.remove(image.id, force=True)
    assert dated != plain
    assert r.exit_code == 0, r.output
    assert "six==1.13.0" in r.output.splitlines()
    assert page.startswith("200 b'<!DOCTYPE html>") and missing.startswith("404 ")
    assert [m.split(": ")[0] for m in record["mirrored"]].count("exclude-newer 2020-01-01") == 3
    assert "files.pythonhosted.org" in record["hosts"]


def test_real_task_whose_tests_install_uv_from_astral_sh_validates_through_the_uv_mirror(egress_backend,
                                                                                       tiny_tokenizer):
    """csv-to-parquet, as authored: its run-tests.sh runs ``curl https://astral.sh/uv/0.7.13/install.sh | sh``
    (unreachable here: cause ``unreachable_host`` without the proxy, test_real_tasks.py), then ``uv pip install``
    from PyPI. Through the proxy with the uv mirror declared it validates; the build's apt-get went through the
    proxy too. Then one episode of the built-in agent (scripted replies) stores its egress by phase in its row."""
    for image in egress_backend.client.images.list(name="agentrl-task-csv-to-parquet"):  # build it through the proxy
        egress_backend.client.images.remove(image.id, force=True)
    tasks, errors = load_taskset(CSV_TO_PARQUET)
    assert errors == []
    (task,) = tasks
    entries, logs = build_catalog(egress_backend, {task.task_id: task}, {task.task_id: "train"},
                                  max_parallel_builds=1)
    (entry,), log = entries, logs[task.task_id]
    assert (entry.usable, entry.validation) == (True, "passed"), (entry.reason, log[-3000:])
    assert "egress: " in log and "archive.ubuntu.com" in log  # the build's apt-get, through the proxy
    assert "[verifier] egress served by mirror uv: https://astral.sh/uv/0.7.13/install.sh" in log

    row, _ = run_scripted_episode(egress_backend, tiny_tokenizer, task, entry, [
        "```bash\ncurl -s -o /dev/null -w '%{http_code}' https://pypi.org/simple/six/\n```", "DONE"], max_turns=3)
    validate_rows([row])
    assert (row["egress_agent_requests"], row["egress_agent_hosts"], row["egress_agent_denied"]) == (1, ["pypi.org"],
                                                                                                   [])
    assert {"astral.sh", "github.com", "pypi.org"} <= set(row["egress_verifier_hosts"])
    assert row["egress_verifier_requests"] >= 3 and row["egress_verifier_denied"] == []
