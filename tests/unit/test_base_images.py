"""The upstream-name -> local base mapping, apt sources and CA selection (no Docker)."""

from __future__ import annotations

import pytest

from infra.base_images import (
    BOOKWORM,
    BOOKWORM_PY,
    JAMMY,
    JAMMY_PY,
    MAPPING,
    NOBLE,
    NOBLE_PY,
    TRIXIE,
    TRIXIE_PY,
    apt_sources,
    extra_certificates,
    local_base_for,
    pem_certificates,
)


@pytest.mark.parametrize(
    ("image", "base"),
    [
        ("ghcr.io/laude-institute/t-bench/python-3-13:20250620", TRIXIE_PY),
        ("ghcr.io/laude-institute/t-bench/python-3-13:latest", TRIXIE_PY),
        ("ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624", NOBLE),
        ("python:3.13-slim-bookworm", TRIXIE_PY),
        ("python:3.13", TRIXIE_PY),
        ("docker.io/library/python:3.13-slim", TRIXIE_PY),
        ("python:3.12-slim", NOBLE_PY),
        ("python:3.11-slim", BOOKWORM_PY),
        ("python:3.11.9-slim-bookworm", BOOKWORM_PY),
        ("python:3.10-slim-bookworm", JAMMY_PY),
        ("python:3.9", JAMMY_PY),
        ("python:3.8-slim-bookworm", JAMMY_PY),
        ("python:3.14-slim", TRIXIE_PY),
        ("python:3", TRIXIE_PY),
        ("python:3-slim", TRIXIE_PY),
        ("python", TRIXIE_PY),
        ("ubuntu:24.04", NOBLE),
        ("ubuntu:noble-20240801", NOBLE),
        ("ubuntu", NOBLE),
        ("ubuntu:22.04", JAMMY),
        ("ubuntu:jammy", JAMMY),
        ("debian:bookworm-slim", BOOKWORM),
        ("debian:12", BOOKWORM),
        ("debian:trixie", TRIXIE),
        ("debian:13-slim", TRIXIE),
        ("library/debian:stable-slim", TRIXIE),
    ],
)
def test_mapping(image, base):
    got = local_base_for(image)
    assert got is not None and got[0] == base
    assert got[1].startswith(f"{image} -> {base.tag}") and "\n" not in got[1]


@pytest.mark.parametrize(
    "image",
    ["ubuntu:20.04", "debian:bullseye", "alpine:3.20", "node:20", "nvidia/cuda:12.4.0-base-ubuntu22.04",
     "ghcr.io/laude-institute/t-bench/other:1", "pythonista:3.13", "python-3-13:20250620"],
)
def test_unknown_names_have_no_equivalent(image):
    assert local_base_for(image) is None


def test_notes_say_what_differs():
    assert local_base_for("python:3.13-slim-bookworm")[1] == (
        "python:3.13-slim-bookworm -> agentrl-python:3.13-trixie-2 "
        "(distro python3.13 instead of python.org's build; trixie instead of bookworm)"
    )
    assert local_base_for("python:3.10-slim-bookworm")[1] == (
        "python:3.10-slim-bookworm -> agentrl-python:3.10-jammy-3 (Python 3.10 is in no current Debian release; "
        "Ubuntu jammy's python3.10 used; jammy instead of bookworm)"
    )
    assert "upstream is python:3.13-slim-bookworm" in local_base_for("ghcr.io/laude-institute/t-bench/python-3-13:x")[1]
    assert "Ubuntu noble's python3.12" in local_base_for("python:3.12-slim-bookworm")[1]
    assert "nearest available is Ubuntu jammy's python3.10" in local_base_for("python:3.8")[1]
    assert "digest ignored" in local_base_for("python:3.11@sha256:" + "0" * 64)[1]
    assert local_base_for("ubuntu:24.04")[1] == "ubuntu:24.04 -> agentrl-ubuntu:24.04-noble-2"  # nothing differs


def test_table_is_consistent():
    bases = {b for _, b, _ in MAPPING}
    assert {b.tag for b in bases} == {b.tag for b in (TRIXIE_PY, BOOKWORM_PY, NOBLE_PY, JAMMY_PY, TRIXIE,
                                                       BOOKWORM, NOBLE, JAMMY)}
    for b in bases:
        assert b.distro in ("debian", "ubuntu") and b.suite in ("bookworm", "trixie", "noble", "jammy")
        assert b.python_image == bool(b.python_version)
        assert b.suite in b.tag and (not b.python_image or b.python_version in b.tag)


def test_apt_sources_use_public_archives():
    text = apt_sources(TRIXIE_PY, "/usr/share/keyrings/debian-archive-keyring.pgp")
    assert "URIs: http://deb.debian.org/debian\nSuites: trixie trixie-updates\nComponents: main\n" in text
    assert "URIs: http://deb.debian.org/debian-security\nSuites: trixie-security\n" in text
    text = apt_sources(NOBLE, "/usr/share/keyrings/ubuntu-archive-keyring.gpg")
    assert "URIs: http://archive.ubuntu.com/ubuntu\nSuites: noble noble-updates noble-backports\n" in text
    assert "URIs: http://security.ubuntu.com/ubuntu\nSuites: noble-security\n" in text
    assert text.count("Components: main restricted universe multiverse") == 2


def _pem(body: str) -> str:
    return f"-----BEGIN CERTIFICATE-----\n{body[:4]}\n{body[4:]}\n-----END CERTIFICATE-----\n"


def test_extra_certificates_skip_trusted_and_duplicates():
    trusted = _pem("AAAAaaaa") + _pem("BBBBbbbb")
    bundle = "# comment\n" + _pem("BBBBbbbb") + _pem("CCCCcccc") + _pem("CCCCcccc") + _pem("DDDDdddd")
    assert pem_certificates(bundle) == ["BBBBbbbb", "CCCCcccc", "CCCCcccc", "DDDDdddd"]
    extra = extra_certificates(bundle, trusted)
    assert [pem_certificates(p) for p in extra] == [["CCCCcccc"], ["DDDDdddd"]]
    assert extra[0] == "-----BEGIN CERTIFICATE-----\nCCCCcccc\n-----END CERTIFICATE-----\n"
