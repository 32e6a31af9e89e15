"""The lineage chain's pure parts (``infra.lineage``): the base model's key, notes, the tree, records across runs."""

from __future__ import annotations

import hashlib
import json

import fsspec
import pytest

from infra import lineage

RUN = "s3://agentrl/runs/r"


def test_model_asset_is_named_by_folder_and_digest_of_its_weight_files(tmp_path):
    folder = tmp_path / "tiny model#1"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "config.json").write_text("{}")  # not a weight file: not in the digest
    file_sha = hashlib.sha256(b"weights").hexdigest()
    digest = hashlib.sha256(f"model.safetensors {file_sha}\n".encode()).hexdigest()
    model = lineage.model_asset(folder)
    assert model.key == f"model://tiny-model-1@sha256:{digest}"  # ' ' and '#' are not allowed in asset keys
    assert model.properties["files"] == {"model.safetensors": {"sha256": file_sha, "size": 7}}
    (folder / "model.safetensors").write_bytes(b"other weights")  # new content, new key
    assert lineage.model_asset(folder, name="tiny").key.startswith("model://tiny@sha256:")
    assert lineage.model_asset(folder).key != model.key
    with pytest.raises(FileNotFoundError, match="no weight file"):
        lineage.model_asset(tmp_path)


def test_notes_name_the_policy_tokens_parent_and_dtype():
    base, v1 = "model://m@sha256:ab", f"{RUN}/checkpoints/v1"
    traj = {"policy_version_tokens": {base: 12, v1: 3}}
    assert lineage.edge_note(traj, v1) == "policy that sampled 3 tokens"
    assert lineage.edge_note({"parent": base}, base) == "parent weights"
    assert lineage.edge_note(traj, "docker://img") == ""
    assert lineage.node_note(traj, f"{RUN}/trajectories/step-000001.parquet") == "tokens by policy: base model 12, v1 3"
    # a run started from another run's checkpoint: that checkpoint is named with its run
    other = {"policy_version_tokens": {"s3://agentrl/runs/first/checkpoints/v2": 4}}
    assert lineage.node_note(other, f"{RUN}/trajectories/step-000000.parquet") == "tokens by policy: first v2 4"
    # an eval report with only pass@4 still says its dtype
    assert lineage.node_note({"dtype": "float32", "pass_at_4": 0.5, "precision_mismatch": True}) == \
        "evaluated in float32, NOT the serving dtype"
    assert lineage.node_note({"dtype": "bfloat16", "pass_at_1": 0.5, "precision_mismatch": False}) == \
        "evaluated in bfloat16 (serving dtype)"


def _chain() -> dict[str, dict]:
    """A 2-step run's records: v2 <- (v1, t1), t1 <- (img, v1), v1 <- (base, t0), t0 <- (img, base)."""
    base, img = "model://m@sha256:ab", "docker://img"
    t0, t1 = f"{RUN}/trajectories/step-000000.parquet", f"{RUN}/trajectories/step-000001.parquet"
    v1, v2 = f"{RUN}/checkpoints/v1", f"{RUN}/checkpoints/v2"
    return {t0: {"inputs": [img, base], "properties": {"policy_version_tokens": {base: 5}}},
            v1: {"inputs": [base, t0], "properties": {"parent": base}},
            t1: {"inputs": [img, v1], "properties": {"policy_version_tokens": {v1: 7}}},
            v2: {"inputs": [t1, v1], "properties": {"parent": v1}}}


def _tree(uri: str, records: dict, depth: int | None = None) -> list[str]:
    def outputs(n):
        return [a for a, r in records.items() if n in r["inputs"]]
    return lineage.tree(uri, lambda n: records.get(n, {}).get("inputs", []), outputs,
                        lambda n: records.get(n, {}).get("properties", {}), depth)


