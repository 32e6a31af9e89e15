"""Direct-transfer source and pull: bytes verified against the manifest, bad ones refused (real HTTP, loopback);
the publication is chosen by the type of the publish config."""

from __future__ import annotations

import pytest

from infra.checkpoint import CheckpointError, file_entries
from infra.publish import DirectSource, pull


@pytest.fixture()
def export(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (folder / "config.json").write_text('{"a": 1}')
    return folder


def test_pull_copies_and_verifies_every_file(export, tmp_path):
    files = file_entries(export)
    assert set(files) == {"model.safetensors", "config.json"} and files["config.json"]["size"] == 8
    with DirectSource(export) as source:
        dest = pull(source.url, files, tmp_path / "dest")
    assert file_entries(dest) == files


def test_corrupt_or_missing_file_is_refused_and_nothing_left(export, tmp_path):
    files = file_entries(export)
    with DirectSource(export) as source:
        bad = {**files, "model.safetensors": {**files["model.safetensors"], "sha256": "0" * 64}}
        with pytest.raises(CheckpointError, match="model.safetensors: content does not match"):
            pull(source.url, bad, tmp_path / "dest")
        assert not (tmp_path / "dest").exists()
        with pytest.raises(CheckpointError, match="missing.bin: could not be fetched"):
            pull(source.url, {**files, "missing.bin": {"sha256": "0" * 64, "size": 1}}, tmp_path / "dest")
        assert not (tmp_path / "dest").exists()


def test_pull_takes_one_url_per_file_and_never_names_a_signature(export, tmp_path):
    files = file_entries(export)
    with DirectSource(export) as source:
        urls = {name: f"{source.url}/{name}?Signature=s3cret" for name in files}  # presigned-style URLs
        assert file_entries(pull(urls, files, tmp_path / "dest")) == files
        with pytest.raises(CheckpointError, match="config.json: the manifest lists it and no URL") as missing:
            pull({"model.safetensors": urls["model.safetensors"]}, files, tmp_path / "dest")
        assert not (tmp_path / "dest").exists()
        with pytest.raises(CheckpointError, match="nope.bin: could not be fetched") as refused:
            pull({**urls, "nope.bin": f"{source.url}/nope.bin?Signature=s3cret"},
                 {**files, "nope.bin": {"sha256": "0" * 64, "size": 1}}, tmp_path / "dest")
        assert "s3cret" not in str(refused.value) + str(missing.value)


def _raw_get(url: str, path: str) -> bytes:
    """A GET sent byte for byte (an HTTP client would normalise ``..`` away before sending)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_source_serves_only_its_own_files(export, tmp_path):
    (tmp_path / "secret").write_text("x")
    with DirectSource(export) as source:
        for path in ("/../secret", "/%2e%2e/secret", "/", "/export/config.json"):
            assert _raw_get(source.url, path).startswith(b"HTTP/1.0 404"), path
        ok = _raw_get(source.url, "/config.json")
        assert ok.startswith(b"HTTP/1.0 200") and ok.endswith(b'{"a": 1}')


def test_publication_follows_the_config_type():
    from typing import get_args

    from infra.config import ColocatedPublish, DirectPublish, PublishConfig, StoragePublish
    from tasks.publish import publication_for
    from tasks.publish.colocated import ColocatedPublication
    from tasks.publish.direct import DirectPublication
    from tasks.publish.storage import StoragePublication

    expected = {StoragePublish: StoragePublication, DirectPublish: DirectPublication,
                ColocatedPublish: ColocatedPublication}
    assert set(expected) == set(get_args(get_args(PublishConfig)[0]))  # every kind of the union has one
    for config_type, publication in expected.items():
        assert type(publication_for(config_type())) is publication
    assert publication_for(DirectPublish(host="10.0.0.2")).config.host == "10.0.0.2"
