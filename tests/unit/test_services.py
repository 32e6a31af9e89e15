"""Local service bring-up: the helpers of `make up` / `make down`, without starting a service."""

from __future__ import annotations

import subprocess
import time
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


def _wait_argv(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until ``/proc/<pid>/cmdline`` holds the new program's argv.

    Popen returns once the vforked child has released the parent's memory inside execve, which
    the kernel does before it lays out the new argv: for a moment the cmdline reads empty (CI,
    on a loaded machine, saw ``_our_pid`` answer None for a live ``sleep 30``).
    """
    deadline = time.monotonic() + timeout_s
    while not services._cmdline(pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_our_pid_checks_cmdline(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        _wait_argv(proc.pid)
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


class _Image:
    def __init__(self, labels: dict[str, str]):
        self.labels = labels

    def save(self, named: bool = True):
        yield b"image-tar"


class _Images:
    """The engine's image store as ``_ensure_base_image`` uses it: one tag, loaded from a cache file."""

    def __init__(self, present: dict[str, str] | None, cache_labels: dict[str, str] | None = None):
        self.present = None if present is None else _Image(present)
        self.cache_labels = cache_labels
        self.loads = 0

    def list(self, name: str):
        return [self.present] if self.present is not None else []

    def load(self, f) -> None:
        self.loads += 1
        self.present = _Image(self.cache_labels or {})

    def get(self, tag: str) -> _Image:
        assert self.present is not None
        return self.present


class _Client:
    def __init__(self, images: _Images):
        self.images = images


def _current_ca() -> str:
    from infra.base_images import _ca_digest

    return _ca_digest(services._extra_ca_bundle())


CURRENT = {services.BASE_RECIPE_LABEL: services.BASE_RECIPE, services.CA_LABEL: _current_ca()}


@pytest.mark.parametrize(("present", "cache", "loads", "builds"), [
    (CURRENT, None, 0, 0),  # current image: nothing to do
    ({}, None, 0, 1),  # an image of before the label (no tmux): rebuilt, cache written
    ({**CURRENT, services.CA_LABEL: "other"}, None, 0, 1),  # built trusting other extra CAs: rebuilt
    (None, CURRENT, 1, 0),  # absent, current cache: loaded
    (None, {}, 1, 1),  # absent, cache of an older recipe: loaded, found old, rebuilt and the cache replaced
    (None, None, 0, 1),  # absent, no cache: built
])
def test_base_image_of_an_older_recipe_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, present,
                                                  cache, loads, builds) -> None:
    images = _Images(present, cache)
    if cache is not None:
        (tmp_path / "base.tar.gz").write_bytes(b"old")
    built: list[str] = []

    def build(client, state, tag):  # stands in for debootstrap + docker import (root, ~1-2 min)
        built.append(tag)
        images.present = _Image(dict(CURRENT))

    monkeypatch.setattr(services, "_build_base_image", build)
    services._ensure_base_image(_Client(images), tmp_path)
    assert (images.loads, len(built)) == (loads, builds)
    assert images.present is not None and images.present.labels == CURRENT
    if builds:
        assert (tmp_path / "base.tar.gz").read_bytes() != b"old"  # the new image saved over the cache
    assert "tmux" in services.DEBOOTSTRAP_PACKAGES  # the agent's persistent shell
    assert "ca-certificates" in services.DEBOOTSTRAP_PACKAGES  # https from a sandbox with the network
