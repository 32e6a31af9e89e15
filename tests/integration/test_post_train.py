"""The whole loop, one step, on a tiny random Llama: real dockerd, SeaweedFS, vLLM, DeepSpeed, Prefect server."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from pathlib import Path

import docker
import httpx
import pytest

from infra.config import ColocatedPublish, EvalConfig, ModelConfig, RolloutConfig, RunConfig, TaskSetConfig
from infra.store import TRAJECTORY_SCHEMA, read_step
from tests.helpers import asset_events, related_assets

pytestmark = pytest.mark.integration


class FinishedRun(tuple):
    """``(config, summaries)`` of a post_train run, and its ``flow_run_id`` (to scope API queries to it)."""

    flow_run_id: str


def run_post_train(config: RunConfig) -> FinishedRun:
    from flows.post_train import post_train

    state = post_train(config, return_state=True)
    finished = FinishedRun((config, state.result()))
    finished.flow_run_id = str(state.state_details.flow_run_id)
    return finished


@pytest.fixture(scope="module", autouse=True)
def checkout_server(tmp_path_factory, services_env):
    """The Prefect server and worker of ``make server`` (``infra.prefect_server.start``) with a PREFECT_HOME of its
    own; this module's flows report to it (a real server, whose UI the browser test reads)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from infra import prefect_server
    from infra.net import free_port
    from infra.prefect_backend import drain_workers

    home = tmp_path_factory.mktemp("prefect-home")
    api_url = prefect_server.start(home, port=free_port(), home=home)  # its own database and profile
    try:
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            # Prefect keys its EventsWorker by client type, not API URL: one started for another server
            # (the session's test harness, by an earlier module) would keep sending this module's task
            # runs and asset events there. Drained, the next event starts one for this server.
            drain_workers()
            yield api_url
            drain_workers()  # send what is queued for this server before it stops (or the session's
            # harness teardown later waits forever on events addressed to a server that is gone)
    finally:
        prefect_server.stop(home)


@pytest.fixture(scope="module")
def finished_run(tiny_model, s3):

    config = RunConfig(
        run_id=f"it-{uuid.uuid4().hex[:8]}", steps=1,
        model=ModelConfig(path=str(tiny_model), max_model_len=1024, kv_cache_gib=1.0),
        tasks=TaskSetConfig(terminal_eval_ids=["make-dir"], humaneval_train=2, humaneval_eval=1,
                            task_sets=["envs/harbor"]),
        rollout=RolloutConfig(tasks_per_step=3, group_size=2, max_tokens_per_turn=24, max_turns=2),
        eval=EvalConfig(max_tokens=24),
        publish=ColocatedPublish(),  # storage: test_resume.py and the quickstart
    )
    return run_post_train(config)


@pytest.fixture(scope="module")
def evaluated_run(tiny_model, s3):
    """A run of its own for the evaluate flow test, which adds reports beside v1 (the lineage tests count v1's)."""
    config = RunConfig(
        run_id=f"ev-{uuid.uuid4().hex[:8]}", steps=1,
        model=ModelConfig(path=str(tiny_model), max_model_len=1024, kv_cache_gib=1.0),
        tasks=TaskSetConfig(terminal_eval_ids=["make-dir"], humaneval_train=1, humaneval_eval=0),
        rollout=RolloutConfig(tasks_per_step=1, group_size=2, max_tokens_per_turn=16, max_turns=1),
        eval=EvalConfig(max_tokens=16),
    )
    return run_post_train(config)


@pytest.fixture(scope="module")
def live_run(finished_run):
    """The finished run opened again in this process (post_train closed its own): serving v1 when first used."""
    from infra.run import Run

    config, _ = finished_run
    with Run.open(config) as run:
        run.resume()
        yield run


