"""Trajectory store: row invariants, 64-bit list offsets and the row-group cap, files from before them (local files)."""

from __future__ import annotations

import random

import annotated_types
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import infra.store as store
from infra.config import ModelConfig, RolloutConfig
from infra.layout import RunLayout
from infra.store import TRAJECTORY_SCHEMA, SchemaError, read_history, read_step, validate_rows, write_step
from tests.helpers import make_row

# The list columns as the store wrote them before 64-bit offsets (pa.list_, pa.string: 32-bit offsets).
OLD_TYPES = {"token_ids": pa.list_(pa.int32()), "loss_mask": pa.list_(pa.int8()),
             "rollout_logprobs": pa.list_(pa.float32()), "policy_versions": pa.list_(pa.int32()),
             "commands": pa.list_(pa.string())}
OLD_SCHEMA = pa.schema([(f.name, OLD_TYPES.get(f.name, f.type)) for f in TRAJECTORY_SCHEMA])
PER_TOKEN = ("token_ids", "loss_mask", "rollout_logprobs", "policy_versions")


def _rows() -> list[dict]:
    # Logprobs are float32-exact (k/8), so the Python values survive the float32 column unchanged.
    return [make_row(), make_row(episode_id="e1", sample_index=1, commands=["ls", "cat x"], sandbox_warm=True,
                                 token_ids=[5, 6, 7], loss_mask=[0, 1, 1], rollout_logprobs=[0.0, -0.125, -2.5],
                                 policy_versions=[-1, 2, 2], min_policy_version=2, max_policy_version=2)]


def _le(model, name: str) -> int:
    """The upper bound ``Field(le=...)`` of a config field."""
    return next(m.le for m in model.model_fields[name].metadata if isinstance(m, annotated_types.Le))


def _offsets_type(list_type: pa.DataType) -> pa.DataType:
    return pa.array([[]], list_type).offsets.type


def test_validate_rows_invariants():
    validate_rows([make_row()])
    with pytest.raises(SchemaError, match="'loss_mask' has 3 entries, token_ids has 4"):
        validate_rows([make_row(loss_mask=[0, 1, 1])])
    with pytest.raises(SchemaError, match="min/max_policy_version 0/4 != tokens' 3/4"):
        validate_rows([make_row(min_policy_version=0)])
    with pytest.raises(SchemaError, match="unknown columns \\['extra'\\]"):
        validate_rows([make_row(extra=1)])
    with pytest.raises(SchemaError, match="NaN rollout logprob"):
        validate_rows([make_row(rollout_logprobs=[0.0, 0.0, float("nan"), -1.0])])
    validate_rows([make_row(segment_starts=[0, 1])])
    with pytest.raises(SchemaError, match="begins on a sampled token"):
        validate_rows([make_row(segment_starts=[0, 2])])
    for bad in ([], [1], [0, 2, 2], [0, 4]):
        with pytest.raises(SchemaError, match="segment_starts .* must start at 0 and rise strictly below"):
            validate_rows([make_row(segment_starts=bad)])


def test_file_written_before_segment_starts_reads_with_one_segment_per_row(tmp_path):
    fs = fsspec.filesystem("file", auto_mkdir=True)
    layout = RunLayout(str(tmp_path), "runs", "r")
    uri = f"{layout.trajectories_dir}/step-000000.parquet"
    rows = _rows()
    before = pa.schema([f for f in TRAJECTORY_SCHEMA if f.name != "segment_starts"])
    fs.makedirs(layout.trajectories_dir)
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "segment_starts"} for r in rows],
                                        schema=before), uri)
    assert read_step(fs, uri).to_pylist() == rows
    assert read_history(fs, layout, ["episode_id", "segment_starts"]).to_pylist() == [
        {"episode_id": "e0", "segment_starts": [0]}, {"episode_id": "e1", "segment_starts": [0]}]


def test_file_with_32_bit_offsets_reads_back_to_the_same_rows(tmp_path):
    fs = fsspec.filesystem("file", auto_mkdir=True)
    layout = RunLayout(str(tmp_path), "runs", "r")
    old, new = f"{layout.trajectories_dir}/step-000000.parquet", f"{layout.trajectories_dir}/step-000001.parquet"
    rows = _rows()
    fs.makedirs(layout.trajectories_dir)
    pq.write_table(pa.Table.from_pylist(rows, schema=OLD_SCHEMA), old, compression="zstd")  # as the old writer did
    assert pq.read_schema(old).field("token_ids").type == pa.list_(pa.int32())
    write_step(fs, new, [{**r, "step": 1} for r in rows])

    table = read_step(fs, old)
    assert table.schema.equals(TRAJECTORY_SCHEMA)
    assert table.to_pylist() == rows
    hist = read_history(fs, layout, ["step", "token_ids", "commands"])  # an old and a new file in one run
    assert hist.schema.equals(pa.schema([TRAJECTORY_SCHEMA.field(c) for c in ("step", "token_ids", "commands")]))
    assert hist.to_pylist() == [{"step": s, "token_ids": r["token_ids"], "commands": r["commands"]}
                                for s in (0, 1) for r in rows]


