"""Trajectory store on a real SeaweedFS: schema enforced on write, atomic step files."""

from __future__ import annotations

import uuid

import pyarrow.parquet as pq
import pytest

from infra.layout import RunLayout
from infra.storage import StorageError, s3_filesystem
from infra.store import (
    TRAJECTORY_SCHEMA,
    SchemaError,
    read_history,
    read_step,
    write_step,
)
from tests.helpers import ROOT, make_row


@pytest.mark.integration
def test_write_read_roundtrip_keeps_types_and_empty_lists(s3):
    uri = RunLayout("agentrl", "test", f"store-{uuid.uuid4().hex[:8]}").trajectories(3)
    rows = [make_row(), make_row(episode_id="e1", sample_index=1, commands=["ls", "cat x"])]
    write_step(s3, uri, rows)
    table = read_step(s3, uri)
    assert table.schema.equals(TRAJECTORY_SCHEMA)
    back = table.to_pylist()
    assert back[0]["commands"] == [] and back[1]["commands"] == ["ls", "cat x"]
    assert back[0]["policy_versions"] == [-1, -1, 3, 4]


@pytest.mark.integration
def test_type_mismatch_rejected_and_nothing_written(s3):
    uri = RunLayout("agentrl", "test", f"store-{uuid.uuid4().hex[:8]}").trajectories(0)
    with pytest.raises(SchemaError, match="do not match the trajectory schema"):
        write_step(s3, uri, [make_row(reward="high")])
    assert not s3.exists(uri)


@pytest.mark.integration
def test_crash_mid_write_leaves_no_partial_object(s3, monkeypatch):
    run = f"store-{uuid.uuid4().hex[:8]}"
    good = RunLayout("agentrl", "test", run).trajectories(0)
    write_step(s3, good, [make_row()])

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(pq, "write_table", crash)
    uri = RunLayout("agentrl", "test", run).trajectories(1)
    with pytest.raises(KeyboardInterrupt):
        write_step(s3, uri, [make_row()])
    monkeypatch.undo()
    s3.invalidate_cache()
    assert not s3.exists(uri)
    hist = read_history(s3, RunLayout("agentrl", "test", run), ["task_id", "step"])
    assert hist.num_rows == 1  # the committed step is intact, nothing half-written is visible


_CRASH_MID_PUT = r"""
import io, os, random, sys
import aiohttp.http_writer as hw
import pyarrow as pa, pyarrow.parquet as pq
sys.path.insert(0, os.getcwd())
from tests.helpers import make_row
from infra.storage import s3_filesystem
from infra.store import TRAJECTORY_SCHEMA, write_step

rng = random.Random(0)
n = 400_000
rows = [make_row(token_ids=[rng.randrange(50000) for _ in range(n)], loss_mask=[1] * n,
                 rollout_logprobs=[-rng.random() for _ in range(n)], policy_versions=[3] * n,
                 min_policy_version=3, max_policy_version=3)]
buf = io.BytesIO()
pq.write_table(pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA), buf, compression="zstd")
print("object_bytes", buf.tell(), flush=True)
orig = hw.StreamWriter.write
async def write(self, chunk, *args, **kwargs):  # the process dies once 512 KiB of a request went out
    await orig(self, chunk, *args, **kwargs)
    self._sent_bytes = getattr(self, "_sent_bytes", 0) + len(chunk)
    if self._sent_bytes > 512 * 1024:
        await self.drain()
        os._exit(9)
hw.StreamWriter.write = write
write_step(s3_filesystem("agentrl"), sys.argv[1], rows)
print("write_step returned", flush=True)
"""


