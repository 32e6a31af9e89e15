"""One Prefect backend per checkout, and a SIGKILLed flow leaves nothing behind (real Prefect servers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from infra.net import free_port
from infra.prefect_backend import healthy

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _start_sleepy(home: Path, run_id: str, tmp_path: Path, env_extra: dict) -> tuple[subprocess.Popen, str, int]:
    env = {**os.environ, "PREFECT_HOME": str(home), **env_extra}
    if "PREFECT_API_URL" not in env_extra:
        env.pop("PREFECT_API_URL", None)
    child_file = tmp_path / f"{run_id}.child"
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.sleepy_flow", run_id, str(child_file)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    api_url, deadline = "", time.monotonic() + 240
    for line in proc.stdout:
        if line.startswith("API "):
            api_url = line.split()[1]
        if "RUNNING" in line:
            break
        assert time.monotonic() < deadline and proc.poll() is None, line
    time.sleep(1.0)  # the watchdog snapshots the process tree every 0.2 s: let it see the new child
    return proc, api_url, int(child_file.read_text())


def _flow_run_state(api_url: str, run_id: str) -> str:
    runs = httpx.post(f"{api_url}/flow_runs/filter", json={"flow_runs": {"tags": {"all_": [f"run:{run_id}"]}}},
                      timeout=10).json()
    return runs[0]["state"]["type"] if runs else "NONE"


def test_without_a_server_the_temporary_one_and_the_children_die_with_the_flow(tmp_path, services_env):
    home = tmp_path / "home"
    proc, api_url, child = _start_sleepy(home, f"k-{uuid.uuid4().hex[:6]}", tmp_path, {})
    assert api_url and httpx.get(f"{api_url}/health", timeout=5).status_code == 200 and _alive(child)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (_alive(child) or healthy(api_url)):
        time.sleep(0.5)
    assert not _alive(child), "the flow's child process outlived it"
    assert not healthy(api_url), "the temporary Prefect server outlived the flow"


def test_with_the_checkout_server_flows_use_it_and_a_killed_run_is_crashed(tmp_path, services_env, monkeypatch):
    from infra import prefect_server
    from infra.prefect_backend import ZOMBIE_AUTOMATION

    home = tmp_path / "home"
    monkeypatch.setenv("PREFECT_HOME", str(home))
    api_url = prefect_server.start(home, port=free_port())
    try:
        profile = (home / "profiles.toml").read_text()
        assert 'active = "agentrl"' in profile and api_url in profile  # a new shell with this PREFECT_HOME finds it
        automations = httpx.post(f"{api_url}/automations/filter", json={}, timeout=10).json()
        assert [a["name"] for a in automations] == [ZOMBIE_AUTOMATION]
        run_id = f"c-{uuid.uuid4().hex[:6]}"
        proc, used, child = _start_sleepy(home, run_id, tmp_path, {})
        assert used == api_url  # the profile's server, not a second one on the same database
        assert _flow_run_state(api_url, run_id) == "RUNNING"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (_flow_run_state(api_url, run_id) != "CRASHED" or _alive(child)):
            time.sleep(0.5)
        assert _flow_run_state(api_url, run_id) == "CRASHED" and not _alive(child)
        assert healthy(api_url)  # the checkout's server stays up
    finally:
        prefect_server.stop(home)
    assert "PREFECT_API_URL" not in (home / "profiles.toml").read_text()