def test_step_summary(finished_run):
    _, summaries = finished_run
    assert [s["step"] for s in summaries] == [0]
    s = summaries[0]
    assert s["policy_version"] == 1 and s["policy_lag_max"] == 0
    assert sum(s["outcomes"].values()) == s["rows"] >= 6
    assert s["logprob_abs_diff"] < 1e-3  # fp32 vLLM vs fp32 trainer on the same tokens
    # colocated: loaded from memory, then the checkpoint uploaded in the background (awaited at the end)
    assert s["publish_pattern"] == "colocated" and s["checkpoint_refused"] == ""
    assert 0 < s["reload_pause_s"] <= s["publish_latency_s"]


def test_report_and_summaries_stored_and_shown(finished_run, s3):
    from prefect.settings import PREFECT_API_URL

    from infra.layout import artifact_key

    config, summaries = finished_run
    run = f"agentrl/runs/{config.run_id}"
    s3.invalidate_cache()
    stored = json.loads(s3.cat_file(f"{run}/summaries/step-000000.json"))
    assert stored["checkpoint"] == summaries[0]["checkpoint"] and stored["reward_mean"] == summaries[0]["reward_mean"]
    report = s3.cat_file(f"{run}/report.md").decode()
    assert report.count("data:image/png;base64,") == 7 and "| 0 |" in report
    split = stored["episode_time_s"]  # the mean episode's wall time by part, from the real rows
    assert split["episode_s"] > 0 and split["decode_s"] > 0 and split["prefill_s"] > 0
    assert abs(sum(v for k, v in split.items() if k != "episode_s") - split["episode_s"]) < 0.01
    api = PREFECT_API_URL.value()
    for suffix, kind in (("report", "markdown"), ("steps", "table"), ("steps-all", "table"),
                         ("episodes-step-0", "markdown"), ("step-0-lineage", "markdown"), ("difficulty", "table"),
                         ("eval-v1", "table")):
        found = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {
            "any_": [artifact_key(config.run_id, suffix)]}}}, timeout=10).json()
        assert found and found[0]["type"] == kind, found
    progress = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {  # this run's own, not any earlier one's
        "type": {"any_": ["progress"]}, "flow_run_id": {"any_": [finished_run.flow_run_id]}}}, timeout=10).json()
    assert any(a["data"] == 100.0 for a in progress)


def test_stored_rows(finished_run, s3):
    config, summaries = finished_run
    table = read_step(s3, f"s3://agentrl/runs/{config.run_id}/trajectories/step-000000.parquet")
    assert table.schema.equals(TRAJECTORY_SCHEMA)
    rows = table.to_pylist()
    groups = {}
    for r in rows:
        groups.setdefault(r["group_id"], set()).add(r["sample_index"])
        n = len(r["token_ids"])
        assert len(r["loss_mask"]) == len(r["rollout_logprobs"]) == len(r["policy_versions"]) == n
        assert r["prompt_tokens"] > 0 and r["completion_tokens"] == sum(r["loss_mask"]) > 0
        # every sampled token was produced by policy version 0; template/observation tokens carry -1
        assert {v for v, m in zip(r["policy_versions"], r["loss_mask"], strict=True) if m} == {0}
        assert {v for v, m in zip(r["policy_versions"], r["loss_mask"], strict=True) if not m} == {-1}
        assert (r["min_policy_version"], r["max_policy_version"]) == (0, 0)
        assert r["outcome"] in ("success", "model_failure", "infra_failure", "unknown") and r["reason"]
        assert r["image_digest"].startswith("sha256:") and r["sandbox_id"]
        assert r["task_id"] != "tb/make-dir" and r["task_id"] != "humaneval/HumanEval/163"  # held out
    assert len(groups) == 3 and all(v == {0, 1} for v in groups.values())
    terminal = [r for r in rows if r["task_id"].startswith("tb/")]
    assert terminal and all(r["num_turns"] >= 1 for r in terminal)


