"""Claude Code and Codex CLI from npm, unmodified, inside the task's sandbox, through the gateway.

Real dockerd, the agents' published linux-x64 builds (``npm pack``, cached outside the checkout), the
sandbox's channel to the gateway (``agentrl-egress``), a scripted engine answering with hermes tool calls
(``tests.fakes.ScriptedEngine``); then one ``post_train`` step per CLI with vLLM and DeepSpeed on a tiny
Llama, its rows checked against the engine's own record of every call.
"""

from __future__ import annotations

import json
import uuid

import pytest

from tests.integration.test_third_party_harnesses import docker_episode, recorded_post_train, sampled_runs

pytestmark = pytest.mark.integration

WRITE = "mkdir -p /app && echo hello > /app/hello.txt && echo wrote-$((6*7))"
CONTEXT = 131072  # the scripted engine's: the CLIs' prompts are long in the tiny Llama's 512-token vocabulary


def tool_call(name: str, arguments: dict) -> str:
    """A hermes tool call (the gateway's ``tool_parser = "hermes"`` turns it into the format's tool use)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def agent_backend(harness):
    from infra.sandbox.docker_backend import DockerBackend

    harness.prepare()
    return DockerBackend(agent_mounts=harness.mounts(), agent_channel=True)


@pytest.fixture(scope="module")
def claude_code(services_env):
    from envs.harnesses.installed import ClaudeCodeHarness

    harness = ClaudeCodeHarness("2.1.328", wall_timeout_s=300)
    return harness, agent_backend(harness)


@pytest.fixture(scope="module")
def codex(services_env):
    from envs.harnesses.installed import CodexHarness

    harness = CodexHarness("0.169.0", wall_timeout_s=300)
    return harness, agent_backend(harness)


def check_one_sequence(engine, row, n_calls):
    """Every call extended the previous one, and each sampled run of ids is one engine call."""
    assert len(engine.received) == n_calls and row["num_turns"] == n_calls
    assert row["segment_starts"] == [0]
    calls = {(tuple(r.request.prompt_ids), tuple(r.sample.token_ids)) for r in engine.received}
    assert sampled_runs(row, calls) == n_calls


def test_claude_code_runs_a_command_in_the_sandbox_and_sees_its_output(claude_code, tiny_tokenizer, tmp_path):
    harness, backend = claude_code
    replies = [tool_call("Bash", {"command": WRITE,
                                  "description": "write the file"}),
               "Done: /app/hello.txt holds hello."]
    row, engine = docker_episode(backend, tiny_tokenizer, tmp_path, replies, harness, max_model_len=CONTEXT)
    assert (row["outcome"], row["reward"], row["agent_end"]) == ("success", 1.0, "done"), harness.last_output
    check_one_sequence(engine, row, 2)
    prompts = [tiny_tokenizer.decode(r.request.prompt_ids) for r in engine.received]
    assert "Write hello to /app/hello.txt" in prompts[0]
    assert "wrote-42" in prompts[1].rsplit("<tool_call>", 1)[1]  # the command ran in the sandbox: its output came back
    assert '"result": "Done: /app/hello.txt holds hello."' in harness.last_output.replace('":"', '": "')


def test_codex_runs_a_command_in_the_sandbox_and_sees_its_output(codex, tiny_tokenizer, tmp_path):
    harness, backend = codex
    replies = [tool_call("exec_command", {"cmd": WRITE}),
               "Done: /app/hello.txt holds hello."]
    row, engine = docker_episode(backend, tiny_tokenizer, tmp_path, replies, harness, max_model_len=CONTEXT)
    assert (row["outcome"], row["reward"], row["agent_end"]) == ("success", 1.0, "done"), harness.last_output
    check_one_sequence(engine, row, 2)
    prompts = [tiny_tokenizer.decode(r.request.prompt_ids) for r in engine.received]
    assert "Write hello to /app/hello.txt" in prompts[0]
    assert "wrote-42" in prompts[1].rsplit("<tool_call>", 1)[1]
    assert "Done: /app/hello.txt holds hello." in harness.last_output


def test_the_runner_stops_an_installed_agent_past_its_turns(codex, tiny_tokenizer, tmp_path):
    harness, backend = codex
    replies = [tool_call("exec_command", {"cmd": f"echo turn-{i}"}) for i in range(4)]
    row, engine = docker_episode(backend, tiny_tokenizer, tmp_path, replies, harness, max_turns=2,
                                 max_model_len=CONTEXT)
    assert (row["agent_end"], row["num_turns"], len(engine.received)) == ("max_turns", 2, 2)
    assert row["outcome"] == "model_failure"  # verified: the file was never written


def test_the_sandbox_reaches_the_gateway_and_nothing_else_of_the_host(claude_code, tiny_tokenizer):
    import socket

    from infra.egress.proxy import EGRESS_GATEWAY, PORTS
    from infra.environments import BASE_IMAGE
    from infra.rollout.gateway import Gateway

    harness, backend = claude_code
    gateway = Gateway(tiny_tokenizer, tool_parser="", channel_host=EGRESS_GATEWAY)
    other = socket.socket()  # a host service on the bridge, outside the channel's ports
    other.bind((EGRESS_GATEWAY, 0))
    other.listen()
    box = backend.start(BASE_IMAGE, {"agentrl.test": "channel"})
    try:
        port = int(gateway.channel_url.rsplit(":", 1)[1])
        assert port in PORTS and other.getsockname()[1] not in PORTS
        probe = ("python3 -c \"import socket,sys; s=socket.socket(); s.settimeout(3); "
                 "sys.exit(s.connect_ex((sys.argv[1], int(sys.argv[2]))))\" ")
        assert box.exec(probe + f"{EGRESS_GATEWAY} {port}", timeout_s=20).exit_code == 0  # the gateway's channel
        for host, p in ((EGRESS_GATEWAY, other.getsockname()[1]), (EGRESS_GATEWAY, 22), ("127.0.0.1", port)):
            assert box.exec(probe + f"{host} {p}", timeout_s=20).exit_code != 0, (host, p)
        # the CLI is mounted read-only
        assert box.exec("test -x /opt/agentrl/agent/package/claude && ! touch /opt/agentrl/agent/x",
                        timeout_s=20).exit_code == 0
    finally:
        box.close()
        other.close()
        gateway.shutdown()


@pytest.mark.parametrize("kind", ["claude-code", "codex"])
def test_an_installed_agent_trains_through_post_train_token_exact(kind, s3, tmp_path_factory, prefect_harness):
    """One post_train step with the CLI on a shipped Harbor task: rows equal what vLLM received and sampled.

    The CLIs' own prompts and tool definitions take ~5-9k tokens of the tiny Llama's byte-level vocabulary,
    so its context is 32k.
    """
    from infra.config import ClaudeCodeHarnessConfig, CodexHarnessConfig, RolloutConfig

    harness = ClaudeCodeHarnessConfig(wall_timeout_s=300) if kind == "claude-code" else \
        CodexHarnessConfig(wall_timeout_s=300)
    rollout = RolloutConfig(tasks_per_step=1, group_size=2, max_tokens_per_turn=24, max_turns=2, harness=harness)
    config, [summary], calls, rows = recorded_post_train(s3, tmp_path_factory, f"{kind}-{uuid.uuid4().hex[:8]}",
                                                         32768, rollout)
    ran = [r for r in rows if r["outcome"] != "infra_failure"]
    assert ran, [(r["outcome"], r["reason"]) for r in rows]
    engine_side = {(tuple(c["prompt_ids"]), tuple(c["token_ids"])) for c in calls}
    for r in ran:
        assert sampled_runs(r, engine_side) == r["num_turns"] >= 1
        assert r["agent_end"] in ("max_turns", "done", "truncated_turn")
    assert summary["rows_trained"] >= 1
    print(f"{kind} rows:", [(r["task_id"], r["outcome"], r["agent_end"], r["num_turns"], len(r["segment_starts"]),
                             len(r["token_ids"])) for r in rows], "engine calls:", len(calls),
          "rows_trained:", summary["rows_trained"])
