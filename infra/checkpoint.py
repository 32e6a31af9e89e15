"""Checkpoint publication to object storage, with a manifest written last.

Layout: ``s3://{bucket}/{prefix}/{run_id}/checkpoints/v{N}/`` holds HF safetensors files and
``manifest.json`` (sha256 and size per file, parent version and its asset key, training step, dtype). The manifest
is uploaded after every file, so a reader that trusts only a complete manifest never sees a
half-published checkpoint. A version is never reused: publishing over an existing manifest fails.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from infra.layout import RunLayout

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be published or trusted; names the URI and the file."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_entries(folder: Path) -> dict[str, dict]:
    """``{file name: {"sha256", "size"}}`` for every file of ``folder`` (the manifest's ``files``)."""
    return {p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}


def publish(fs, local_dir: Path, uri: str, version: int, parent_version: int, step: int, dtype: str,
            parent: str = "") -> dict:
    """Upload every file of ``local_dir`` to ``uri``, then the manifest; returns the manifest.

    ``parent`` is the asset key of the weights this version was trained from (``infra.lineage``: the
    previous checkpoint's URI, or the base model's ``model://`` key).

    Raises:
        CheckpointError: ``uri`` already has a manifest (versions are never reused), or
            ``local_dir`` has no safetensors file.
    """
    fs.invalidate_cache()
    if fs.exists(f"{uri}/{MANIFEST}"):
        raise CheckpointError(f"{uri}/{MANIFEST}: version {version} is already published; versions are never reused")
    entries = file_entries(local_dir)
    if not any(name.endswith(".safetensors") for name in entries):
        raise CheckpointError(f"{local_dir}: no .safetensors file to publish")
    start = time.monotonic()
    for name in entries:
        fs.put_file(str(local_dir / name), f"{uri}/{name}")
    manifest = {"version": version, "parent_version": parent_version, "parent": parent, "step": step, "dtype": dtype,
                "files": entries, "published_at": time.time(), "upload_s": time.monotonic() - start}
    fs.pipe_file(f"{uri}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    return manifest


def read_manifest(fs, uri: str) -> dict:
    """The manifest of a published checkpoint.

    Raises:
        CheckpointError: no manifest (unpublished or half-published) or it is not valid JSON.
    """
    fs.invalidate_cache()
    path = f"{uri}/{MANIFEST}"
    if not fs.exists(path):
        raise CheckpointError(f"{path}: no manifest; the checkpoint is not (completely) published")
    try:
        return json.loads(fs.cat_file(path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: manifest is not valid JSON: {e}") from e


def fetch(fs, uri: str, local_dir: Path) -> dict:
    """Download a published checkpoint and verify every file against its manifest.

    Returns:
        The manifest.

    Raises:
        CheckpointError: missing manifest, or a file whose size or sha256 differs.
    """
    manifest = read_manifest(fs, uri)
    local_dir.mkdir(parents=True, exist_ok=True)
    for name, meta in manifest["files"].items():
        dest = local_dir / name
        fs.get_file(f"{uri}/{name}", str(dest))
        if dest.stat().st_size != meta["size"] or sha256_file(dest) != meta["sha256"]:
            raise CheckpointError(f"{uri}/{name}: content does not match the manifest's size/sha256")
    return manifest


def presigned_urls(fs, uri: str, files: dict[str, dict], endpoint: str = "", expires_s: int = 3600) -> dict[str, str]:
    """S3 presigned GET URLs of a checkpoint's files, so a machine without S3 keys can fetch them.

    Args:
        fs: the run's s3fs filesystem (its keys sign).
        uri: the checkpoint folder (``bucket/.../checkpoints/vN``).
        files: the manifest's ``files`` (names are what is signed).
        endpoint: the S3 endpoint as the fetching machines reach it (empty: ``fs``'s own).
        expires_s: how long each URL stays valid, in s.

    Returns:
        ``{file name: URL}``. Each URL carries a signature: treat it as a credential until it expires.
    """
    signer = fs
    if endpoint:
        import s3fs

        signer = s3fs.S3FileSystem(key=fs.key, secret=fs.secret, client_kwargs={"endpoint_url": endpoint},
                                   skip_instance_cache=True)
    return {name: signer.sign(f"{uri}/{name}", expiration=expires_s) for name in files}


def published_versions(fs, layout: RunLayout) -> list[int]:
    """Versions of the run that have a complete manifest, ascending."""
    fs.invalidate_cache()
    root = layout.checkpoints_dir
    if not fs.exists(root):
        return []
    versions = []
    for path in fs.glob(f"{root}/v*/{MANIFEST}"):
        name = path.split("/")[-2]
        if name[1:].isdigit():
            versions.append(int(name[1:]))
    return sorted(versions)
