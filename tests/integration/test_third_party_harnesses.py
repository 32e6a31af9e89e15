"""Third-party harnesses train through ``post_train``: mini-swe-agent from PyPI, unmodified, behind the gateway.

Real dockerd, SeaweedFS, vLLM (in-process, a tiny random Llama), DeepSpeed and the harness's own
venv. Token exactness is asserted from the engine's side: vLLM's own ``RequestOutput`` ids, written
by the engine to ``AGENTRL_ENGINE_RECORD``, not from the gateway's bookkeeping.
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from infra.config import EvalConfig, MiniSweAgentHarnessConfig, ModelConfig, RolloutConfig, RunConfig, TaskSetConfig
from infra.store import read_step

pytestmark = pytest.mark.integration

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def action(command: str) -> str:
    """A reply in mini-swe-agent's text-based format (mini_textbased.yaml)."""
    return f"THOUGHT: next step.\n\n```mswea_bash_command\n{command}\n```"


def scripted_episode(tiny_tokenizer, tmp_path, replies, harness, max_turns=5):
    """One episode of the real harness against a scripted engine and an in-memory sandbox (``tests.fakes``)."""
    from envs.harnesses.mini_swe_agent import MiniSweAgentHarness
    from tests.fakes import ScriptedEngine
    from tests.integration.test_token_gateway import run_episode
    from tests.unit.test_episode import world

    def sandbox(box, command):
        if command == SUBMIT:
            return (0, "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n", 0.0, False)
        return world(box, command)

    engine = ScriptedEngine(tiny_tokenizer, replies, max_model_len=4096)
    harness = harness or MiniSweAgentHarness(wall_timeout_s=120)
    row = run_episode(engine, sandbox, harness, tmp_path, max_turns=max_turns, max_tokens_per_turn=400)
    return row, engine, harness


def test_mini_swe_agent_acts_in_the_sandbox_until_it_submits(tiny_tokenizer, tmp_path):
    row, engine, harness = scripted_episode(tiny_tokenizer, tmp_path, [action("echo hello > /app/hello.txt"),
                                                                       action(SUBMIT)], None)
    assert (row["outcome"], row["reward"], row["agent_end"]) == ("success", 1.0, "done"), harness.last_output
    assert row["commands"] == ["echo hello > /app/hello.txt", SUBMIT] and row["segment_starts"] == [0]
    # one sequence: call 2's prompt is call 1's prompt and sampled ids, then the observation's template ids
    first = engine.received[0].request.prompt_ids + engine.received[0].sample.token_ids
    assert engine.received[1].request.prompt_ids[:len(first)] == first
    assert row["token_ids"] == engine.received[1].request.prompt_ids + engine.received[1].sample.token_ids


def test_a_reply_mini_swe_agent_cannot_parse_is_its_own_turn_and_starts_a_segment(tiny_tokenizer, tmp_path):
    # upstream's handling: a format-error message, the unparsable reply left out of its history (so the next
    # call does not extend the last one: a new segment), and the episode goes on as a model outcome
    row, engine, harness = scripted_episode(tiny_tokenizer, tmp_path, ["no action here",
                                                                       action("echo hello > /app/hello.txt"),
                                                                       action(SUBMIT)], None)
    assert (row["outcome"], row["reward"], row["num_turns"]) == ("success", 1.0, 3), harness.last_output
    first = engine.received[0].request.prompt_ids + engine.received[0].sample.token_ids
    assert row["segment_starts"] == [0, len(first)]
    assert "EXACTLY ONE action" in tiny_tokenizer.decode(engine.received[1].request.prompt_ids)


def test_a_harness_that_crashes_is_an_infra_failure(tiny_tokenizer, tmp_path):
    from envs.harnesses.mini_swe_agent import MiniSweAgentHarness

    row, engine, harness = scripted_episode(tiny_tokenizer, tmp_path, [action("ls /app")],
                                            MiniSweAgentHarness(config="no-such-config.yaml", wall_timeout_s=120))
    assert (row["outcome"], row["reason"]) == ("infra_failure", "harness_error") and not engine.received
    assert "no-such-config" in harness.last_output


def test_the_runner_stops_a_harness_past_its_turns(tiny_tokenizer, tmp_path):
    row, engine, harness = scripted_episode(tiny_tokenizer, tmp_path, [action("ls /app")] * 3, None, max_turns=2)
    assert row["agent_end"] == "max_turns" and row["num_turns"] == 2 and len(engine.received) == 2
    assert row["outcome"] == "model_failure"  # verified: the hidden test fails