def test_catalog_validated_with_logs(finished_run, s3):
    config, _ = finished_run
    run = f"agentrl/runs/{config.run_id}"
    s3.invalidate_cache()
    entries = {e["task_id"]: e for e in json.loads(s3.cat_file(f"{run}/envs.json"))["tasks"]}
    assert len(entries) == 16  # 10 Terminal-Bench tasks, 3 Harbor tasks, 2 + 1 HumanEval problems
    assert all(e["usable"] and e["validation"] == "passed" for e in entries.values()), entries
    assert entries["tb/csv-column"]["task_format"] == "terminal-bench"
    assert entries["harbor/fix-median"]["task_format"] == "harbor"
    log = s3.cat_file(f"{run}/envs-logs/tb__csv-column.log").decode()
    # the registry base image gets its local equivalent (infra.base_images), named in the build log
    assert "base image ghcr.io/laude-institute/t-bench/python-3-13:20250620 -> agentrl-python:3.13-trixie-2" in log
    assert "validation: reference solution passes; do-nothing scores 0.0" in log


def test_checkpoint_manifest_and_checksums(finished_run, s3):
    config, _ = finished_run
    uri = f"agentrl/runs/{config.run_id}/checkpoints/v1"
    s3.invalidate_cache()
    manifest = json.loads(s3.cat_file(f"{uri}/manifest.json"))
    assert (manifest["version"], manifest["parent_version"], manifest["step"]) == (1, 0, 0)
    assert "model.safetensors" in manifest["files"]
    for name, meta in manifest["files"].items():
        data = s3.cat_file(f"{uri}/{name}")
        assert len(data) == meta["size"] and hashlib.sha256(data).hexdigest() == meta["sha256"]


def test_eval_report(finished_run, s3):
    config, summaries = finished_run
    report = json.loads(s3.cat_file(f"agentrl/runs/{config.run_id}/checkpoints/v1/eval.json"))
    assert report["version"] == 1 and report["dtype"] == "float32" == config.model.serving_dtype
    assert set(report["per_task"]) == {"tb/make-dir", "humaneval/HumanEval/163"}
    assert 0.0 <= report["pass_at_1"] <= 1.0 and report["pass_at_1"] == summaries[0]["eval_pass_at_1"]


def test_lineage_events(finished_run):
    config, _ = finished_run
    run = f"s3://agentrl/runs/{config.run_id}"
    traj, ckpt = f"{run}/trajectories/step-000000.parquet", f"{run}/checkpoints/v1"
    (traj_event,) = asset_events(traj)
    assert any(a.startswith("docker://agentrl-task-") for a in related_assets(traj_event))
    (ckpt_event,) = asset_events(ckpt)
    assert traj in related_assets(ckpt_event)
    (eval_event,) = asset_events(f"{ckpt}/eval.json")
    assert ckpt in related_assets(eval_event)


def test_rerun_resumes_without_reusing_versions(finished_run, s3):
    from flows.post_train import post_train

    config, _ = finished_run
    assert post_train(config) == []  # step 0 is committed (v1 published): nothing to redo
    s3.invalidate_cache()
    assert s3.ls(f"agentrl/runs/{config.run_id}/trajectories") == [  # the step file and its lineage record
        f"agentrl/runs/{config.run_id}/trajectories/step-000000.parquet",
        f"agentrl/runs/{config.run_id}/trajectories/step-000000.parquet.lineage.json"]


def test_lineage_cli_walks_both_ways(finished_run, capsys):
    from prefect.settings import PREFECT_API_URL

    from flows.lineage import main, walk

    config, _ = finished_run
    run = f"s3://agentrl/runs/{config.run_id}"
    ckpt = f"{run}/checkpoints/v1"
    asset_events(f"{ckpt}/eval.json")  # wait until the last event has landed
    up = walk(PREFECT_API_URL.value(), ckpt, "upstream")
    assert (1, f"{run}/trajectories/step-000000.parquet") in up
    assert any(depth == 2 and node.startswith("docker://agentrl-task-") for depth, node in up)
    assert walk(PREFECT_API_URL.value(), ckpt, "downstream") == [(1, f"{ckpt}/eval.json")]
    for source in ("prefect", "s3"):  # the events, and the records stored beside the artifacts
        assert main([f"{run}/trajectories/step-000000.parquet", "--source", source]) == 0
        out = capsys.readouterr().out.splitlines()
        (at,) = [i for i, line in enumerate(out) if line.startswith(f"{run}/trajectories/step-000000.parquet")]
        assert out[at].endswith("· tokens by policy: base model " + out[at].rsplit(" ", 1)[1])  # sampled by v0
        below = out[at + 1:]
        assert below == ["used by (outputs):", f"  └── {ckpt}",
                         f"      └── {ckpt}/eval.json  · evaluated in float32 (serving dtype)"], (source, out)
        assert any(line.lstrip(" │├└─").startswith("docker://agentrl-task-") for line in out[:out.index(below[0])])


