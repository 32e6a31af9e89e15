"""Trajectory storage: one Parquet file per step on S3, schema declared once and enforced on write.

Layout: ``RunLayout.trajectories(step)`` (``{run}/trajectories/step-{step:06d}.parquet``). A file is
serialized fully in memory and sent in one PUT, so a crash mid-write leaves no partial object
visible to readers (S3 makes an object visible only when its upload completes). Rewriting a
step replaces its file: a step re-run after a crash never duplicates rows.

Size limits: list columns use 64-bit offsets (``large_list``). A step holds up to
``tasks_per_step * group_size * (1 + max_infra_retries)`` rows (every attempt; config maxima 1024 * 64 * 11),
each of about ``model.max_model_len`` tokens (at most 32768, plus the last observation): ~2.4e10 elements
in one column, past the 2**31 - 1 of 32-bit offsets. Row groups hold at most :data:`ROW_GROUP_TOKENS`
tokens. Files written before (32-bit ``list``/``string`` types, :data:`TRAJECTORY_SCHEMA_32`) are cast on read.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import pyarrow as pa
import pyarrow.parquet as pq

from infra.layout import RunLayout


def _column(arrow_type: pa.DataType, before: pa.DataType | None = None, added=None):
    """A column's Arrow type; ``before``: its type in files written with 32-bit offsets, where it differs.

    ``added``: a column added after files were written; its value in those files (a factory), filled on read.
    """
    if added is None:
        return field(metadata={"arrow": arrow_type, "before": before or arrow_type})
    return field(default_factory=added, metadata={"arrow": arrow_type, "before": before or arrow_type,
                                                  "added": added})


@dataclass(frozen=True)
class Trajectory:
    """One episode as stored: one Parquet row. The columns and their Arrow types are declared here only.

    Invariants (``T`` = ``len(token_ids)``): ``token_ids``, ``loss_mask``, ``rollout_logprobs`` and
    ``policy_versions`` have length T; ``loss_mask[i] == 1`` exactly for tokens the policy sampled;
    where it is 0 the logprob is 0.0 and the policy version -1 (not produced by a policy);
    ``min/max_policy_version`` range over sampled tokens (-1 when none were sampled);
    ``segment_starts`` starts with 0 and rises strictly, each below T.

    Segments: an episode whose harness rewrote its history (summarised, truncated, ran a sub-agent)
    is stored as several token sequences back to back, each exactly what the engine received and
    sampled on its calls; ``segment_starts`` holds where each begins, and the trainer scores each
    segment as its own sequence (``infra.train.trainer.split_segments``).
    """

    run_id: str = _column(pa.string())  # the run
    step: int = _column(pa.int32())  # training step the rollouts were collected for
    episode_id: str = _column(pa.string())  # this attempt
    task_id: str = _column(pa.string())
    group_id: str = _column(pa.string())  # GRPO siblings share it
    sample_index: int = _column(pa.int32())  # index within the group
    attempt: int = _column(pa.int32())  # 0, then 1.. for infra retries
    # Per-token columns (T): 64-bit offsets, see the module docstring; ``before`` is the 32-bit type read back.
    token_ids: list[int] = _column(pa.large_list(pa.int32()), pa.list_(pa.int32()))  # every token as sent and sampled
    loss_mask: list[int] = _column(pa.large_list(pa.int8()), pa.list_(pa.int8()))  # 1 exactly on sampled tokens
    rollout_logprobs: list[float] = _column(  # sampling logprobs; 0.0 where not sampled
        pa.large_list(pa.float32()), pa.list_(pa.float32()))
    policy_versions: list[int] = _column(  # sampling version per token; -1 if not sampled
        pa.large_list(pa.int32()), pa.list_(pa.int32()))
    min_policy_version: int = _column(pa.int32())  # over sampled tokens; -1 when none
    max_policy_version: int = _column(pa.int32())
    prompt_tokens: int = _column(pa.int32())  # the opening prompt's length
    completion_tokens: int = _column(pa.int32())  # sampled tokens
    reward: float = _column(pa.float32())
    outcome: str = _column(pa.string())  # an ``envs.task.Outcome``
    reason: str = _column(pa.string())  # reason code
    stop_reason: str = _column(pa.string())  # of the last turn: stop or length
    agent_end: str = _column(pa.string())  # done, max_turns, agent_timeout, context_full, ...
    num_turns: int = _column(pa.int32())
    # What a replay runs; its characters are sampled text, so a step's can pass 2 GiB too.
    commands: list[str] = _column(pa.large_list(pa.large_string()), pa.list_(pa.string()))
    image: str = _column(pa.string())
    image_digest: str = _column(pa.string())
    seed: int = _column(pa.int64())
    temperature: float = _column(pa.float32())
    top_p: float = _column(pa.float32())
    max_tokens: int = _column(pa.int32())  # per turn
    queue_s: float = _column(pa.float64())
    sandbox_acquire_s: float = _column(pa.float64())
    generation_s: float = _column(pa.float64())
    tool_s: float = _column(pa.float64())
    verify_s: float = _column(pa.float64())
    engine_replica: str = _column(pa.string())
    sandbox_id: str = _column(pa.string())
    sandbox_warm: bool = _column(pa.bool_())  # the sandbox came from the warm pool
    segment_starts: list[int] = _column(pa.list_(pa.int32()), added=lambda: [0])  # token offsets, see above
    # Where the episode's wall time went, in s: from sandbox acquire to the row (``episode_s``), and of
    # ``generation_s`` the engine's queue, prefill and decode (vLLM's per-request stats; 0.0 from the servers).
    episode_s: float = _column(pa.float64(), added=float)
    engine_queue_s: float = _column(pa.float64(), added=float)
    prefill_s: float = _column(pa.float64(), added=float)
    decode_s: float = _column(pa.float64(), added=float)
    # What the sandbox sent out through the egress proxy (``infra.egress``), by phase: the agent's commands
    # (and what it left running), then the task's tests. Requests (denied ones included), response bytes,
    # hosts asked for, hosts the policy denied. Zero and empty without the proxy or the network.
    egress_agent_requests: int = _column(pa.int32(), added=int)
    egress_agent_bytes: int = _column(pa.int64(), added=int)
    egress_agent_hosts: list[str] = _column(pa.list_(pa.string()), added=list)
    egress_agent_denied: list[str] = _column(pa.list_(pa.string()), added=list)
    egress_verifier_requests: int = _column(pa.int32(), added=int)
    egress_verifier_bytes: int = _column(pa.int64(), added=int)
    egress_verifier_hosts: list[str] = _column(pa.list_(pa.string()), added=list)
    egress_verifier_denied: list[str] = _column(pa.list_(pa.string()), added=list)
    # Gateway calls the episode made that were answered but are not in ``token_ids``: token counts, model
    # lists, and completions asked of a side model (an installed agent's small-model calls for titles).
    side_calls: int = _column(pa.int32(), added=int)

    def row(self) -> dict:
        """As a row dict (``write_step`` input; what ``read_step(...).to_pylist()`` gives back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def egress_columns(record: dict[str, dict]) -> dict:
    """The ``egress_*`` columns of a row from a sandbox's egress record.

    ``record``: ``Sandbox.egress_record()``, phase -> ``infra.egress.policy.EgressSummary`` fields.
    """
    out: dict = {}
    for phase in ("agent", "verifier"):
        r = record.get(phase, {})
        out.update({f"egress_{phase}_requests": r.get("requests", 0), f"egress_{phase}_bytes": r.get("bytes", 0),
                    f"egress_{phase}_hosts": list(r.get("hosts", [])),
                    f"egress_{phase}_denied": list(r.get("denied", []))})
    return out


TRAJECTORY_SCHEMA = pa.schema([(f.name, f.metadata["arrow"]) for f in fields(Trajectory)])
"""The Arrow schema of :class:`Trajectory`, enforced on write and read."""
TRAJECTORY_SCHEMA_32 = pa.schema([(f.name, f.metadata["before"]) for f in fields(Trajectory)])
""":data:`TRAJECTORY_SCHEMA` as files were written before 64-bit offsets (``list``, ``string``); read and cast."""
ADDED_COLUMNS = {f.name: f.metadata["added"] for f in fields(Trajectory) if "added" in f.metadata}
"""Columns added after step files were written, with their value for such files (filled on read)."""
ROW_GROUP_TOKENS = 2**24
"""Most per-token elements in one row group. pyarrow's Parquet writer holds a row group's nested levels in
memory (measured: 3.0 GiB peak writing 2**28 int8 elements as one row group, 0.6 GiB in groups of 2**24), so
a worst-case step as one row group would not fit; capped, a 2**31 + 32768 element column wrote and read back
at 2.7 GiB peak (pyarrow 26)."""
_PER_TOKEN = ("loss_mask", "rollout_logprobs", "policy_versions")


class SchemaError(ValueError):
    """A row that breaks the trajectory schema or its invariants; names the row and column."""


def validate_rows(rows: Sequence[dict]) -> None:
    """Check the per-token invariants of :data:`TRAJECTORY_SCHEMA`.

    Raises:
        SchemaError: unknown or missing column, per-token arrays of unequal length, a NaN
            logprob on a sampled token, or min/max policy version not matching the tokens.
    """
    names = set(TRAJECTORY_SCHEMA.names)
    for i, row in enumerate(rows):
        if set(row) != names:
            extra, missing = sorted(set(row) - names), sorted(names - set(row))
            raise SchemaError(f"row {i}: unknown columns {extra}, missing columns {missing}")
        n = len(row["token_ids"])
        for col in _PER_TOKEN:
            if len(row[col]) != n:
                raise SchemaError(f"row {i} ({row['episode_id']}): column '{col}' has {len(row[col])} "
                                  f"entries, token_ids has {n}")
        sampled = [v for v, m in zip(row["policy_versions"], row["loss_mask"], strict=True) if m]
        lo, hi = (min(sampled), max(sampled)) if sampled else (-1, -1)
        if (row["min_policy_version"], row["max_policy_version"]) != (lo, hi):
            raise SchemaError(f"row {i} ({row['episode_id']}): min/max_policy_version "
                              f"{row['min_policy_version']}/{row['max_policy_version']} != tokens' {lo}/{hi}")
        if any(m and math.isnan(lp) for lp, m in zip(row["rollout_logprobs"], row["loss_mask"], strict=True)):
            raise SchemaError(f"row {i} ({row['episode_id']}): NaN rollout logprob on a sampled token")
        starts = row["segment_starts"]
        if (not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:], strict=False))
                or (n and starts[-1] >= n)):
            raise SchemaError(f"row {i} ({row['episode_id']}): segment_starts {starts[:8]} must start at 0 and "
                              f"rise strictly below token_ids' length {n}")
        if any(row["loss_mask"][k] for k in starts[1:]):
            raise SchemaError(f"row {i} ({row['episode_id']}): a segment of segment_starts {starts[:8]} begins on a "
                              "sampled token; a segment begins with the prompt ids the engine received")


