"""Local service bring-up: the helpers of `make up` / `make down`, without starting a service."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from infra import services


def test_debian_mirror_deb822_first_uris(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# comment\nURIs: http://mirror.example/debian\nSuites: bookworm\n\n"
        "Types: deb\nURIs: http://mirror.example/debian-security\n"
    )
    assert services._debian_mirror(tmp_path) == "http://mirror.example/debian"


def test_debian_mirror_one_line_with_options(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text(
        "# deb http://commented.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main\n"
    )
    assert services._debian_mirror(tmp_path) == "http://mirror.example/debian"


def test_debian_mirror_missing_names_files(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="no Debian mirror"):
        services._debian_mirror(tmp_path)


def test_weed_ports_block() -> None:
    ports = services._weed_ports(20000)
    # ten listeners (s3, master, volume, filer, four grpc, admin http + grpc) on 20000..20009
    assert sorted(ports.values()) == list(range(20000, 20010))
    assert ports["s3.port"] == 20000
    with pytest.raises(ValueError, match="S3 port 65530"):
        services._weed_ports(65530)


def test_our_pid_checks_cmdline(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        pid_file = tmp_path / "x.pid"
        pid_file.write_text(f"{proc.pid}\n")
        assert services._our_pid(pid_file, "sleep", "30") == proc.pid
        assert services._our_pid(pid_file, "weed", "30") is None  # pid reused by another program
        assert services._our_pid(pid_file, "sleep", "-dir=/elsewhere") is None
        assert services._our_pid(tmp_path / "missing.pid", "sleep", "30") is None
    finally:
        proc.kill()
        proc.wait()
    assert services._our_pid(pid_file, "sleep", "30") is None  # dead


def test_services_env_prefers_user_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTRL_S3_ENDPOINT", "http://s3.example:9000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.delenv("AGENTRL_BUCKET", raising=False)
    env = services.services_env(tmp_path)
    assert env["AGENTRL_S3_ENDPOINT"] == "http://s3.example:9000"
    assert env["AGENTRL_BUCKET"] == "agentrl"
    assert set(env) == set(services.ENV_KEYS)


def test_services_env_without_up_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTRL_S3_ENDPOINT", raising=False)
    with pytest.raises(RuntimeError, match="infra.services up"):
        services.services_env(tmp_path)