def test_corrupt_checkpoint_is_refused_and_engine_keeps_serving(finished_run, live_run, s3, tmp_path):
    from prefect import flow

    from infra.checkpoint import publish
    from tasks.publish import hot_load

    config, _ = finished_run
    rt = live_run
    served = rt.engine.policy_version
    uri = f"s3://agentrl/runs/{config.run_id}/checkpoints/v77"
    publish(s3, rt.layout.work / f"v{served}", uri, version=77, parent_version=served, step=76,
            dtype="float32")
    s3.pipe_file(f"{uri}/model.safetensors", b"not the published bytes")

    @flow
    def load() -> dict:
        return hot_load(rt, uri)

    result = load()
    assert result["version"] == served and "does not match the manifest" in result["refused"]
    assert rt.engine.policy_version == served and rt.policy.version == served
    s3.rm(uri, recursive=True)


def test_hot_load_resets_prefix_cache(live_run, tiny_model, tmp_path):
    from infra.rollout.engine import SampleRequest
    from infra.train.mismatch import trainer_logprobs

    rt = live_run
    engine, served_dir, served = rt.engine, rt.policy.weights_dir, rt.engine.policy_version
    prompt = list(range(5, 200))  # long enough to fill several KV blocks, cached after the first call
    before = engine.generate([SampleRequest(prompt, 8, 1.0, 1.0, 0)])[0]
    _noisy(tiny_model, tmp_path / "noisy")  # a very different policy
    try:
        engine.load_weights(str(tmp_path / "noisy"), 99)
        after = engine.generate([SampleRequest(prompt, 8, 1.0, 1.0, 0)])[0]
        assert after.policy_version == 99
        # what the noisy model itself gives the same tokens (a fresh forward, no cache)
        fresh = trainer_logprobs(str(tmp_path / "noisy"), [prompt + after.token_ids], "float32")[0][len(prompt) - 1:]
        assert max(abs(a - b) for a, b in zip(after.logprobs, fresh, strict=True)) < 1e-3
        assert after.token_ids != before.token_ids or max(
            abs(a - b) for a, b in zip(after.logprobs, before.logprobs, strict=True)) > 1e-2
    finally:
        engine.load_weights(served_dir, served)


