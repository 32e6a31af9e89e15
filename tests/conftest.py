"""Shared fixtures: real services (dockerd, SeaweedFS) from `make up`, a tiny model, a Prefect harness."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


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