def write_step(fs, uri: str, rows: Sequence[dict]) -> int:
    """Validate and write one step's rows as a single Parquet object; returns its size in bytes.

    Raises:
        SchemaError: see :func:`validate_rows`; a type mismatch is reported with the column.
    """
    validate_rows(rows)
    longest = max((len(row["token_ids"]) for row in rows), default=0)
    return _put_table(fs, uri, rows, TRAJECTORY_SCHEMA, "rows do not match the trajectory schema",
                      row_group_rows=max(1, ROW_GROUP_TOKENS // max(longest, 1)))


def _put_table(fs, uri: str, rows: Sequence[dict], schema: pa.Schema, mismatch: str,
               row_group_rows: int | None = None) -> int:
    """Rows as one zstd Parquet object in a single PUT (visible whole or not at all); returns its size in bytes.

    ``row_group_rows``: rows per row group (None: pyarrow's default, 1Mi rows).

    Raises:
        SchemaError: ``{uri}: {mismatch}: ...`` when a value does not fit ``schema``.
    """
    try:
        table = pa.Table.from_pylist(list(rows), schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise SchemaError(f"{uri}: {mismatch}: {e}") from e
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=row_group_rows)
    data = buf.getvalue()
    fs.pipe_file(uri, data)
    return len(data)


DIVERGENCE_SCHEMA = pa.schema([
    ("episode_id", pa.string()), ("group_id", pa.string()),
    ("kl_k1", pa.float64()), ("kl_k3", pa.float64()), ("known_tokens", pa.int64()),
    ("weight", pa.float64()), ("decision", pa.string()),
])
"""One row per trained row of a step: the trainer-side KL estimates and the divergence decision."""


def write_divergence(fs, uri: str, decisions: Sequence[dict]) -> int:
    """Write a step's divergence decisions as one Parquet object (one PUT); returns its size in bytes.

    Raises:
        SchemaError: a decision does not match ``DIVERGENCE_SCHEMA``.
    """
    for i, d in enumerate(decisions):
        if set(d) != set(DIVERGENCE_SCHEMA.names):
            raise SchemaError(f"{uri}: decision {i} has keys {sorted(d)}; "
                              f"DIVERGENCE_SCHEMA has {DIVERGENCE_SCHEMA.names}")
    return _put_table(fs, uri, decisions, DIVERGENCE_SCHEMA, "decisions do not match DIVERGENCE_SCHEMA")


def _as_current(table: pa.Table, uri: str, columns: Sequence[str]) -> pa.Table:
    """``table`` (``columns`` of a step file, in that order) in :data:`TRAJECTORY_SCHEMA`'s types.

    A file with :data:`TRAJECTORY_SCHEMA_32`'s types is cast (offsets widened; the same Python values).

    Raises:
        SchemaError: the columns' types match neither schema.
    """
    for c in columns:  # a column added since the file was written: filled with its value for such files
        if c in ADDED_COLUMNS and c not in table.column_names:
            table = table.append_column(TRAJECTORY_SCHEMA.field(c),
                                        pa.array([ADDED_COLUMNS[c]() for _ in range(table.num_rows)],
                                                 TRAJECTORY_SCHEMA.field(c).type))
    table = table.select(list(columns))
    current = pa.schema([TRAJECTORY_SCHEMA.field(c) for c in columns])
    if table.schema.equals(current):
        return table
    if table.schema.equals(pa.schema([TRAJECTORY_SCHEMA_32.field(c) for c in columns])):
        return table.cast(current)
    raise SchemaError(f"{uri}: schema differs from TRAJECTORY_SCHEMA (and from TRAJECTORY_SCHEMA_32): "
                      f"got {table.schema}")


def read_step(fs, uri: str) -> pa.Table:
    """Read one step file as :data:`TRAJECTORY_SCHEMA` (a file written before 64-bit offsets is cast).

    Raises:
        SchemaError: the file's schema is neither :data:`TRAJECTORY_SCHEMA` nor :data:`TRAJECTORY_SCHEMA_32`.
    """
    fs.invalidate_cache()
    with fs.open(uri, "rb") as f:
        table = pq.read_table(f)
    if [c for c in TRAJECTORY_SCHEMA.names if c not in ADDED_COLUMNS or c in table.column_names] != table.column_names:
        raise SchemaError(f"{uri}: schema differs from TRAJECTORY_SCHEMA: columns {table.column_names}")
    return _as_current(table, uri, TRAJECTORY_SCHEMA.names)


def read_history(fs, layout: RunLayout, columns: Sequence[str], include_dropped: bool = False) -> pa.Table:
    """Selected columns of every stored step of a run, in :data:`TRAJECTORY_SCHEMA`'s types (empty table when none).

    ``include_dropped``: also the rows of groups the collector dropped (``dropped/``: stale, out of
    infra retries, or zero-variance groups dynamic sampling passed over): never trained on, but
    attempts all the same, which task difficulty must count (a task whose groups all fail is
    hopeless even when dynamic sampling keeps those groups out of the batch).

    Raises:
        SchemaError: a file's columns have types of neither :data:`TRAJECTORY_SCHEMA` nor :data:`TRAJECTORY_SCHEMA_32`.
    """
    fs.invalidate_cache()
    roots = [layout.trajectories_dir] + ([layout.dropped_dir] if include_dropped else [])
    paths = sorted(p for root in roots for p in (fs.glob(f"{root}/step-*.parquet") if fs.exists(root) else []))
    tables = []
    for p in paths:
        with fs.open(p, "rb") as f:
            present = pq.read_schema(f).names
            f.seek(0)
            tables.append(_as_current(pq.read_table(f, columns=[c for c in columns if c in present]), p, columns))
    if not tables:
        return TRAJECTORY_SCHEMA.empty_table().select(list(columns))
    return pa.concat_tables(tables)
