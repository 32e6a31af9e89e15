"""Anthropic's Messages API on the token-exact gateway, with the official ``anthropic`` SDK as the client.

Scripted engine and in-memory sandboxes (no services), as ``test_token_gateway``: what the engine received is
the reference, and the stored row must be made of exactly its prompt and sampled ids.
"""

from __future__ import annotations

import anthropic
import httpx
import numpy as np
import pytest

from tests.fakes import ScriptedEngine
from tests.integration.test_token_gateway import ClientHarness, chatml, run_episode, sampled
from tests.unit.test_episode import world

SYSTEM = "You are an agent."
USER = {"role": "user", "content": "Write hello to /app/hello.txt."}
BASH = {"name": "bash", "description": "run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


def anthropic_client(endpoint) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=endpoint.anthropic_base_url, api_key="unused", max_retries=0)


def run(tokenizer, tmp_path, replies, script, max_turns=5):
    """One episode; a turn may sample 256 tokens (a tool call is ~100 of the tiny tokenizer's)."""
    engine = ScriptedEngine(tokenizer, replies)
    harness = ClientHarness(script, anthropic_client)
    return run_episode(engine, world, harness, tmp_path, max_turns, max_tokens_per_turn=256), engine, harness


def _call(command: str) -> str:
    return '<tool_call>\n{"name": "bash", "arguments": {"command": "' + command + '"}}\n</tool_call>'


