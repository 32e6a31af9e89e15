"""Local base images on a real dockerd: build trixie's python base, use it, cache it, load it back."""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from infra.base_images import NOBLE, TRIXIE_PY, ensure_local_base

pytestmark = pytest.mark.integration

CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
TEST_BASE = dataclasses.replace(TRIXIE_PY, tag="agentrl-test-python:3.13-trixie")
ALIAS = "agentrl-test-upstream/t-bench/python-3-13:20250620"


@pytest.fixture(scope="module")
def client(services_env):
    import docker

    c = docker.DockerClient(base_url=services_env["DOCKER_HOST"], timeout=900)
    yield c
    c.close()


def _remove(client, *tags: str) -> None:
    import docker

    for tag in tags:
        try:
            client.images.remove(tag, force=True)
        except docker.errors.ImageNotFound:
            pass


def _exec(container, cmd: str) -> tuple[int, str]:
    code, out = container.exec_run(["timeout", "-s", "KILL", "120", "sh", "-c", cmd])
    return code, out.decode(errors="replace")


@pytest.fixture(scope="module")
def built(client, tmp_path_factory):
    """The test's own copy of the trixie python base, built from scratch in a fresh state dir."""
    state = tmp_path_factory.mktemp("base-state")
    _remove(client, ALIAS, TEST_BASE.tag)
    t0 = time.monotonic()
    assert ensure_local_base(client, TEST_BASE, state, CA_BUNDLE, alias=ALIAS) == TEST_BASE.tag
    print(f"built {TEST_BASE.tag} in {time.monotonic() - t0:.1f} s")
    yield state
    _remove(client, ALIAS, TEST_BASE.tag)


def _check_container(client, image: str, checks: dict[str, tuple[str, str]]) -> None:
    """Run ``checks`` (name -> (command, expected output substring)) in one host-network container."""
    box = client.containers.run(image, ["sleep", "infinity"], detach=True, network_mode="host", init=True,
                                labels={"agentrl.test": "base-images"})
    try:
        for name, (cmd, expected) in checks.items():
            code, out = _exec(box, cmd)
            assert code == 0 and expected in out, f"{name}: `{cmd}` exit {code}:\n{out[-2000:]}"
    finally:
        box.remove(force=True)


def test_trixie_python_base_behaves_like_python_image(client, built):
    image = client.images.get(TEST_BASE.tag)
    assert image.attrs["Config"]["WorkingDir"] == "/app"
    assert client.images.get(ALIAS).id == image.id  # the upstream name resolves locally: no pull
    assert int(image.labels["agentrl.base.extra_cas"]) >= 1  # the proxy's CA at least
    assert image.attrs["Size"] < 250e6, image.attrs["Size"]  # minbase, no recommends: ~155 MB measured
    _check_container(client, TEST_BASE.tag, {
        "workdir": ("pwd", "/app"),
        "python": ("python --version", "Python 3.13"),
        "tools": ("command -v tmux asciinema curl ps pip pip3.13 && tmux -V && asciinema --version", "asciinema"),
        "env": ("env", "REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt"),
        "debconf": ("debconf-show debconf", "Noninteractive"),
        "pypi over https through the CA": (
            "pip download --no-deps -q -d /tmp/d six==1.16.0 && curl -sSf -o /dev/null https://pypi.org/simple/six/"
            " && ls /tmp/d", "six-1.16.0-py2.py3-none-any.whl"),
        # into the interpreter's own prefix, as python:3.x images
        "system-wide pip install": ("pip install -q --no-index /tmp/d/six-*.whl && python -c 'import six; print(six"
                                    ".__file__)'", "/usr/local/lib/python3.13/site-packages/six.py"),
        "venv": ("python -m venv /tmp/v && /tmp/v/bin/python -c 'import sys; print(sys.prefix)'", "/tmp/v"),
        "apt-get update on the public archive": (
            "apt-get update -qq && apt-cache policy tmux | grep -m1 http; ls /var/cache/apt/*.bin 2>/dev/null | wc -l",
            "http://deb.debian.org/debian trixie/main"),
    })


def test_second_call_is_a_noop_and_cache_loads_after_rmi(client, built, caplog):
    first = client.images.get(TEST_BASE.tag).id
    t0 = time.monotonic()
    ensure_local_base(client, TEST_BASE, built, CA_BUNDLE, alias=ALIAS)
    assert time.monotonic() - t0 < 3  # present: one inspect and a tag
    cache = built / "bases" / "agentrl-test-python_3.13-trixie.tar.gz"
    assert cache.exists() and cache.stat().st_size < 100e6  # ~59 MB measured
    _remove(client, ALIAS, TEST_BASE.tag)
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="infra.base_images"), ThreadPoolExecutor(2) as pool:
        # two callers at once (parallel task builds): the per-tag lock makes one load, the other find it
        tags = list(pool.map(lambda _: ensure_local_base(client, TEST_BASE, built, CA_BUNDLE, alias=ALIAS), range(2)))
    assert tags == [TEST_BASE.tag] * 2
    assert time.monotonic() - t0 < 60  # a docker load, not a debootstrap
    assert [r.getMessage().split()[0] for r in caplog.records] == ["loading"]
    assert client.images.get(TEST_BASE.tag).id == client.images.get(ALIAS).id == first  # load keeps the id


def test_noble_base(client, services_env):
    """Ubuntu 24.04 from the shared state's cache (built there once, ~1 min, when missing)."""
    from infra.services import state_path

    tag = ensure_local_base(client, NOBLE, state_path(), CA_BUNDLE)
    _check_container(client, tag, {
        "python3": ("python3 --version", "Python 3.12"),
        "tools": ("command -v tmux asciinema curl ps && tmux -V", "tmux 3.4"),
        "workdir": ("pwd", "/app"),
        "apt-get update": ("apt-get update -qq && apt-cache policy tmux | grep -m1 http",
                           "http://archive.ubuntu.com/ubuntu noble"),
        "https through the CA": ("curl -sSf -o /dev/null https://pypi.org/simple/six/ && echo ok", "ok"),
        # update-alternatives links man pages there (openjdk's post-install failed without them)
        "man sections": ("ls -d /usr/share/man/man1 /usr/share/man/man8 && ls -A /usr/share/man/man1 | wc -l",
                         "/usr/share/man/man1\n/usr/share/man/man8\n0"),
    })
