"""The local Prefect server's profile entries and bind rules (no server is started here)."""

import pytest

from infra import prefect_server


def test_the_profile_holds_the_auth_string_with_the_url_and_loses_both_together(tmp_path):
    import toml

    path = tmp_path / "profiles.toml"
    prefect_server.save_api_url("http://10.0.0.1:4200/api", path, "agentrl:secret")
    profile = toml.loads(path.read_text())["profiles"]["agentrl"]
    assert profile == {"PREFECT_API_URL": "http://10.0.0.1:4200/api", "PREFECT_API_AUTH_STRING": "agentrl:secret"}
    prefect_server.save_api_url("http://127.0.0.1:4200/api", path)  # a loopback server again: no stale auth
    assert toml.loads(path.read_text())["profiles"]["agentrl"] == {"PREFECT_API_URL": "http://127.0.0.1:4200/api"}
    prefect_server.save_api_url("http://10.0.0.1:4200/api", path, "agentrl:secret")
    prefect_server.save_api_url(None, path)
    assert toml.loads(path.read_text())["profiles"]["agentrl"] == {}


def test_a_server_beyond_loopback_needs_an_address_clients_reach_and_auth_only_there(tmp_path):
    with pytest.raises(ValueError, match="binds every address"):
        prefect_server.start(tmp_path, host="0.0.0.0")
    with pytest.raises(ValueError, match="beyond loopback"):
        prefect_server.start(tmp_path, host="127.0.0.1", auth="a:b")
    assert prefect_server.auth_string(tmp_path) is None
    assert not list(tmp_path.iterdir())  # refused before anything was written or started


def test_the_auth_string_is_kept_for_its_owner_only(tmp_path):
    import stat

    path = tmp_path / "secret"
    path.write_text("old")
    path.chmod(0o644)
    prefect_server._write_secret(path, "agentrl:x")
    assert path.read_text() == "agentrl:x" and stat.S_IMODE(path.stat().st_mode) == 0o600
    profiles = tmp_path / "profiles.toml"
    prefect_server.save_api_url("http://10.0.0.1:4200/api", profiles, "agentrl:x")
    assert stat.S_IMODE(profiles.stat().st_mode) == 0o600