def test_tree_walks_the_chain_to_the_base_model_and_expands_each_node_once():
    records = _chain()
    out = _tree(f"{RUN}/checkpoints/v2", records)
    assert out == [  # inputs in key order; a node met again is not expanded again
        "made from (inputs):",
        f"  ├── {RUN}/checkpoints/v1  · parent weights",
        "  │   ├── model://m@sha256:ab  · parent weights",
        f"  │   └── {RUN}/trajectories/step-000000.parquet  · tokens by policy: base model 5",
        "  │       ├── docker://img",
        "  │       └── model://m@sha256:ab  · policy that sampled 5 tokens (see above)",
        f"  └── {RUN}/trajectories/step-000001.parquet  · tokens by policy: v1 7",
        "      ├── docker://img (see above)",
        f"      └── {RUN}/checkpoints/v1  · policy that sampled 7 tokens (see above)",
        f"{RUN}/checkpoints/v2",
        "used by (outputs):", "  (none recorded)"]
    assert _tree(f"{RUN}/checkpoints/v2", records, depth=1)[1:3] == [  # each has 2 inputs not shown
        f"  ├── {RUN}/checkpoints/v1  · parent weights (+2 more: --depth)",
        f"  └── {RUN}/trajectories/step-000001.parquet  · tokens by policy: v1 7 (+2 more: --depth)"]
    below = _tree("model://m@sha256:ab", records)
    assert below[below.index("used by (outputs):") + 1:][:2] == [
        f"  ├── {RUN}/checkpoints/v1  · parent weights",
        f"  │   ├── {RUN}/checkpoints/v2  · parent weights"]


def test_stored_lineage_follows_an_input_into_another_runs_folder():
    fs = fsspec.filesystem("memory")
    other_v3 = "s3://agentrl/runs/base-run/checkpoints/v3"
    t0, v1 = f"{RUN}/trajectories/step-000000.parquet", f"{RUN}/checkpoints/v1"
    for key, inputs in ((t0, [other_v3]), (v1, [other_v3, t0]), (other_v3, ["s3://agentrl/runs/base-run/x"])):
        fs.pipe_file(f"{key.removeprefix('s3://')}.lineage.json",
                     json.dumps(lineage.record(key, inputs, {"parent": other_v3} if key == v1 else {})).encode())
    stored = lineage.StoredLineage(fs)
    assert stored.inputs(v1) == [other_v3, t0]
    assert stored.inputs(other_v3) == ["s3://agentrl/runs/base-run/x"]  # read from the other run's folder
    assert stored.outputs(other_v3) == [v1, t0]
    assert stored.properties(v1) == {"parent": other_v3} and stored.properties("docker://img") == {}
    with pytest.raises(ValueError, match="not an artifact of a run"):
        lineage.run_root("s3://agentrl/elsewhere.json")


def test_a_node_cut_at_the_depth_bound_is_expanded_where_it_appears_higher():
    # a <- (b, c), b <- d, d <- c, c <- e: at depth 3, c is met first at the bound (under b, d), then under a
    records = {"a": {"inputs": ["b", "c"]}, "b": {"inputs": ["d"]}, "d": {"inputs": ["c"]}, "c": {"inputs": ["e"]}}
    out = _tree("a", records, depth=3)
    assert out[:out.index("a")] == ["made from (inputs):", "  ├── b", "  │   └── d",
                                     "  │       └── c (+1 more: --depth)", "  └── c", "      └── e"]


def test_outputs_of_weights_are_found_in_the_runs_beside_them():
    fs = fsspec.filesystem("memory")
    base = "model://m@sha256:ab"
    first_v2 = "s3://agentrl/runs/first/checkpoints/v2"
    second_v1, second_t0 = "s3://agentrl/runs/second/checkpoints/v1", "s3://agentrl/runs/second/trajectories/step-000000.parquet"
    for key, inputs in ((first_v2, [base]), (second_v1, [first_v2, second_t0]), (second_t0, [first_v2])):
        fs.pipe_file(f"{key.removeprefix('s3://')}.lineage.json", json.dumps(lineage.record(key, inputs, {})).encode())
    # the second run's records are read although nothing of it was asked for: it was started from first's v2
    assert lineage.StoredLineage(fs).outputs(first_v2) == [second_v1, second_t0]
    assert lineage.StoredLineage(fs).outputs(base) == []  # a model key's users: only under runs=
    assert lineage.StoredLineage(fs, runs="s3://agentrl/runs").outputs(base) == [first_v2]
    with pytest.raises(ValueError, match="not an s3:// artifact URI"):
        lineage.run_root("/data/runs/r/checkpoints/v1")
