"""The token-exact gateway over real HTTP (the ``openai`` client), with a scripted engine and in-memory sandboxes.

In tests/integration: no services needed.

What the engine received (``ScriptedEngine.received``) is the reference: stored rows must equal it
call by call. Expected ids are built from the ChatML template by hand, not from the gateway.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from infra.rollout.collector import Collector, CollectSettings
from infra.rollout.scheduler import EpisodeJob
from infra.store import validate_rows
from infra.train.trainer import split_segments
from tests.fakes import InMemoryBackend, Reply, ScriptedEngine
from tests.unit.test_episode import CODE_IMAGE, DIGEST, IMAGE, terminal_task, world

SYSTEM = {"role": "system", "content": "You are an agent."}
USER = {"role": "user", "content": "Write hello to /app/hello.txt."}


def openai_client(endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url, api_key="unused", max_retries=0)


class ClientHarness:
    """A harness driven by ``script(client, io, endpoint, errors)``; ``client``: an SDK client of the episode's
    endpoint, ``make_client(endpoint)`` (OpenAI's by default); ``errors`` collects what the script notes."""

    name = "client"
    tool_parser = "hermes"

    def __init__(self, script, make_client=openai_client):
        self.script, self.errors, self.make_client = script, [], make_client

    def act(self, io, max_turns):
        io.acquire()
        endpoint = io.open_gateway()
        try:
            self.script(self.make_client(endpoint), io, endpoint, self.errors)
            io.end("done")
        finally:
            io.close_gateway(endpoint)


def run_episode(engine, exec_fn, harness, tmp_path, max_turns=5, max_tokens_per_turn=64) -> dict:
    """One terminal episode of ``harness`` on ``engine`` and in-memory sandboxes answered by ``exec_fn``; its row."""
    settings = CollectSettings(group_size=1, temperature=0.7, top_p=0.95, max_tokens_per_turn=max_tokens_per_turn,
                               max_turns=max_turns, seed=0, max_infra_retries=0)
    c = Collector(engine, InMemoryBackend(exec_fn), settings, code_image=CODE_IMAGE, harness=harness)
    task = terminal_task(tmp_path)
    c.bind("run", 0, {task.task_id: (IMAGE, DIGEST)})
    try:
        row = c.run(EpisodeJob(f"run/0/{task.task_id}", task, 0, 0, 1234, 0))
    finally:
        c.close()
    validate_rows([row])
    return row


def run(tiny_tokenizer, tmp_path, replies, script, max_turns=5, max_model_len=2048):
    engine = ScriptedEngine(tiny_tokenizer, replies, max_model_len=max_model_len)
    harness = ClientHarness(script)
    return run_episode(engine, world, harness, tmp_path, max_turns), engine, harness


def sampled(engine, i):
    return engine.received[i].sample.token_ids


def chatml(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_a_history_that_extends_stays_one_sequence_built_from_the_sampled_ids(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, errors):
        first = client.chat.completions.create(model="policy", messages=[SYSTEM, USER])
        reply = first.choices[0].message
        assert first.choices[0].finish_reason == "stop" and reply.content == "ls /app"
        client.chat.completions.create(model="policy", messages=[SYSTEM, USER, reply.model_dump(exclude_none=True),
                                                                 {"role": "user", "content": "hello.txt"}])

    row, engine, _ = run(tiny_tokenizer, tmp_path, ["ls /app", "cat hello.txt"], script)
    tok = tiny_tokenizer
    first_prompt = chatml(tok, "<|im_start|>system\nYou are an agent.<|im_end|>\n<|im_start|>user\n"
                          "Write hello to /app/hello.txt.<|im_end|>\n<|im_start|>assistant\n")
    assert engine.received[0].request.prompt_ids == first_prompt
    # Call 2 continues call 1's prompt and sampled ids (EOS included) with the rest of the turn closing
    second = first_prompt + sampled(engine, 0) + chatml(tok, "\n<|im_start|>user\nhello.txt<|im_end|>\n"
                                                        "<|im_start|>assistant\n")
    assert engine.received[1].request.prompt_ids == second
    assert row["segment_starts"] == [0]
    assert row["token_ids"] == second + sampled(engine, 1)
    # The loss mask is 1 exactly on the ids the engine sampled, in both calls
    mask = np.array(row["loss_mask"])
    ids = np.array(row["token_ids"])
    assert list(ids[mask == 1]) == sampled(engine, 0) + sampled(engine, 1)
    assert (row["num_turns"], row["agent_end"], row["prompt_tokens"]) == (2, "done", len(first_prompt))


def test_a_rewritten_history_starts_a_new_segment_scored_as_the_engine_saw_it(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, errors):
        client.chat.completions.create(model="policy", messages=[SYSTEM, USER])
        # The harness summarised its history: not an extension of what was sent and returned
        client.chat.completions.create(model="policy", messages=[SYSTEM, {"role": "user", "content": "Summary: ls"}])

    row, engine, _ = run(tiny_tokenizer, tmp_path, ["ls /app", "echo hello > /app/hello.txt"], script)
    seg0 = engine.received[0].request.prompt_ids + sampled(engine, 0)
    seg1 = engine.received[1].request.prompt_ids + sampled(engine, 1)
    assert engine.received[1].request.prompt_ids[:len(seg0)] != seg0
    assert row["segment_starts"] == [0, len(seg0)]
    assert row["token_ids"] == seg0 + seg1
    rows, adv, origin = split_segments([row], np.array([0.5]))
    assert [r["token_ids"] for r in rows] == [seg0, seg1] and list(adv) == [0.5, 0.5] and origin == [0, 0]
    assert [sum(r["loss_mask"]) for r in rows] == [len(sampled(engine, 0)), len(sampled(engine, 1))]
    assert all(r["segment_starts"] == [0] for r in rows)


def test_tool_calls_are_parsed_by_vllms_parser_and_their_turn_still_extends(tiny_tokenizer, tmp_path):
    tools = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                               "parameters": {"type": "object",
                                                              "properties": {"command": {"type": "string"}}}}}]
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls /app"}}\n</tool_call>'

    def script(client, io, endpoint, errors):
        first = client.chat.completions.create(model="policy", messages=[SYSTEM, USER], tools=tools)
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
            ("bash", {"command": "ls /app"})]
        client.chat.completions.create(model="policy", tools=tools, messages=[
            SYSTEM, USER, msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "hello.txt"}])

    row, engine, _ = run(tiny_tokenizer, tmp_path, [call, "done"], script)
    first = engine.received[0].request.prompt_ids + sampled(engine, 0)
    assert engine.received[1].request.prompt_ids[:len(first)] == first
    assert row["segment_starts"] == [0]


