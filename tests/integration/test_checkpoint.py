"""Checkpoint publication on a real SeaweedFS: manifest last, versions never reused, checksums verified."""

from __future__ import annotations

import json
import uuid

import pytest

from infra.checkpoint import (
    CheckpointError,
    fetch,
    publish,
    published_versions,
    read_manifest,
)
from infra.layout import RunLayout


@pytest.fixture
def export_dir(tmp_path):
    d = tmp_path / "export"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\x00" * 1000)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return d


@pytest.mark.integration
def test_publish_fetch_roundtrip(s3, export_dir, tmp_path):
    run = f"ckpt-{uuid.uuid4().hex[:8]}"
    uri = RunLayout("agentrl", "test", run).checkpoint(1)
    m = publish(s3, export_dir, uri, version=1, parent_version=0, step=0, dtype="float32")
    assert m["files"]["model.safetensors"]["size"] == 1000
    # sha256 of 1000 zero bytes
    zeros_sha256 = "541b3e9daa09b20bf85fa273e5cbd3e80185aa4ec298e765db87742b70138a53"
    assert m["files"]["model.safetensors"]["sha256"] == zeros_sha256
    assert read_manifest(s3, uri)["parent_version"] == 0
    got = fetch(s3, uri, tmp_path / "fetched")
    assert got["version"] == 1 and (tmp_path / "fetched" / "model.safetensors").read_bytes() == b"\x00" * 1000
    assert published_versions(s3, RunLayout("agentrl", "test", run)) == [1]
    with pytest.raises(CheckpointError, match="already published"):
        publish(s3, export_dir, uri, version=1, parent_version=0, step=0, dtype="float32")


@pytest.mark.integration
def test_half_published_is_not_trusted_and_corruption_detected(s3, export_dir, tmp_path):
    run = f"ckpt-{uuid.uuid4().hex[:8]}"
    uri = RunLayout("agentrl", "test", run).checkpoint(2)
    s3.put_file(str(export_dir / "model.safetensors"), f"{uri}/model.safetensors")  # files, no manifest yet
    assert published_versions(s3, RunLayout("agentrl", "test", run)) == []
    with pytest.raises(CheckpointError, match="no manifest"):
        fetch(s3, uri, tmp_path / "x")
    uri3 = RunLayout("agentrl", "test", run).checkpoint(3)
    publish(s3, export_dir, uri3, version=3, parent_version=2, step=2, dtype="float32")
    s3.pipe_file(f"{uri3}/model.safetensors", b"\x01" * 1000)  # tampered after publication
    with pytest.raises(CheckpointError, match="does not match the manifest"):
        fetch(s3, uri3, tmp_path / "y")
