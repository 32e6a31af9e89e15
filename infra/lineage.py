"""Lineage that follows the policy: the records stored beside artifacts, the base model asset, and how to read them.

The chain (DESIGN.md): base model → checkpoint v1 → v2 …, each checkpoint made from its parent and the
trajectories it trained on; a step's trajectories made from their task images and every policy version that
sampled any of their tokens; an eval report made from its checkpoint and the held-out task images, in a dtype.

A record (``{artifact}.lineage.json``, :func:`record`) holds the artifact's key, its declared ``inputs``, and
``properties``: what the materialization reported of it (the Prefect event's payload, the same dict), e.g.
``policy_version_tokens`` (input key -> sampled tokens that policy produced) on trajectories, ``dtype`` on
an eval report, ``parent`` on a checkpoint. :class:`StoredLineage` reads them from S3, across runs: an input
in another run's folder (a run started from that run's checkpoint) loads that run's records too.

Keys: ``s3://…`` artifacts, ``docker://<image>`` task images and ``model://<name>@sha256:<hex>`` for a base
model folder (:func:`model_asset`: the folder's name and a digest of its weight files, so the same weights
have the same key on any machine). No Prefect here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

RUN_FOLDERS = ("trajectories", "checkpoints", "dropped", "divergence", "summaries", "episodes")
"""The folders of a run (``infra.layout.RunLayout``); an artifact below one of them belongs to that run."""
BASE_MODEL_RECORD = "base-model.lineage.json"
"""The record of the run's base model, in the run folder (the model is no ``s3://`` artifact of its own)."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_KEY_FORBIDDEN = set(" #?&%\"'<>[]{}|\\^`\n\r\t\0")  # Prefect's restricted asset-key characters


@dataclass(frozen=True)
class ModelAsset:
    """A base model as an asset: ``key`` and what to show of it (``properties``: folder, digest, files)."""

    key: str
    properties: dict = field(default_factory=dict)


@functools.lru_cache(maxsize=8)
def _weights_digest(folder: str, stamp: tuple) -> tuple[str, dict]:
    from infra.checkpoint import sha256_file

    files = {name: sha256_file(Path(folder) / name) for name, _, _ in stamp}
    combined = hashlib.sha256("".join(f"{n} {h}\n" for n, h in sorted(files.items())).encode()).hexdigest()
    return combined, files


def model_asset(folder: Path, name: str = "") -> ModelAsset:
    """The asset of the HF model folder ``folder``: ``model://<name>@sha256:<digest of its weight files>``.

    The digest is sha256 over the lines ``"<file name> <sha256 of the file>"`` of every weight file
    (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.gguf``), sorted by name; computed once per process and
    folder state (size, mtime). ``name`` defaults to the folder's name.

    Raises:
        FileNotFoundError: ``folder`` holds no weight file.
    """
    folder = Path(folder).resolve()
    weights = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not weights:
        raise FileNotFoundError(f"model.path: {folder} has no weight file ({', '.join(_WEIGHT_SUFFIXES)})")
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights)
    digest, files = _weights_digest(str(folder), stamp)
    label = "".join("-" if c in _KEY_FORBIDDEN else c for c in (name or folder.name))
    return ModelAsset(f"model://{label}@sha256:{digest}",
                      {"kind": "base_model", "folder": str(folder), "weights_sha256": digest,
                       "files": {n: {"sha256": h, "size": s} for (n, s, _), h in zip(stamp, files.values(),
                                                                                     strict=True)}})


def record(key: str, inputs: list[str], properties: dict, flow_run_id: str = "", task_run_id: str = "") -> dict:
    """The lineage record stored beside ``key``."""
    return {"asset": key, "inputs": sorted(set(inputs)), "properties": properties,
            "flow_run_id": flow_run_id, "task_run_id": task_run_id, "written_at": time.time()}


def run_root(uri: str) -> str:
    """The run folder holding an ``s3://`` artifact (``s3://bucket/prefix/run_id``).

    Raises:
        ValueError: ``uri`` is not an artifact inside a run folder.
    """
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri}: not an s3:// artifact URI (expected s3://bucket/prefix/run_id/"
                         f"{{{','.join(RUN_FOLDERS)}}}/..., or a model://… key with --runs)")
    parts = uri.rstrip("/").split("/")
    for i, part in enumerate(parts):
        if part in RUN_FOLDERS and i > 3:
            return "/".join(parts[:i])
    raise ValueError(f"{uri}: not an artifact of a run (expected s3://bucket/prefix/run_id/"
                     f"{{{','.join(RUN_FOLDERS)}}}/...)")


def version_label(key: str, home: str = "") -> str:
    """How a policy's key is named in a note: ``v3``, ``<run_id> v3``, ``base model``, else the key itself.

    A checkpoint of the run folder ``home`` is ``v3``; another run's (or any, without ``home``) ``<run_id> v3``.
    """
    tail = key.rstrip("/").rsplit("/", 1)[-1]
    if "/checkpoints/" in key and tail[1:].isdigit():
        root = run_root(key)
        return tail if root == home else f"{root.rsplit('/', 1)[-1]} {tail}"
    return "base model" if key.startswith("model://") else key


def edge_note(properties: dict, input_key: str) -> str:
    """What a record's ``properties`` say of its input ``input_key`` ("" if nothing)."""
    tokens = properties.get("policy_version_tokens", {})
    notes = []
    if input_key in tokens:
        notes.append(f"policy that sampled {tokens[input_key]} tokens")
    if properties.get("parent") == input_key:
        notes.append("parent weights")
    return "; ".join(notes)


def node_note(properties: dict, key: str = "") -> str:
    """What to show beside the artifact ``key`` of its own properties ("" if nothing).

    Checkpoints of ``key``'s own run are named ``vN``, another run's ``<run_id> vN``.
    """
    if properties.get("kind") == "base_model":
        return f"base model, folder {properties.get('folder', '?')}"
    if "dtype" in properties and "precision_mismatch" in properties:  # an eval report, whatever its k
        mismatch = ", NOT the serving dtype" if properties["precision_mismatch"] else " (serving dtype)"
        return f"evaluated in {properties['dtype']}{mismatch}"
    tokens = properties.get("policy_version_tokens")
    if tokens:
        home = run_root(key) if key.startswith("s3://") else ""
        return "tokens by policy: " + ", ".join(f"{version_label(k, home)} {n}" for k, n in sorted(tokens.items()))
    return ""


class StoredLineage:
    """The lineage records on S3, read per run folder on first need (also other runs' folders).

    What used a checkpoint or a base model may be in another run (one started from it), so asking for their
    outputs reads every run folder beside theirs (a checkpoint's) or under ``runs`` (a ``model://`` key):
    one listing per run folder, once.
    """

    def __init__(self, fs, runs: str = "") -> None:
        """Read with the s3fs filesystem ``fs``.

        ``runs`` (``s3://bucket/prefix``) holds the runs in which a base model's users are looked for.
        """
        self.fs = fs
        self.runs = runs.rstrip("/")
        self._roots: dict[str, dict[str, dict]] = {}
        self._all_read: set[str] = set()

    def load(self, root: str) -> dict[str, dict]:
        """Every record under the run folder ``root``: artifact -> record (read once)."""
        if root not in self._roots:
            self.fs.invalidate_cache()
            found = {}
            for path in (p for p in self.fs.find(root.removeprefix("s3://")) if p.endswith(".lineage.json")):
                try:
                    rec = json.loads(self.fs.cat_file(path))
                except FileNotFoundError:  # removed between the listing and the read (a run being deleted)
                    continue
                found[rec["asset"]] = rec
            self._roots[root] = found
        return self._roots[root]

    def load_runs(self, runs: str) -> None:
        """Load every run folder under ``runs`` (``s3://bucket/prefix``), once."""
        runs = runs.rstrip("/")
        if runs in self._all_read:
            return
        self.fs.invalidate_cache()
        for entry in self.fs.ls(runs.removeprefix("s3://"), detail=True):
            if entry["type"] == "directory":
                self.load("s3://" + entry["name"].strip("/"))
        self._all_read.add(runs)

    def record_of(self, key: str) -> dict | None:
        """The record of ``key`` (an artifact of any run already loaded, or of its own run folder)."""
        if key.startswith("s3://"):
            try:
                self.load(run_root(key))
            except ValueError:
                pass
        for records in self._roots.values():
            if key in records:
                return records[key]
        return None

    def inputs(self, key: str) -> list[str]:
        """The declared inputs of ``key``."""
        rec = self.record_of(key)
        return list(rec["inputs"]) if rec else []

    def outputs(self, key: str) -> list[str]:
        """Artifacts that declared ``key`` as an input (for weights: in any run beside them)."""
        self.record_of(key)
        if key.startswith("model://") and self.runs:
            self.load_runs(self.runs)
        elif "/checkpoints/" in key and key.startswith("s3://"):
            self.load_runs(run_root(key).rsplit("/", 1)[0])
        return sorted({a for records in self._roots.values() for a, r in records.items() if key in r["inputs"]})

    def properties(self, key: str) -> dict:
        """The properties recorded of ``key`` ({} when none)."""
        rec = self.record_of(key)
        return dict(rec.get("properties", {})) if rec else {}


def tree(uri: str, inputs_of: Callable[[str], list[str]], outputs_of: Callable[[str], list[str]],
         properties_of: Callable[[str], dict] = lambda _: {}, max_depth: int | None = None) -> list[str]:
    """Lines of the lineage tree of ``uri``: its inputs, recursively, above it; its outputs below it.

    Each edge carries what the records say of it (:func:`edge_note`), each node what it says of itself
    (:func:`node_note`). A node reached twice is expanded once (``(see above)`` after), so a long chain
    prints in lines linear in its artifacts; ``max_depth`` bounds the levels shown on each side, and a node
    at the bound whose own inputs (outputs) are not shown says how many there are.
    """
    def note(text: str) -> str:
        return f"  · {text}" if text else ""

    def children(node: str, upward: bool) -> list[str]:
        return sorted(set(inputs_of(node) if upward else outputs_of(node)))

    def branch(node: str, upward: bool, prefix: str, depth: int, expanded: set) -> list[str]:
        kids = children(node, upward)
        lines = []
        for i, kid in enumerate(kids):
            last = i == len(kids) - 1
            edge = edge_note(properties_of(node), kid) if upward else edge_note(properties_of(kid), node)
            notes = "; ".join(x for x in (edge, node_note(properties_of(kid), kid)) if x)
            text = f"{prefix}{'└── ' if last else '├── '}{kid}{note(notes)}"
            if kid in expanded:
                lines.append(f"{text} (see above)")
            elif max_depth is not None and depth + 1 >= max_depth:  # the bound: not expanded, not marked seen
                hidden = len(children(kid, upward))
                lines.append(f"{text} (+{hidden} more: --depth)" if hidden else text)
            else:
                expanded.add(kid)
                lines.append(text)
                lines += branch(kid, upward, prefix + ("    " if last else "│   "), depth + 1, expanded)
        return lines

    above = branch(uri, True, "  ", 0, {uri})
    below = branch(uri, False, "  ", 0, {uri})
    return ["made from (inputs):", *(above or ["  (none recorded)"]), uri + note(node_note(properties_of(uri), uri)),
            "used by (outputs):", *(below or ["  (none recorded)"])]
