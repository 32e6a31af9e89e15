"""Registry base images on a real dockerd and a real registry (Debian's ``docker-registry``) on loopback.

A ``FROM`` image no local equivalent covers is pulled (by its own name, or from ``tasks.registry_mirrors``);
one no registry serves fails fast with cause ``registry_image``, unless the run names a fallback base.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from envs.harbor import load_harbor_task
from infra.environments import BASE_IMAGE, build_catalog
from infra.net import free_port

pytestmark = pytest.mark.integration

HARBOR = Path(__file__).parents[2] / "envs" / "harbor"


@pytest.fixture(scope="module")
def registry(services_env, tmp_path_factory):
    """A registry on ``127.0.0.1:PORT`` (the engine allows loopback registries without TLS); yields ``host:port``."""
    from infra.services import _apt_install, _which

    if _which("docker-registry") is None:
        _apt_install(["docker-registry"])
    binary = _which("docker-registry")
    assert binary, "apt-get installed docker-registry but no docker-registry binary was found"
    root = tmp_path_factory.mktemp("registry")
    port = free_port()
    config = root / "config.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root}/data\n"
                      f"http:\n  addr: 127.0.0.1:{port}\n")
    with open(root / "registry.log", "wb") as out:
        proc = subprocess.Popen([binary, "serve", str(config)], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert proc.poll() is None, (root / "registry.log").read_text()
            assert time.monotonic() < deadline, f"registry not ready in 30 s: {(root / 'registry.log').read_text()}"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _task(tmp_path: Path, name: str, base: str):
    """A copy of Harbor's write-greeting whose Dockerfile starts ``FROM base``."""
    folder = tmp_path / name
    shutil.copytree(HARBOR / "write-greeting", folder)
    (folder / "environment" / "Dockerfile").write_text(f"FROM {base}\nWORKDIR /app\n")
    return load_harbor_task(folder)


def _remove(client, *images: str) -> None:
    import docker

    for image in images:
        try:
            client.images.remove(image, force=True)
        except docker.errors.ImageNotFound:
            pass


def test_a_registry_image_is_pulled_by_its_name_or_from_a_mirror(backend, registry, tmp_path):
    client = backend.client
    own = f"{registry}/agentrl-test/base:1"
    hub = f"agentrl-test-{time.time_ns()}/base:1"  # a Docker Hub name, served here only by the mirror
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nRUN echo pushed > /registry-marker\n")
    image, _ = client.images.build(path=str(tmp_path / "img"), tag=own, rm=True, forcerm=True, network_mode="none")
    image.tag(f"{registry}/{hub.split(':')[0]}", "1")
    built: list[str] = []
    try:
        for name in (own, f"{registry}/{hub}"):
            repository, tag = name.rsplit(":", 1)
            for event in client.api.push(repository, tag=tag, stream=True, decode=True):
                assert "error" not in event, event
        _remove(client, own, f"{registry}/{hub}")  # only the registry has it now
        assert not client.images.list(name=own)

        tasks = {t.task_id: t for t in (_task(tmp_path, "own", own), _task(tmp_path, "hub", hub))}
        entries, logs = build_catalog(backend, tasks, dict.fromkeys(tasks, "train"), validate=False,
                                      registry_mirrors={"docker.io": registry})
        built = [e.image for e in entries if e.image]
        by_id = {e.task_id: e for e in entries}
        for task_id, entry in by_id.items():
            assert entry.usable and entry.built, (entry, logs[task_id])
        assert f"base image {own} pulled from {own}" in logs["harbor/own"]
        assert f"base image {hub} pulled from {registry}/{hub}" in logs["harbor/hub"]  # tagged with its own name
        box = backend.start(by_id["harbor/hub"].image, {"agentrl.test": "registry"})
        try:
            assert box.exec("cat /registry-marker", 10).output.strip() == "pushed"
        finally:
            box.close()
    finally:
        _remove(client, *built, own, f"{registry}/{hub}", hub)


def test_an_image_no_registry_serves_fails_fast_naming_it(backend, tmp_path):
    closed = f"127.0.0.1:{free_port()}/nope:1"  # nothing listens there
    hub = "swebench/sweb.eval.x86_64.example:latest"  # Docker Hub: not reachable from here
    tasks = {t.task_id: t for t in (_task(tmp_path, "closed", closed), _task(tmp_path, "hub", hub))}
    t0 = time.monotonic()
    entries, logs = build_catalog(backend, tasks, dict.fromkeys(tasks, "train"), validate=False)
    took = time.monotonic() - t0
    assert took < 10, f"an unpullable image took {took:.1f} s to fail"
    for entry, image in zip(entries, (closed, hub), strict=True):
        assert not entry.usable and entry.cause == "registry_image", entry
        assert f"registry image {image} cannot be pulled (" in entry.reason
        assert f"supply {image}" in entry.fix and "docker load -i" in entry.fix and "tasks.base_images" in entry.fix

    # the fallback base stays available as an explicit choice, and the build log says why it was used
    entries, logs = build_catalog(backend, {"harbor/hub": tasks["harbor/hub"]}, {"harbor/hub": "train"},
                                  validate=False, fallback_base=BASE_IMAGE)
    try:
        assert entries[0].usable, entries[0]
        assert (f"base image {hub} -> {BASE_IMAGE} (tasks.fallback_base_image: registry image {hub} cannot be "
                "pulled (") in logs["harbor/hub"]
    finally:
        _remove(backend.client, entries[0].image)


def test_a_pull_that_makes_no_progress_is_abandoned(backend):
    """A registry that accepts connections and never answers: the pull gives up after ``stall_s``."""
    from infra.sandbox.registry import RegistryPullError, pull

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        image = f"127.0.0.1:{silent.getsockname()[1]}/silent:1"
        t0 = time.monotonic()
        with pytest.raises(RegistryPullError, match=r"cannot be pulled \(.*no progress for 2 s"):
            pull(backend.client, image, stall_s=2)
        assert time.monotonic() - t0 < 6