def _noisy(tiny_model, out):
    """The tiny model with noise on every weight: a policy far from the trainer's."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(out)
    return str(out)


def test_colocated_and_direct_publication_serve_the_trainers_weights(live_run, tiny_model, tmp_path):
    """Each pattern, from a very different served policy: afterwards the engine's logprobs are the trainer's."""
    from infra.checkpoint import file_entries
    from infra.rollout.engine import SampleRequest
    from infra.run import Policy
    from infra.train.mismatch import trainer_logprobs
    from tasks.publish import export_weights, load_colocated, load_direct

    rt = live_run
    engine, served_dir, served = rt.engine, rt.policy.weights_dir, rt.engine.policy_version
    noisy = _noisy(tiny_model, tmp_path / "noisy")
    export_dir = export_weights(rt, 100)  # the trainer's weights as files: the reference
    prompt = list(range(5, 200))

    def max_diff_to_trainer() -> float:
        out = engine.generate([SampleRequest(prompt, 8, 1.0, 1.0, 0)])[0]
        ref = trainer_logprobs(export_dir, [prompt + out.token_ids], "float32")[0][len(prompt) - 1:]
        return max(abs(a - b) for a, b in zip(out.logprobs, ref, strict=True))

    try:
        engine.load_weights(noisy, 98)
        engine.generate([SampleRequest(prompt, 8, 1.0, 1.0, 0)])  # prefix cached under the noisy weights
        assert max_diff_to_trainer() > 1e-2  # the check can fail
        loaded = load_colocated(rt, 100)
        assert loaded["refused"] == "" and engine.policy_version == 100 and loaded["pause_s"] > 0
        assert max_diff_to_trainer() < 1e-3

        engine.load_weights(noisy, 99)
        loaded = load_direct(rt, export_dir, 101)
        assert loaded["refused"] == "" and engine.policy_version == 101 and loaded["transfer_s"] > 0
        assert max_diff_to_trainer() < 1e-3

        # a manifest the bytes do not match: refused, the engine keeps serving v101
        files = file_entries(Path(export_dir))
        files["model.safetensors"]["sha256"] = "0" * 64
        refused = load_direct(rt, export_dir, 102, files=files)
        assert refused["version"] == 101 and "does not match the manifest" in refused["refused"]
        assert engine.policy_version == 101 and rt.policy.version == 101
    finally:  # through the update policy, so the run's scheduler serves `served` again too
        rt.serve_folder(Policy(served, served_dir))


# ------------------------------------------------------------------ replay and faults (issue 3)


def _collector(rt, retries: int = 1):
    from infra.environments import BASE_IMAGE
    from infra.rollout.collector import Collector, CollectSettings

    images = rt.catalog.images()
    settings = CollectSettings(group_size=2, temperature=1.0, top_p=1.0, max_tokens_per_turn=16, max_turns=2,
                               seed=5, max_infra_retries=retries)
    return rt, Collector(rt.engine, rt.backend, settings, code_image=BASE_IMAGE), images


def _episode_containers(backend) -> list:
    return backend.client.containers.list(all=True, ignore_removed=True, filters={"label": "agentrl.episode"})


def _left_behind(backend, rows) -> list:
    """Containers of these rows' episodes still on the engine."""
    episodes = {r["episode_id"] for r in rows}
    return [c for c in _episode_containers(backend) if c.labels["agentrl.episode"] in episodes]


def test_replay_reproduces_stored_verdicts(finished_run, live_run, s3):
    from infra.environments import BASE_IMAGE
    from infra.rollout.collector import replay_episode

    config, _ = finished_run
    rt = live_run
    rows = read_step(s3, f"s3://agentrl/runs/{config.run_id}/trajectories/step-000000.parquet").to_pylist()
    replayable = [r for r in rows if r["outcome"] != "infra_failure"]
    assert replayable
    for r in replayable:
        verdict, reproduced = replay_episode(r, rt.tasks[r["task_id"]], rt.backend, BASE_IMAGE)
        assert reproduced, (r["task_id"], r["reward"], r["outcome"], verdict)
    # replay really runs the stored commands: the reference solution in place of the model's scores 1
    row = next(r for r in replayable if r["task_id"].startswith("tb/") and r["reward"] == 0.0)
    task = rt.tasks[row["task_id"]]
    verdict, reproduced = replay_episode({**row, "commands": [task.solution]}, task, rt.backend, BASE_IMAGE)
    assert verdict.reward == 1.0 and not reproduced


def test_harbor_tasks_run_through_the_collector_and_replay(live_run):
    from infra.environments import BASE_IMAGE
    from infra.rollout.collector import replay_episode

    rt, collector, images = _collector(live_run)
    tasks = [rt.tasks["harbor/write-greeting"], rt.tasks["harbor/fix-median"]]
    rows = collector.collect("harbor-run", 0, tasks, images)
    assert len(rows) == 4 and {r["task_id"] for r in rows} == {t.task_id for t in tasks}
    for r in rows:
        assert r["outcome"] in ("success", "model_failure", "unknown") and r["reason"], r
        assert r["image"].startswith("agentrl-task-harbor-") and r["image_digest"].startswith("sha256:")
        assert replay_episode(r, rt.tasks[r["task_id"]], rt.backend, BASE_IMAGE)[1]