def sampled_runs(row: dict, calls: set[tuple[tuple[int, ...], tuple[int, ...]]]) -> int:
    """Assert each run of ``row``'s sampled ids is one engine call of ``calls`` ((prompt ids, output ids)): its
    prompt is the segment before it, its output the run. Returns how many runs the row holds."""
    ids, mask = np.array(row["token_ids"]), np.array(row["loss_mask"])
    bounds, runs = [*row["segment_starts"], len(ids)], 0
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        seg, m = ids[lo:hi], mask[lo:hi]
        edges = np.flatnonzero(np.diff(np.concatenate([[0], m, [0]])))
        for start, end in zip(edges[::2], edges[1::2], strict=True):
            assert (tuple(seg[:start].tolist()), tuple(seg[start:end].tolist())) in calls
            runs += 1
    return runs


def recorded_post_train(s3, tmp_path_factory, run_id: str, max_positions: int, rollout: RolloutConfig):
    """One post_train step on a tiny Llama of ``max_positions`` context, vLLM recording every call.

    Returns ``(config, summaries, calls, rows)``: ``calls`` from the engine's own record
    (``AGENTRL_ENGINE_RECORD``), ``rows`` the stored step.
    """
    import os

    from flows.post_train import post_train
    from infra.model import build_tiny_llama

    tiny_model = build_tiny_llama(tmp_path_factory.mktemp("models") / f"tiny-llama-{max_positions}",
                                  max_positions=max_positions)
    record = tmp_path_factory.mktemp("engine") / "record.jsonl"
    os.environ["AGENTRL_ENGINE_RECORD"] = str(record)
    config = RunConfig(
        run_id=run_id, steps=1,
        model=ModelConfig(path=str(tiny_model), max_model_len=max_positions, kv_cache_gib=1.0),
        tasks=TaskSetConfig(task_sets=["envs/harbor/write-greeting"], humaneval_train=0, humaneval_eval=0),
        rollout=rollout, eval=EvalConfig(enabled=False),
    )
    try:
        summaries = post_train(config)
    finally:
        os.environ.pop("AGENTRL_ENGINE_RECORD", None)
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    rows = read_step(s3, f"s3://agentrl/runs/{config.run_id}/trajectories/step-000000.parquet").to_pylist()
    return config, summaries, calls, rows


@pytest.fixture(scope="module")
def mini_swe_agent_run(s3, tmp_path_factory, prefect_harness):
    """One post_train step with mini-swe-agent acting on a shipped Harbor task and the shipped Terminal-Bench tasks.

    The tiny Llama's tokenizer (vocab 512) spends ~2,100 tokens on mini-swe-agent's own prompt: its context is 4k.
    """
    return recorded_post_train(s3, tmp_path_factory, f"msa-{uuid.uuid4().hex[:8]}", 4096, RolloutConfig(
        tasks_per_step=2, group_size=2, max_tokens_per_turn=24, max_turns=2,
        harness=MiniSweAgentHarnessConfig(wall_timeout_s=300)))


def test_mini_swe_agent_rows_equal_what_the_engine_received_and_sampled(mini_swe_agent_run):
    config, summaries, calls, rows = mini_swe_agent_run
    ran = [r for r in rows if r["outcome"] != "infra_failure"]
    assert ran, [(r["outcome"], r["reason"]) for r in rows]
    engine_side = {(tuple(c["prompt_ids"]), tuple(c["token_ids"])) for c in calls}
    for r in ran:
        assert sampled_runs(r, engine_side) == r["num_turns"] >= 1
        assert {v for v, k in zip(r["policy_versions"], r["loss_mask"], strict=True) if k} == {0}
    # upstream's loop ran: its prompt (mini_textbased.yaml's system template) is what the engine received first
    from transformers import AutoTokenizer

    first = AutoTokenizer.from_pretrained(config.model.path).decode(calls[0]["prompt_ids"])
    assert "mswea_bash_command" in first and "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in first
    [s] = summaries
    assert s["rows_trained"] >= 1
    print("mini-swe-agent rows:", [(r["task_id"], r["outcome"], r["agent_end"], r["num_turns"],
                                    len(r["segment_starts"]), len(r["token_ids"])) for r in rows],
          "engine calls:", len(calls),
          "rows_trained:", s["rows_trained"], "segments_trained:", s.get("segments_trained"))


def terminus(keystrokes: list[str], complete: bool = False) -> str:
    """A reply in Terminus-2's JSON format (harbor's terminus-json-plain.txt)."""
    return json.dumps({"analysis": "Looking.", "plan": "Next step.", "task_complete": complete,
                       "commands": [{"keystrokes": k, "duration": 0.1} for k in keystrokes]})