def test_a_file_of_another_schema_is_refused(tmp_path):
    fs = fsspec.filesystem("file", auto_mkdir=True)
    path = f"{tmp_path}/step-000000.parquet"
    other = pa.schema([(f.name, pa.list_(pa.int64()) if f.name == "token_ids" else f.type) for f in TRAJECTORY_SCHEMA])
    pq.write_table(pa.Table.from_pylist(_rows(), schema=other), path)
    with pytest.raises(SchemaError, match="step-000000.parquet: schema differs from TRAJECTORY_SCHEMA"):
        read_step(fs, path)


def test_list_columns_have_64_bit_offsets():
    for name in (*PER_TOKEN, "commands"):
        assert _offsets_type(TRAJECTORY_SCHEMA.field(name).type) == pa.int64(), name
    assert TRAJECTORY_SCHEMA.field("commands").type.value_type == pa.large_string()  # its characters too


def test_worst_case_step_fits_the_offsets():
    # Rows per step: every attempt of every member (infra retries included); tokens per row: the context.
    rows = _le(RolloutConfig, "tasks_per_step") * _le(RolloutConfig, "group_size") * (
        1 + _le(RolloutConfig, "max_infra_retries"))
    worst = rows * _le(ModelConfig, "max_model_len")  # elements of one per-token column in one step
    old_offsets = _offsets_type(OLD_TYPES["token_ids"])
    with pytest.raises(pa.ArrowInvalid, match="not in range"):  # 32-bit offsets cannot hold the last row's end
        pa.array([worst], pa.int64()).cast(old_offsets)
    for name in PER_TOKEN:
        offsets = _offsets_type(TRAJECTORY_SCHEMA.field(name).type)
        # x 1000: room for prompts and last observations past max_model_len
        assert pa.array([worst * 1000]).cast(offsets).to_pylist() == [worst * 1000]
    # The writer's cap holds a max-length row, and one row group would fit even 32-bit offsets.
    assert store.ROW_GROUP_TOKENS // _le(ModelConfig, "max_model_len") >= 1
    assert pa.array([store.ROW_GROUP_TOKENS], pa.int64()).cast(old_offsets).to_pylist() == [store.ROW_GROUP_TOKENS]


def test_long_rows_round_trip_in_capped_row_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "ROW_GROUP_TOKENS", 2**16)  # 2 rows of max_model_len per group (2**16 // 2**15)
    fs = fsspec.filesystem("file", auto_mkdir=True)
    path = f"{tmp_path}/step-000000.parquet"
    n, rng = _le(ModelConfig, "max_model_len"), random.Random(0)
    rows = [make_row(episode_id=f"e{i}", sample_index=i, token_ids=[rng.randrange(49152) for _ in range(n)],
                     loss_mask=[1] * n, rollout_logprobs=[-rng.randrange(64) / 8 for _ in range(n)],
                     policy_versions=[i] * n, min_policy_version=i, max_policy_version=i) for i in range(5)]
    write_step(fs, path, rows)
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [2, 2, 1]  # 5 rows, 2 per group
    assert read_step(fs, path).to_pylist() == rows


def test_history_with_dropped_groups_counts_their_attempts(tmp_path):
    """Difficulty reads dropped groups too (a zero-variance group dynamic sampling passed over is an attempt)."""
    fs = fsspec.filesystem("file", auto_mkdir=True)
    layout = RunLayout(str(tmp_path), "runs", "r")
    trained = [{**r, "task_id": "tb/a"} for r in _rows()]
    skipped = [{**r, "task_id": "tb/hopeless", "reward": 0.0} for r in _rows()]
    write_step(fs, f"{layout.trajectories_dir}/step-000000.parquet", trained)
    write_step(fs, layout.dropped(0).removeprefix("s3://"), skipped)

    assert read_history(fs, layout, ["task_id"]).column("task_id").to_pylist() == ["tb/a"] * len(trained)
    both = read_history(fs, layout, ["task_id"], include_dropped=True).column("task_id").to_pylist()
    assert sorted(both) == sorted(["tb/a"] * len(trained) + ["tb/hopeless"] * len(skipped))