def test_streaming_returns_the_same_reply(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, errors):
        chunks = list(client.chat.completions.create(model="policy", messages=[SYSTEM, USER], stream=True,
                                                     stream_options={"include_usage": True}))
        errors.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        errors.append([c.choices[0].finish_reason for c in chunks if c.choices][-1])
        errors.append(chunks[-1].usage.completion_tokens)

    row, engine, harness = run(tiny_tokenizer, tmp_path, ["ls /app"], script)
    assert harness.errors == ["ls /app", "stop", len(sampled(engine, 0))]


def test_bad_requests_get_openai_errors_and_record_nothing(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, errors):
        for kwargs in ({"messages": []}, {"messages": [USER], "n": 2}, {"messages": [{"content": "no role"}]},
                       {"messages": [USER], "logit_bias": {"1": 5}}):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="policy", **kwargs)
            errors.append((e.value.status_code, e.value.body.get("code"), e.value.body["message"][:30]))
        bad = httpx.post(endpoint.base_url + "/chat/completions", content=b"{not json", timeout=10)
        errors.append((bad.status_code, bad.json()["error"]["message"][:30]))
        unknown = openai.OpenAI(base_url=endpoint.base_url.replace(endpoint.key, "ep-nope"), api_key="x",
                                max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            unknown.chat.completions.create(model="policy", messages=[USER])
        errors.append(e.value.body["message"][:25])
        client.chat.completions.create(model="policy", messages=[SYSTEM, USER])  # the run goes on

    row, engine, harness = run(tiny_tokenizer, tmp_path, ["ls /app"], script)
    assert harness.errors[0][:2] == (400, None)
    assert harness.errors[1] == (400, "unsupported_parameter", "unsupported parameter 'n'=2: t")
    assert harness.errors[2][0] == 400 and harness.errors[3][1] == "unsupported_parameter"
    assert harness.errors[4] == (400, "the request body is not valid ")
    assert harness.errors[5] == "unknown episode key 'ep-n"
    assert len(engine.received) == 1 and row["token_ids"] == engine.received[0].request.prompt_ids + sampled(engine, 0)


def test_the_runner_enforces_max_turns_and_the_context_window(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, errors):
        for _ in range(3):
            try:
                client.chat.completions.create(model="policy", messages=[SYSTEM, USER])
            except openai.BadRequestError as e:
                errors.append(e.body["code"])

    row, engine, harness = run(tiny_tokenizer, tmp_path, ["a", "b", "c"], script, max_turns=2)
    assert len(engine.received) == 2 and harness.errors == ["episode_ended"] and row["agent_end"] == "max_turns"

    def long(client, io, endpoint, errors):
        try:
            client.chat.completions.create(model="policy", messages=[SYSTEM, {"role": "user", "content": "x " * 300}])
        except openai.BadRequestError as e:
            errors.append((e.body["code"], e.body["message"][:40]))

    row, engine, harness = run(tiny_tokenizer, tmp_path, ["a"], long, max_model_len=128)
    assert harness.errors == [("context_length_exceeded", "This model's maximum context length is 1")]
    assert row["agent_end"] == "context_full" and not engine.received


def test_sandbox_exec_runs_in_the_episodes_shell_until_it_ends(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, errors):
        r = httpx.post(endpoint.exec_url, json={"command": "echo hello > /app/hello.txt"}, timeout=30).json()
        errors.append((r["exit_code"], r["timed_out"]))
        io.end("done")
        r = httpx.post(endpoint.exec_url, json={"command": "ls /app"}, timeout=30)
        errors.append((r.status_code, r.json()["error"]["code"]))

    row, engine, harness = run(tiny_tokenizer, tmp_path, [], script)
    assert harness.errors == [(0, False), (409, "episode_ended")]
    assert row["commands"] == ["echo hello > /app/hello.txt"] and (row["outcome"], row["reward"]) == ("success", 1.0)


def test_sandbox_exec_without_the_shell_runs_its_own_bash_c(tiny_tokenizer, tmp_path):
    """``"shell": false`` (Terminus-2's environment): each command on its own, as Harbor's environments run it."""
    def script(client, io, endpoint, errors):
        r = httpx.post(endpoint.exec_url, json={"command": "echo hello > /app/hello.txt", "shell": False}, timeout=30)
        errors.append(r.json()["exit_code"])
        r = httpx.post(endpoint.exec_url, json={"command": "ls", "shell": "no"}, timeout=30)
        errors.append((r.status_code, r.json()["error"]["param"]))
        box = io.e.sandbox
        errors.append((box.shell, [c for c, _, workdir in box.execs if workdir is None]))

    row, engine, harness = run(tiny_tokenizer, tmp_path, [], script)
    assert harness.errors == [0, (400, "shell"), ([], ["echo hello > /app/hello.txt"])]
    assert row["commands"] == ["echo hello > /app/hello.txt"] and (row["outcome"], row["reward"]) == ("success", 1.0)


def test_split_segments_keeps_single_segment_rows_and_repeats_the_advantage():
    from tests.helpers import make_row

    one, two = make_row(), make_row(episode_id="e1", segment_starts=[0, 2])
    rows, adv, origin = split_segments([one, two], np.array([1.0, -1.0]))
    assert rows[0] is one and [r["token_ids"] for r in rows[1:]] == [[1, 2], [3, 4]]
    assert list(adv) == [1.0, -1.0, -1.0] and origin == [0, 1, 1]


def test_reply_with_stop_strings_is_passed_to_the_engine(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, errors):
        client.chat.completions.create(model="policy", messages=[SYSTEM, USER], stop=["</cmd>"], max_tokens=10)

    row, engine, _ = run(tiny_tokenizer, tmp_path, [Reply("ls /app")], script)
    assert engine.received[0].request.stop == ("</cmd>",) and engine.received[0].request.max_tokens == 10


def test_a_row_that_ended_before_its_first_call_yields_no_sequence():
    from tests.helpers import make_row

    empty = make_row(token_ids=[], loss_mask=[], rollout_logprobs=[], policy_versions=[], min_policy_version=-1,
                     max_policy_version=-1)
    rows, adv, origin = split_segments([empty, make_row()], np.array([-0.5, 0.5]))
    assert len(rows) == 1 and list(adv) == [0.5] and origin == [1]


def test_per_token_versions_stay_exact_across_a_weight_update_between_calls(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, errors):
        first = client.chat.completions.create(model="policy", messages=[SYSTEM, USER])
        io.runner.engine.policy_version = 1  # the scheduler's "pause" update lands between two calls
        client.chat.completions.create(model="policy", messages=[
            SYSTEM, USER, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "ok"}])

    row, engine, _ = run(tiny_tokenizer, tmp_path, ["ls /app", "cat hello.txt"], script)
    versions = [v for v, m in zip(row["policy_versions"], row["loss_mask"], strict=True) if m]
    assert versions == [0] * len(sampled(engine, 0)) + [1] * len(sampled(engine, 1))
    assert (row["min_policy_version"], row["max_policy_version"]) == (0, 1)


