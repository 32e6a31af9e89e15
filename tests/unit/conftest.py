"""The unit tier runs without services: the service fixtures of tests/conftest.py fail here at once.

``tiny_model`` and ``tiny_tokenizer`` (a tiny random Llama built locally) stay available.
"""

from __future__ import annotations

import pytest


def _refuse(request: pytest.FixtureRequest) -> None:
    pytest.fail(f"{request.node.nodeid} requests the fixture {request.fixturename!r}: unit tests run without "
                "services; move this test to tests/integration", pytrace=False)


@pytest.fixture
def services_env(request):
    _refuse(request)


@pytest.fixture
def s3(request):
    _refuse(request)


@pytest.fixture
def backend(request):
    _refuse(request)


@pytest.fixture
def prefect_harness(request):
    _refuse(request)