def test_killed_sandbox_is_infra_failure_and_retried(live_run):
    import threading

    rt, collector, images = _collector(live_run)
    killed: list[str] = []
    stop = threading.Event()

    def killer() -> None:  # kill the first episode sandbox of this process that appears, mid-episode
        import docker.errors

        from infra.sandbox.docker_backend import OWNER_LABEL, owner_id

        # this process's own: another test worker's episodes share the engine (CI once killed a real-task
        # test's sandbox from here: container_vanished there, no victim here)
        mine = ["agentrl.episode", f"{OWNER_LABEL}={owner_id()}"]
        while not stop.is_set() and not killed:
            for c in rt.backend.client.containers.list(ignore_removed=True,
                                                       filters={"label": mine, "status": "running"}):
                try:
                    c.kill()
                except docker.errors.APIError:  # not running yet or already gone: try the next one
                    continue
                killed.append(c.labels["agentrl.episode"])
                break
            time.sleep(0.02)

    thread = threading.Thread(target=killer)
    thread.start()
    try:
        rows = collector.collect("fault-kill", 0, [rt.tasks["tb/hello-file"]], images)
    finally:
        stop.set()
        thread.join()
    assert len(killed) == 1
    (victim,) = [r for r in rows if r["episode_id"] == killed[0]]
    assert (victim["outcome"], victim["reason"], victim["attempt"]) == ("infra_failure", "container_vanished", 0)
    (retry,) = [r for r in rows if r["sample_index"] == victim["sample_index"] and r["attempt"] == 1]
    assert retry["outcome"] != "infra_failure" and retry["episode_id"] != victim["episode_id"]
    assert len(rows) == 3 and _left_behind(rt.backend, rows) == []


@pytest.mark.engine_exclusive
def test_engine_restart_mid_batch_completes_and_classifies(live_run):
    import threading

    from infra import services

    if "dockerd" not in services._running(services.state_path()):
        pytest.skip("dockerd was not started by `make up`; an external engine is never restarted")
    rt, collector, images = _collector(live_run, retries=2)
    restarted = threading.Event()

    def restart_when_busy() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if _episode_containers(rt.backend):
                    break
            except docker.errors.APIError:  # the listing raced an engine call; look again
                pass
            time.sleep(0.02)
        services.restart_engine(down_s=1.0)
        restarted.set()

    thread = threading.Thread(target=restart_when_busy)
    thread.start()
    try:
        rows = collector.collect("fault-restart", 0, [rt.tasks["tb/hello-file"], rt.tasks["tb/json-field"]], images)
    finally:
        thread.join()
    assert restarted.is_set()
    infra = [r for r in rows if r["outcome"] == "infra_failure"]
    assert infra, "the restart hit no episode"
    assert {r["reason"] for r in infra} <= {"engine_unreachable", "container_vanished", "docker_api_error",
                                           "sandbox_start_failed"}
    assert all(r["outcome"] in ("success", "model_failure", "unknown", "infra_failure") and r["reason"] for r in rows)
    final = {}
    for r in sorted(rows, key=lambda r: r["attempt"]):
        final[(r["group_id"], r["sample_index"])] = r
    assert len(final) == 4 and all(r["outcome"] != "infra_failure" for r in final.values())  # the batch completed
    assert _left_behind(rt.backend, rows) == []  # killed ones included


