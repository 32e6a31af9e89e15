"""Local service bring-up: a real up/down round trip (dockerd, base image, SeaweedFS)."""

from __future__ import annotations

import json
import random
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import services


def _free_port_block(n: int = 10) -> int:
    """A base port whose block of ``n`` ports is free now (not 8333: a default instance may run)."""
    for _ in range(50):
        base = random.randrange(20000, 60000 - n)
        if all(services._port_free(p) for p in range(base, base + n)):
            return base
    raise RuntimeError("no free block of ports")


@pytest.mark.integration
def test_up_twice_then_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import docker
    import s3fs

    for name in ("AGENTRL_S3_ENDPOINT", "AGENTRL_S3_PORT", "AGENTRL_BUCKET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # up() sets it when unset; keep it scoped
    state = tmp_path / "state"
    port = _free_port_block()
    try:
        env = services.up(state, s3_port=port)
        engine_host = env["DOCKER_HOST"]
        t0 = time.monotonic()
        assert services.up(state, s3_port=port) == env
        assert time.monotonic() - t0 < 10  # second up only checks

        assert env["AGENTRL_S3_ENDPOINT"] == f"http://127.0.0.1:{port}"
        assert env["AWS_DEFAULT_REGION"] == "us-east-1" and env["AGENTRL_BUCKET"] == "agentrl"
        assert services.services_env(state) == env
        record = json.loads((state / "services.json").read_text())
        assert "weed" in record["started"]  # plus "dockerd" on a machine where no engine answered
        assert f"export AGENTRL_S3_ENDPOINT=http://127.0.0.1:{port}\n" in (state / "services.env").read_text()
        assert stat.S_IMODE((state / "s3.json").stat().st_mode) == 0o600

        client = docker.DockerClient(base_url=engine_host)
        assert client.images.list(name=services.BASE_IMAGE)

        fs = s3fs.S3FileSystem(
            key=env["AWS_ACCESS_KEY_ID"],
            secret=env["AWS_SECRET_ACCESS_KEY"],
            client_kwargs={"endpoint_url": env["AGENTRL_S3_ENDPOINT"]},
            skip_instance_cache=True,
        )
        assert "agentrl" in [b.rstrip("/") for b in fs.ls("")]
        fs.pipe("agentrl/test/hello.txt", b"hello")
        assert fs.cat("agentrl/test/hello.txt") == b"hello"

        # the CLI sees the same state
        out = subprocess.run(
            [sys.executable, "-m", "infra.services", "env", "--state", str(state)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out == (state / "services.env").read_text()

        weed_pid = int((state / "weed.pid").read_text())
        assert sorted(services.down(state)) == sorted(record["started"])
        assert not services._cmdline(weed_pid)
        assert not (state / "weed.pid").exists() and not (state / "services.json").exists()
        assert services._port_free(port)
        if "dockerd" not in record["started"]:
            assert client.ping()  # an engine we did not start is left running
        assert services.down(state) == []
    finally:
        services.down(state)