def test_an_agent_loop_of_tool_uses_stays_one_sequence_of_the_engines_ids(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, notes):
        messages = [USER]
        while True:  # an agent's loop: run each tool_use in the sandbox, send its output back as a tool_result
            reply = client.messages.create(model="claude-sonnet-4-5", max_tokens=256, system=SYSTEM,
                                           messages=messages, tools=[BASH])
            notes.append((reply.model, reply.stop_reason, [b.type for b in reply.content],
                          reply.usage.input_tokens, reply.usage.output_tokens))
            if reply.stop_reason != "tool_use":
                notes.append(reply.content[0].text)
                return
            (use,) = reply.content
            output = httpx.post(endpoint.exec_url, json={"command": use.input["command"]}, timeout=30).json()["output"]
            messages += [{"role": "assistant", "content": reply.content},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": output}]}]

    row, engine, harness = run(tiny_tokenizer, tmp_path, [_call("echo hello > /app/hello.txt"), _call("ls /app"),
                                                           "done"], script)
    *calls, text = harness.errors
    assert [c[:3] for c in calls] == [("claude-sonnet-4-5", "tool_use", ["tool_use"])] * 2 + [
        ("claude-sonnet-4-5", "end_turn", ["text"])] and text == "done"  # the asked-for model name is echoed
    assert [c[3:] for c in calls] == [(len(r.request.prompt_ids), len(r.sample.token_ids)) for r in engine.received]
    # the second command's output (the file the first one wrote) is in the third prompt, after the sampled ids
    third = engine.received[2].request.prompt_ids
    assert "<|im_start|>tool\nhello.txt" in tiny_tokenizer.decode(third)
    # each call continues the last prompt and its sampled ids: one sequence, the engine's ids only sampled
    for before, after in zip(engine.received, engine.received[1:], strict=False):
        prefix = before.request.prompt_ids + before.sample.token_ids
        assert after.request.prompt_ids[:len(prefix)] == prefix
    assert row["segment_starts"] == [0] and row["token_ids"] == third + sampled(engine, 2)
    mask = np.array(row["loss_mask"])
    assert list(np.array(row["token_ids"])[mask == 1]) == sampled(engine, 0) + sampled(engine, 1) + sampled(engine, 2)
    system = chatml(tiny_tokenizer, f"<|im_start|>system\n{SYSTEM}")  # the system field: the template's system turn
    assert engine.received[0].request.prompt_ids[:len(system)] == system


def test_streaming_gives_the_same_message_as_the_sdk_assembles_it(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, notes):
        with client.messages.stream(model="m", max_tokens=256, system=SYSTEM, messages=[USER], tools=[BASH]) as s:
            events = [e.type for e in s]
            message = s.get_final_message()
        notes.append(events)
        notes.append((message.stop_reason, [(b.type, getattr(b, "input", None)) for b in message.content],
                      message.usage.output_tokens))
        with client.messages.stream(model="m", max_tokens=256, system=SYSTEM,
                                    messages=[USER, {"role": "assistant", "content": message.content},
                                              {"role": "user", "content": [{"type": "tool_result",
                                                                            "tool_use_id": message.content[0].id,
                                                                            "content": "hello.txt"}]}],
                                    tools=[BASH]) as s:
            notes.append(s.get_final_text())

    row, engine, harness = run(tiny_tokenizer, tmp_path, [_call("ls /app"), "echo hello > /app/hello.txt"], script)
    events, (stop, blocks, out_tokens), text = harness.errors
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_stop" in events
    assert (stop, blocks, out_tokens) == ("tool_use", [("tool_use", {"command": "ls /app"})], len(sampled(engine, 0)))
    assert text == "echo hello > /app/hello.txt" and row["segment_starts"] == [0]


def test_count_tokens_and_models_answer_without_sampling(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, notes):
        counted = client.messages.count_tokens(model="m", system=SYSTEM, messages=[USER], tools=[BASH])
        notes.append(counted.input_tokens)
        notes.append([m.id for m in client.models.list()])
        notes.append([m["id"] for m in httpx.get(endpoint.base_url + "/models", timeout=10).json()["data"]])
        client.messages.create(model="m", max_tokens=16, system=SYSTEM, messages=[USER], tools=[BASH])

    row, engine, harness = run(tiny_tokenizer, tmp_path, ["ls"], script)
    # the count is the prompt the same request then sent to the engine; the count itself sampled nothing
    assert harness.errors[0] == len(engine.received[0].request.prompt_ids) and len(engine.received) == 1
    assert len(harness.errors[1]) == 1 and harness.errors[1] == harness.errors[2]  # one list, both SDKs' shapes


def test_a_side_models_calls_are_answered_by_the_policy_and_counted_but_not_in_the_row(tiny_tokenizer, tmp_path):
    """Claude Code's small-model calls (a title) interleave with its main loop; the row keeps the main loop only."""
    def script(client, io, endpoint, notes):
        notes.append(client.messages.create(model="policy", max_tokens=64, system=SYSTEM, messages=[USER],
                                            tools=[BASH]).content[0].text)
        title = client.messages.create(model="policy-side", max_tokens=16, system="Name this conversation.",
                                       messages=[USER])
        notes.append((title.model, title.content[0].text, title.usage.input_tokens))
        client.messages.count_tokens(model="policy", system=SYSTEM, messages=[USER], tools=[BASH])
        notes.append(client.messages.create(model="policy", max_tokens=64, system=SYSTEM, tools=[BASH], messages=[
            USER, {"role": "assistant", "content": notes[0]}, {"role": "user", "content": "go on"}]).content[0].text)

    engine = ScriptedEngine(tiny_tokenizer, ["ls", "Hello title", "done"])
    harness = ClientHarness(script, anthropic_client)
    harness.side_models = ("policy-side",)
    row = run_episode(engine, world, harness, tmp_path, 5, max_tokens_per_turn=256)
    first, (model, title, title_prompt), last = harness.errors
    assert (first, model, title, last) == ("ls", "policy-side", "Hello title", "done")
    side = engine.received[1]
    assert title_prompt == len(side.request.prompt_ids) and "Name this conversation." in tiny_tokenizer.decode(
        side.request.prompt_ids)
    # the main loop stays one sequence of its two calls; the side call's ids are nowhere in the row
    assert row["segment_starts"] == [0] and row["num_turns"] == 2 and row["side_calls"] == 2
    assert row["token_ids"] == engine.received[2].request.prompt_ids + sampled(engine, 2)
    mask = np.array(row["loss_mask"])
    assert list(np.array(row["token_ids"])[mask == 1]) == sampled(engine, 0) + sampled(engine, 2)


def test_bad_requests_get_anthropic_errors_and_record_nothing(tiny_tokenizer, tmp_path):
    def script(client, io, endpoint, notes):
        for kwargs in ({"messages": [USER]},  # no max_tokens
                       {"messages": [USER], "max_tokens": 8, "tools": [BASH], "tool_choice": {"type": "any"}},
                       {"messages": [{"role": "user", "content": [{"type": "image", "source": {
                           "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}], "max_tokens": 8}):
            with pytest.raises(anthropic.BadRequestError) as e:
                client.messages.create(model="m", **kwargs) if "max_tokens" in kwargs else client.post(
                    "/v1/messages", cast_to=object, body={"model": "m", **kwargs})
            notes.append((e.value.status_code, e.value.body["error"]["type"], e.value.body["error"]["message"][:80]))
        unknown = anthropic.Anthropic(base_url=endpoint.anthropic_base_url.replace(endpoint.key, "ep-nope"),
                                      api_key="x", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            unknown.messages.create(model="m", max_tokens=8, messages=[USER])
        notes.append(e.value.body["error"]["type"])
        # the key in x-api-key at the server's root, as Claude Code sends it with ANTHROPIC_API_KEY
        root = endpoint.anthropic_base_url.split("/e/")[0]
        keyed = anthropic.Anthropic(base_url=root, api_key=endpoint.key, max_retries=0)
        notes.append(keyed.messages.create(model="m", max_tokens=8, system=SYSTEM, messages=[USER]).content[0].text)
        notes.append(httpx.post(root + "/v1/embeddings", timeout=10).status_code)

    row, engine, harness = run(tiny_tokenizer, tmp_path, ["ls /app"], script)
    assert harness.errors[0][:2] == (400, "invalid_request_error") and "max_tokens" in harness.errors[0][2]
    assert harness.errors[1][:2] == (400, "invalid_request_error") and "tool_choice" in harness.errors[1][2]
    assert harness.errors[2][:2] == (400, "invalid_request_error") and "only text parts" in harness.errors[2][2]
    assert harness.errors[3] == "authentication_error"
    assert harness.errors[4] == "ls /app" and harness.errors[5] == 404
    assert len(engine.received) == 1  # only the good call reached the engine


def test_claude_codes_billing_header_does_not_break_the_sequence(tiny_tokenizer, tmp_path):
    """Claude Code's first system block varies per request; vLLM's conversion drops it, so turns still extend."""
    def script(client, io, endpoint, notes):
        first = client.messages.create(model="m", max_tokens=16, messages=[USER], system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=aaaa;"},
            {"type": "text", "text": SYSTEM}])
        client.messages.create(model="m", max_tokens=16, messages=[
            USER, {"role": "assistant", "content": first.content}, {"role": "user", "content": "and then?"}],
            system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=bbbb;"},
                    {"type": "text", "text": SYSTEM}])

    row, engine, _ = run(tiny_tokenizer, tmp_path, ["ls /app", "cat hello.txt"], script)
    assert row["segment_starts"] == [0]
    first = engine.received[0].request.prompt_ids
    assert first[:len(chatml(tiny_tokenizer, f"<|im_start|>system\n{SYSTEM}<|im_end|>"))] == chatml(
        tiny_tokenizer, f"<|im_start|>system\n{SYSTEM}<|im_end|>")