@pytest.mark.integration
def test_process_killed_mid_put_leaves_no_object(s3, services_env):
    """A writer process dies with part of the step file's body sent: readers see no object, the
    committed step beside it is intact. The crash is real (os._exit in the HTTP writer once 512 KiB
    of the request went out); the server sees a connection cut mid-body."""
    import subprocess
    import sys

    run = f"store-{uuid.uuid4().hex[:8]}"
    good = RunLayout("agentrl", "test", run).trajectories(0)
    write_step(s3, good, [make_row()])
    uri = RunLayout("agentrl", "test", run).trajectories(1)
    r = subprocess.run([sys.executable, "-c", _CRASH_MID_PUT, uri], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 9, (r.stdout, r.stderr[-2000:])
    assert "write_step returned" not in r.stdout
    size = int(r.stdout.split("object_bytes", 1)[1].split()[0])
    assert size > 4 * 512 * 1024  # most of the body was never sent: the cut was mid-PUT
    s3.invalidate_cache()
    assert not s3.exists(uri)
    hist = read_history(s3, RunLayout("agentrl", "test", run), ["task_id", "step"])
    assert hist.num_rows == 1 and hist.column("step").to_pylist() == [0]


@pytest.mark.integration
def test_divergence_decisions_written_whole_against_their_schema(s3):
    from infra.store import DIVERGENCE_SCHEMA, write_divergence

    uri = f"agentrl/test/store-{uuid.uuid4().hex[:8]}/divergence/step-000000.parquet"
    rows = [{"episode_id": "e0", "group_id": "g", "kl_k1": 0.1, "kl_k3": 0.01, "known_tokens": 4, "weight": 1.0,
             "decision": "keep"}]
    write_divergence(s3, uri, rows)
    with s3.open(uri, "rb") as f:
        assert pq.read_table(f).schema.equals(DIVERGENCE_SCHEMA)
    bad = f"{uri}.bad"
    with pytest.raises(SchemaError, match="do not match DIVERGENCE_SCHEMA"):
        write_divergence(s3, bad, [{**rows[0], "kl_k1": "high"}])
    renamed = {("kl" if k == "kl_k1" else k): v for k, v in rows[0].items()}
    with pytest.raises(SchemaError, match="decision 0 has keys"):
        write_divergence(s3, bad, [renamed])
    assert not s3.exists(bad)


@pytest.mark.integration
def test_unreachable_endpoint_names_it(monkeypatch, services_env):
    monkeypatch.setenv("AGENTRL_S3_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(StorageError, match=r"S3 endpoint http://127.0.0.1:9 not reachable"):
        s3_filesystem("agentrl")
    monkeypatch.delenv("AGENTRL_S3_ENDPOINT")
    with pytest.raises(StorageError, match="AGENTRL_S3_ENDPOINT is not set"):
        s3_filesystem("agentrl")


@pytest.mark.integration
def test_missing_bucket_names_it(services_env):
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-x' does not exist"):
        s3_filesystem("no-such-bucket-x")


@pytest.mark.integration
def test_empty_and_populated_lists_read_back_as_one_dataset(s3):
    run = f"store-{uuid.uuid4().hex[:8]}"
    layout = RunLayout("agentrl", "test", run)
    write_step(s3, layout.trajectories(0), [make_row(commands=[]), make_row(episode_id="e1")])
    write_step(s3, layout.trajectories(1), [make_row(step=1, commands=["ls", "pwd"])])
    hist = read_history(s3, RunLayout("agentrl", "test", run), ["step", "commands"])
    assert hist.schema.field("commands").type == TRAJECTORY_SCHEMA.field("commands").type
    assert hist.column("commands").to_pylist() == [[], [], ["ls", "pwd"]]  # empty lists stay lists, not nulls
    assert hist.column("commands").null_count == 0


@pytest.mark.integration
def test_listing_sees_a_file_another_process_added(s3, services_env):
    import subprocess
    import sys

    run = f"store-{uuid.uuid4().hex[:8]}"
    write_step(s3, RunLayout("agentrl", "test", run).trajectories(0), [make_row()])
    assert read_history(s3, RunLayout("agentrl", "test", run), ["step"]).num_rows == 1  # listing now cached by s3fs
    code = (
        "from infra.storage import s3_filesystem; from infra.store import write_step;"
        "from infra.layout import RunLayout; from tests.helpers import make_row;"
        f"write_step(s3_filesystem('agentrl'), RunLayout('agentrl', 'test', '{run}').trajectories(1), "
        "[make_row(step=1)])"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(ROOT))
    assert read_history(s3, RunLayout("agentrl", "test", run), ["step"]).column("step").to_pylist() == [0, 1]
