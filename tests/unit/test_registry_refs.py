"""Registry image references and mirrors (``infra.sandbox.registry``), and ``FROM`` rewriting without a fallback."""

from __future__ import annotations

import pytest

from infra.sandbox.docker_backend import map_base_images
from infra.sandbox.registry import Reference, RegistryPullError, mirror_references, parse_reference


@pytest.mark.parametrize(("image", "want"), [
    ("python:3.12", Reference("docker.io", "library/python", "3.12")),  # Hub's official images: library/
    ("ubuntu", Reference("docker.io", "library/ubuntu", "latest")),  # no tag: latest
    ("swebench/sweb.eval.x86_64.example:latest", Reference("docker.io", "swebench/sweb.eval.x86_64.example", "latest")),
    ("docker.io/library/python:3.12", Reference("docker.io", "library/python", "3.12")),
    ("ghcr.io/laude-institute/t-bench/python-3-13:20250620",
     Reference("ghcr.io", "laude-institute/t-bench/python-3-13", "20250620")),
    ("127.0.0.1:5000/agentrl-test/base:1", Reference("127.0.0.1:5000", "agentrl-test/base", "1")),
    ("localhost/a", Reference("localhost", "a", "latest")),
    ("python@sha256:abc", Reference("docker.io", "library/python", "latest", "sha256:abc")),
])
def test_parse_reference_reads_names_as_the_engine_does(image, want):
    assert parse_reference(image) == want


@pytest.mark.parametrize("image", ["${BASE_IMAGE}", "", "Upper/Case:1", "python@abc"])
def test_parse_reference_refuses_what_is_no_reference(image):
    with pytest.raises(ValueError, match="is not an image reference"):
        parse_reference(image)


def test_mirrors_take_the_repository_path_and_are_tried_in_order():
    mirrors = {"docker.io": "localhost:5000", "*": "mirror.example/cache/"}
    assert mirror_references("python:3.12", mirrors) == ["localhost:5000/library/python:3.12",
                                                         "mirror.example/cache/library/python:3.12"]
    assert mirror_references("ghcr.io/a/b:1", mirrors) == ["mirror.example/cache/a/b:1"]
    assert mirror_references("ghcr.io/a/b:1", {}) == []
    assert mirror_references("localhost:5000/x:1", {"*": "localhost:5000"}) == []  # the image's own registry
    assert mirror_references("python@sha256:abc", mirrors) == []  # a copy cannot be tagged with a digest


def test_pull_error_says_which_image_and_why():
    e = RegistryPullError("nope:1", "connection refused")
    assert str(e) == "registry image nope:1 cannot be pulled (connection refused)" and e.image == "nope:1"


def test_without_a_fallback_an_unmapped_registry_image_is_left_as_written():
    """No silent fallback: what is neither local nor mapped stays, so the build names it (cause registry_image)."""
    dockerfile = "FROM swebench/sweb.eval.x86_64.example:latest\nFROM python:3.13-slim\nFROM local/have:1\n"
    text, mapped = map_base_images(dockerfile, {"python:*": "py-local"}, local={"local/have:1"})
    assert mapped == {"python:3.13-slim": "py-local"}
    assert text.splitlines() == ["FROM swebench/sweb.eval.x86_64.example:latest", "FROM py-local", "FROM local/have:1"]