def test_failed_collection_is_not_served_from_cache_and_a_stored_one_is_reused(live_run, s3):
    """The rollout stage is persisted under a templated key (run id, step): idempotent, but never for failures."""
    from dataclasses import asdict

    from prefect import flow

    from tasks.rollouts import rollouts_for_step

    rt = live_run

    @flow
    def collect(task_ids: list[str]) -> dict:
        return asdict(rollouts_for_step(rt, task_ids, 7, []))

    with pytest.raises(KeyError, match="tb/no-such-task"):
        collect(["tb/no-such-task"])
    first = collect(["tb/hello-file"])  # the failure above is not served back: this one runs
    assert first["reused"] is False and first["rows"] == 2
    again = collect(["tb/hello-file"])
    assert again["reused"] is True and again["collected_at"] == first["collected_at"]
    s3.rm(first["uri"])  # the stored trajectories are gone: the stored result is not trusted
    third = collect(["tb/hello-file"])
    assert third["reused"] is False and third["collected_at"] > first["collected_at"]
    s3.invalidate_cache()
    assert s3.exists(third["uri"])
    s3.rm(third["uri"])


def _evaluate_in_subprocess(config, version: int) -> dict:
    """Run the evaluate flow in a fresh process (its own engine, in the config's dtype) on this Prefect server."""
    import os
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL

    code = ("import json, sys; from flows.evaluate import evaluate; from infra.config import RunConfig; "
            "r = evaluate(RunConfig.model_validate_json(sys.argv[1]), version=int(sys.argv[2])); "
            "print('REPORT=' + json.dumps({k: v for k, v in r.items() if k != 'per_task'}))")
    out = subprocess.run([sys.executable, "-c", code, config.model_dump_json(), str(version)], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.split("REPORT=", 1)[1].splitlines()[0])


def test_evaluate_flow_reuses_refuses_and_reevaluates_on_precision_change(evaluated_run, s3, monkeypatch):
    from flows.evaluate import evaluate
    from infra.evaluate import PrecisionMismatch
    from infra.run import Run

    config, _ = evaluated_run
    ckpt = f"agentrl/runs/{config.run_id}/checkpoints/v1"
    before = json.loads(s3.cat_file(f"{ckpt}/eval.json"))
    before_lineage = json.loads(s3.cat_file(f"{ckpt}/eval.json.lineage.json"))
    # same dtype and settings: the stored report is served, nothing re-runs
    again = evaluate(config, version=1)
    assert again["reused"] is True and again["evaluated_at"] == before["evaluated_at"]
    # another precision without leave: refused before anything loads (no run is opened)
    opened, real_open = [], Run.open
    monkeypatch.setattr(Run, "open", lambda config, **kw: opened.append(config) or real_open(config, **kw))
    bf16_eval = config.model_copy(update={"eval": config.eval.model_copy(update={"dtype": "bfloat16"})})
    with pytest.raises(PrecisionMismatch, match="set eval.allow_precision_mismatch"):
        evaluate(bf16_eval, version=1)
    assert opened == []
    monkeypatch.undo()
    # ... with leave: evaluated in bf16 (a fresh process), marked, stored apart; eval.json unchanged
    allowed = bf16_eval.model_copy(
        update={"eval": bf16_eval.eval.model_copy(update={"allow_precision_mismatch": True})})
    marked = _evaluate_in_subprocess(allowed, 1)
    assert (marked["dtype"], marked["serving_dtype"], marked["precision_mismatch"]) == ("bfloat16", "float32", True)
    s3.invalidate_cache()
    assert json.loads(s3.cat_file(f"{ckpt}/eval-bfloat16-not-serving.json"))["precision_mismatch"] is True
    assert json.loads(s3.cat_file(f"{ckpt}/eval.json"))["evaluated_at"] == before["evaluated_at"]
    # the serving precision changes: re-evaluated in it, the earlier report kept
    bf16_serving = config.model_copy(update={"model": config.model.model_copy(update={"serving_dtype": "bfloat16"})})
    redone = _evaluate_in_subprocess(bf16_serving, 1)
    assert redone["dtype"] == "bfloat16" and redone["precision_mismatch"] is False
    assert redone["reevaluated_because"] == "dtype float32 -> bfloat16"
    s3.invalidate_cache()
    assert json.loads(s3.cat_file(f"{ckpt}/eval.json"))["dtype"] == "bfloat16"
    assert json.loads(s3.cat_file(f"{ckpt}/eval-served-float32.json"))["evaluated_at"] == before["evaluated_at"]
    kept = json.loads(s3.cat_file(f"{ckpt}/eval-served-float32.json.lineage.json"))  # its lineage kept with it
    assert (kept["asset"], kept["inputs"], kept["properties"]["dtype"]) == (
        f"s3://{ckpt}/eval-served-float32.json", before_lineage["inputs"], "float32")
    assert json.loads(s3.cat_file(f"{ckpt}/eval.json.lineage.json"))["properties"]["dtype"] == "bfloat16"


