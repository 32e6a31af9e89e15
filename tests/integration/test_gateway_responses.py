"""OpenAI's Responses API on the token-exact gateway, with the official ``openai`` SDK as the client.

Scripted engine and in-memory sandboxes (no services), as ``test_token_gateway``: what the engine received is
the reference, and the stored row must be made of exactly its prompt and sampled ids.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from tests.fakes import ScriptedEngine
from tests.integration.test_token_gateway import ClientHarness, chatml, run_episode, sampled
from tests.unit.test_episode import world

INSTRUCTIONS = "You are an agent."
USER = {"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "Write hello to /app/hello.txt."}]}
SHELL = {"type": "function", "name": "shell", "description": "run a command", "strict": False,
         "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


def _call(command: str) -> str:
    return '<tool_call>\n{"name": "shell", "arguments": {"command": "' + command + '"}}\n</tool_call>'


def run(tokenizer, tmp_path, replies, script, max_turns=5):
    """One episode; a turn may sample 256 tokens (a tool call is ~100 of the tiny tokenizer's)."""
    engine = ScriptedEngine(tokenizer, replies)
    harness = ClientHarness(script)
    return run_episode(engine, world, harness, tmp_path, max_turns, max_tokens_per_turn=256), engine, harness


def _shell(endpoint, command: str) -> str:
    return httpx.post(endpoint.exec_url, json={"command": command}, timeout=30).json()["output"]


def test_a_codex_style_loop_resending_its_input_stays_one_sequence(tiny_tokenizer, tmp_path):
    """As Codex CLI sends it: ``store: false``, the whole input each time, a developer message first."""
    def script(client, io, endpoint, notes):
        items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "cwd: /app"}]},
                 USER]
        while True:
            r = client.responses.create(model="gpt-5-codex", instructions=INSTRUCTIONS, input=items, tools=[SHELL],
                                        tool_choice="auto", parallel_tool_calls=False, store=False,
                                        max_output_tokens=256)
            notes.append((r.model, r.status, [o.type for o in r.output], r.usage.input_tokens, r.usage.output_tokens))
            calls = [o for o in r.output if o.type == "function_call"]
            if not calls:
                notes.append(r.output_text)
                return
            for call in calls:
                items += [call.model_dump(exclude_none=True),
                          {"type": "function_call_output", "call_id": call.call_id,
                           "output": _shell(endpoint, json.loads(call.arguments)["command"])}]

    replies = [_call("echo hello > /app/hello.txt"), _call("ls /app"), "done"]
    row, engine, harness = run(tiny_tokenizer, tmp_path, replies, script)
    *calls, text = harness.errors
    assert [c[:3] for c in calls] == [("gpt-5-codex", "completed", ["function_call"])] * 2 + [
        ("gpt-5-codex", "completed", ["message"])] and text == "done"
    assert [c[3:] for c in calls] == [(len(r.request.prompt_ids), len(r.sample.token_ids)) for r in engine.received]
    third = engine.received[2].request.prompt_ids
    assert "<|im_start|>tool\nhello.txt" in tiny_tokenizer.decode(third)  # the second command's output
    for before, after in zip(engine.received, engine.received[1:], strict=False):  # each call extends the last
        prefix = before.request.prompt_ids + before.sample.token_ids
        assert after.request.prompt_ids[:len(prefix)] == prefix
    assert row["segment_starts"] == [0] and row["token_ids"] == third + sampled(engine, 2)
    mask = np.array(row["loss_mask"])
    assert list(np.array(row["token_ids"])[mask == 1]) == sampled(engine, 0) + sampled(engine, 1) + sampled(engine, 2)
    opening = chatml(tiny_tokenizer, f"<|im_start|>system\n{INSTRUCTIONS}<|im_end|>\n<|im_start|>developer\ncwd: /app")
    assert engine.received[0].request.prompt_ids[:len(opening)] == opening  # instructions, then the developer item


def test_previous_response_id_continues_the_episodes_conversation(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, notes):
        first = client.responses.create(model="m", instructions=INSTRUCTIONS, input=[USER], tools=[SHELL])
        (call,) = first.output
        second = client.responses.create(model="m", instructions=INSTRUCTIONS, previous_response_id=first.id,
                                         tools=[SHELL], input=[{"type": "function_call_output", "call_id": call.call_id,
                                                                "output": _shell(endpoint, "ls /app")}])
        notes.append((second.previous_response_id == first.id, second.output_text))
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="m", previous_response_id="resp_nope", input="and then?")
        notes.append((e.value.body["code"], e.value.body["param"]))

    row, engine, harness = run(tiny_tokenizer, tmp_path, [_call("ls /app"), "done"], script)
    assert harness.errors == [(True, "done"), ("previous_response_not_found", "previous_response_id")]
    first = engine.received[0].request.prompt_ids + sampled(engine, 0)
    assert engine.received[1].request.prompt_ids[:len(first)] == first and row["segment_starts"] == [0]
    assert len(engine.received) == 2  # the refused call reached no engine


def test_streaming_gives_the_events_the_sdk_assembles_into_the_same_response(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, notes):
        events = list(client.responses.create(model="m", instructions=INSTRUCTIONS, input=[USER], tools=[SHELL],
                                              stream=True))
        notes.append([e.type for e in events])
        done = events[-1].response
        notes.append((done.status, [(o.type, o.name, o.arguments) for o in done.output]))
        with client.responses.stream(model="m", instructions=INSTRUCTIONS, previous_response_id=done.id,
                                     tools=[SHELL], input=[{"type": "function_call_output",
                                                            "call_id": done.output[0].call_id, "output": ""}]) as s:
            notes.append(s.get_final_response().output_text)

    row, engine, harness = run(tiny_tokenizer, tmp_path, [_call("ls /app"), "all done"], script)
    types, (status, output), text = harness.errors
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    assert (status, output) == ("completed", [("function_call", "shell", '{"command": "ls /app"}')])
    assert types.count("response.output_item.done") == 1
    assert text == "all done" and row["segment_starts"] == [0]


def test_requests_that_change_sampling_or_are_malformed_get_openai_errors(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, notes):
        for kwargs in ({"input": [USER], "tools": [SHELL], "tool_choice": "required"},
                       {"input": [USER], "top_logprobs": 5},
                       {"input": [USER], "text": {"format": {"type": "json_object"}}},
                       {"input": [{"type": "message", "role": "user", "content": [
                           {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}):
            with pytest.raises(openai.BadRequestError) as e:
                client.responses.create(model="m", **kwargs)
            notes.append((e.value.status_code, e.value.body.get("code"), e.value.body["message"][:60]))
        notes.append(client.responses.create(model="m", input="hi", reasoning={"effort": "low"}).output_text)

    row, engine, harness = run(tiny_tokenizer, tmp_path, ["ls /app"], script)
    assert [n[:2] for n in harness.errors[:3]] == [(400, "unsupported_parameter")] * 3
    assert "tool_choice" in harness.errors[0][2] and "top_logprobs" in harness.errors[1][2]
    assert harness.errors[3][0] == 400 and harness.errors[4] == "ls /app" and len(engine.received) == 1
