"""Shared fixtures: real services (dockerd, SeaweedFS) from `make up`, a tiny model, a Prefect harness."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@contextlib.contextmanager
def _engine_lock(exclusive: bool):
    """Under pytest-xdist, a readers-writer lock on the shared dockerd across the run's workers (flock).

    Every test holds it shared; an ``engine_exclusive`` test (one that restarts dockerd) holds it alone.
    The turnstile gives the exclusive one preference: while it waits, no shared holder enters. Without
    xdist it does nothing.
    """
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    base = Path(tempfile.gettempdir()) / f"agentrl-tests-{run}"
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.engine", "a") as engine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(engine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(engine, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


# Test files by their time in a fresh-clone CI run (2026-12-03), longest first. make test hands whole
# files to its xdist workers in collection order (--no-loadscope-reorder): longest first, so no worker
# idles at the end while the other runs a long file. Files not named keep their order, after these.
_LONGEST_FIRST = ("test_post_train", "test_real_tasks", "test_tamper", "test_third_party_harnesses", "test_resume",
                  "test_post_train_servers", "test_netns_engine", "test_netns_trainer", "test_netns_ray",
                  "test_base_images", "test_servers", "test_ray", "test_sandbox",
                  "test_isolation", "test_compose", "test_deployments", "test_prefect_backend", "test_shell")


def pytest_collection_modifyitems(session, config, items):
    """Order the integration files longest first (``_LONGEST_FIRST``); tests inside a file keep their order."""
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)) if "integration" in item.path.parts
               else len(rank) + 1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test, its fixtures' set-up and tear-down included, under the shared-dockerd lock."""
    with _engine_lock(exclusive=item.get_closest_marker("engine_exclusive") is not None):
        yield


@pytest.fixture(scope="session")
def services_env() -> dict[str, str]:
    """Endpoints of the running services (brought up by `make test`, or here if not yet)."""
    from infra import services

    try:
        env = services.services_env()
    except RuntimeError:
        env = services.up()
    os.environ.update(env)
    return env


@pytest.fixture(scope="session")
def s3(services_env):
    from infra.storage import s3_filesystem

    return s3_filesystem(services_env["AGENTRL_BUCKET"])


@pytest.fixture(scope="session")
def backend(services_env):
    from infra.sandbox.docker_backend import DockerBackend

    return DockerBackend()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from infra.model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