def test_prefect_ui_shows_the_run_its_episodes_banner_and_lineage(finished_run, s3, checkout_server, tmp_path):
    """What a person sees, read from the pages headless Chromium renders from the checkout's server."""
    from infra.layout import artifact_key
    from tests.browser import Browser

    config, summaries = finished_run
    assert summaries[0]["rows_with_signal"] == 0  # the tiny random model solves nothing: a step that cannot learn
    api, ui = checkout_server, checkout_server.removesuffix("/api")
    shots = Path(os.environ.get("AGENTRL_UI_SHOTS", tmp_path))
    flow_run = httpx.get(f"{api}/flow_runs/{finished_run.flow_run_id}", timeout=10).json()
    assert flow_run["name"] == config.run_id and f"run:{config.run_id}" in flow_run["tags"]
    expected = {"build_envs", "collect_rollouts step 0", "train_step step 0", "publish_checkpoint step 0",
                "evaluate v1", "record_step step 0", "publish_step_episodes step 0"}
    deadline = time.monotonic() + 60  # task runs reach the server as events, recorded asynchronously
    while True:
        task_runs = httpx.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run["id"]]}}},
                               timeout=10).json()
        if expected <= {t["name"] for t in task_runs} or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert expected <= {t["name"] for t in task_runs}
    # the flow's own task runs: later tests of this module attach tasks of their own (versions >= 100, made
    # outside the flow) to this flow run's id
    own = [t for t in task_runs if not re.search(r" v1\d\d$", t["name"])]
    assert [t["name"] for t in own if f"run:{config.run_id}" not in t["tags"]] == []

    def artifact_id(suffix: str) -> str:
        found = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {
            "any_": [artifact_key(config.run_id, suffix)]}}}, timeout=10).json()
        return found[0]["id"]

    browser = Browser()
    try:
        text = browser.open(f"{ui}/runs/flow-run/{finished_run.flow_run_id}", until="Completed")
        browser.screenshot(shots / "flow-run.png")
        assert config.run_id in text and "Completed" in text, text[:2000]

        text = browser.open(f"{ui}/artifacts/artifact/{artifact_id('report')}", until="needs a look")
        browser.screenshot(shots / "report.png")
        assert "Step 0 needs a look" in text and "did not learn (rows_with_signal=0/" in text, text[:2000]

        text = browser.open(f"{ui}/artifacts/artifact/{artifact_id('episodes-step-0')}", until="Turn 1")
        browser.screenshot(shots / "episodes.png")
        assert "Episodes of step 0" in text and "Turn 1" in text, text[:2000]

        text = browser.open(f"{ui}/artifacts/artifact/{artifact_id('step-0-lineage')}", until="trajectories")
        browser.screenshot(shots / "lineage.png")
        traj = f"s3://agentrl/runs/{config.run_id}/trajectories/step-000000.parquet"
        assert traj in text and "docker://agentrl-task-" in text, text[:2000]
        assert "model://" in text and "(parent weights)" in text, text[:2000]  # v1's parent: the base model
        link = next(h for h in browser.links() if f"/agentrl/runs/{config.run_id}/trajectories/step-000000.parquet"
                    in h)
    finally:
        browser.close()
    fetched = httpx.get(link, timeout=30)  # the link opens the stored object itself
    assert fetched.status_code == 200 and fetched.content == s3.cat_file(traj)