def docker_episode(backend, tiny_tokenizer, tmp_path, replies, harness, max_turns=5, max_model_len=8192):
    """One episode of the real harness against a scripted engine, in a real sandbox (the base image)."""
    from infra.environments import BASE_IMAGE
    from infra.rollout.collector import Collector, CollectSettings
    from infra.rollout.scheduler import EpisodeJob
    from infra.store import validate_rows
    from tests.fakes import ScriptedEngine
    from tests.unit.test_episode import CODE_IMAGE, terminal_task

    engine = ScriptedEngine(tiny_tokenizer, replies, max_model_len=max_model_len)
    settings = CollectSettings(group_size=1, temperature=0.7, top_p=0.95, max_tokens_per_turn=400,
                               max_turns=max_turns, seed=0, max_infra_retries=0)
    c = Collector(engine, backend, settings, code_image=CODE_IMAGE, harness=harness)
    task = terminal_task(tmp_path, verifier="harbor")
    c.bind("run", 0, {task.task_id: (BASE_IMAGE, backend.image_digest(BASE_IMAGE))})
    try:
        row = c.run(EpisodeJob(f"run/0/{task.task_id}", task, 0, 0, 1234, 0))
    finally:
        c.close()
    validate_rows([row])
    return row, engine


@pytest.fixture(scope="module")
def terminus_2():
    from envs.harnesses.terminus_2 import Terminus2Harness

    return Terminus2Harness(wall_timeout_s=300, enable_summarize=False)


def test_terminus_2_types_into_its_tmux_session_until_it_confirms_completion(backend, tiny_tokenizer, tmp_path,
                                                                             terminus_2):
    # seq: more scrollback than the shell's 16 KiB output cap; Terminus-2 reads all of it (capture-pane -S -)
    replies = [terminus(["mkdir -p /app && seq 1 6000 && echo hello > /app/hello.txt\n"]),
               # upstream asks "Are you sure?" once: the second task_complete ends it
               terminus(["cat /app/hello.txt\n"], complete=True), terminus([], complete=True)]
    row, engine = docker_episode(backend, tiny_tokenizer, tmp_path, replies, terminus_2)
    assert (row["outcome"], row["reward"], row["agent_end"]) == ("success", 1.0, "done"), (row["commands"],
                                                                                     terminus_2.last_output)
    assert len(engine.received) == 3 and row["num_turns"] == 3
    # upstream's loop: its prompt, its tmux session (keystrokes sent with send-keys), its confirmation question
    prompts = [tiny_tokenizer.decode(r.request.prompt_ids) for r in engine.received]
    assert "Format your response as JSON" in prompts[0] and "Are you sure you want to mark" in prompts[2]
    assert "cat /app/hello.txt\nhello" in prompts[2].rsplit("<|im_start|>user", 1)[1]  # what turn 2's command printed
    assert any("send-keys" in c and "hello.txt" in c for c in row["commands"])
    # every sampled run is one engine call, whose prompt is the segment before it
    calls = {(tuple(r.request.prompt_ids), tuple(r.sample.token_ids)) for r in engine.received}
    assert sampled_runs(row, calls) == 3


def test_terminus_2_trains_through_post_train_token_exact(s3, tmp_path_factory, prefect_harness):
    """One post_train step with Terminus-2 on a shipped Harbor task: rows equal what vLLM received and sampled."""
    from infra.config import Terminus2HarnessConfig

    rollout = RolloutConfig(tasks_per_step=1, group_size=2, max_tokens_per_turn=24, max_turns=2,
                            harness=Terminus2HarnessConfig(wall_timeout_s=300, enable_summarize=False))
    config, [summary], calls, rows = recorded_post_train(s3, tmp_path_factory, f"t2-{uuid.uuid4().hex[:8]}", 8192,
                                                         rollout)
    ran = [r for r in rows if r["outcome"] != "infra_failure"]
    assert ran, [(r["outcome"], r["reason"]) for r in rows]
    engine_side = {(tuple(c["prompt_ids"]), tuple(c["token_ids"])) for c in calls}
    for r in ran:
        assert sampled_runs(r, engine_side) == r["num_turns"] >= 1 and r["agent_end"] in ("max_turns", "done")
    from transformers import AutoTokenizer

    first = AutoTokenizer.from_pretrained(config.model.path).decode(calls[0]["prompt_ids"])
    assert "Format your response as JSON" in first  # upstream's own prompt (terminus-json-plain.txt)
    assert summary["rows_trained"] >= 1
    print("terminus-2 rows:", [(r["task_id"], r["outcome"], r["agent_end"], r["num_turns"], len(r["segment_starts"]),
                                len(r["token_ids"])) for r in rows], "engine calls:", len(calls),
          "rows_trained:", summary["rows_trained"], "segments_trained:", summary.get("segments_trained"))