def test_parameters_that_change_sampling_are_refused_and_odd_values_get_400s(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, errors):
        url = endpoint.base_url + "/chat/completions"
        for extra in ({"tool_choice": "required"}, {"min_tokens": 5}, {"ignore_eos": True}, {"max_tokens": -5},
                      {"max_tokens": 0}, {"chat_template": "{{ x }}"},
                      {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}):
            r = httpx.post(url, json={"model": "policy", "messages": [SYSTEM, USER], **extra}, timeout=30)
            errors.append((r.status_code, r.json()["error"]["param"]))
        r = httpx.post(endpoint.exec_url, json={"command": "ls /app", "timeout_s": "abc"}, timeout=30)
        errors.append((r.status_code, r.json()["error"]["param"]))
        r = httpx.post(endpoint.base_url + "/embeddings", json={}, timeout=30)
        errors.append((r.status_code, r.json()["error"]["code"]))
        client.chat.completions.create(model="policy", messages=[SYSTEM, USER], max_tokens=10)  # the run goes on

    row, engine, harness = run(tiny_tokenizer, tmp_path, ["ls /app"], script)
    assert harness.errors == [(400, "tool_choice"), (400, "min_tokens"), (400, "ignore_eos"), (400, "max_tokens"),
                              (400, "max_tokens"), (400, "chat_template"), (400, "messages.0.content"),
                              (400, "timeout_s"), (404, "not_found")]
    assert len(engine.received) == 1 and row["outcome"] != "infra_failure" and not row["commands"]


def test_a_call_in_flight_when_the_harness_stops_is_recorded_before_the_row(tiny_tokenizer, tmp_path):
    import threading
    import time

    def slow(episode, turn, request):
        time.sleep(1.0)
        return "ls /app"

    def script(client, io, endpoint, errors):
        t = threading.Thread(target=lambda: client.chat.completions.create(model="policy", messages=[SYSTEM, USER]))
        t.start()
        time.sleep(0.3)  # the harness returns with its call still in the engine

    row, engine, _ = run(tiny_tokenizer, tmp_path, slow, script)
    assert len(engine.received) == 1
    assert row["token_ids"] == engine.received[0].request.prompt_ids + sampled(engine, 0) and row["num_turns"] == 1
