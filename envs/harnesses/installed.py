"""Agents installed in the task's sandbox: Claude Code and Codex CLI from npm, run unmodified.

These agents run their tools where they run, so, as Harbor's installed agents do
(``harbor.agents.installed.claude_code`` / ``codex``), each runs inside the episode's sandbox with its own
non-interactive mode (``claude -p``, ``codex exec``), its permissions off for an unattended sandbox, and
its base URL at the episode's gateway endpoint. The pinned npm package (the published native binary) is
unpacked once outside the checkout (``envs.harnesses.venv.npm_package``) and mounted read-only at
:data:`AGENT_DIR` in every sandbox of the run (``DockerBackend(agent_mounts=...)``). The channel: every
sandbox joins ``agentrl-egress``, whose firewall opens only ports of ``infra.egress.proxy.PORTS`` on the
bridge, where the gateway listens (``Gateway(channel_host=...)``); the host's other ports stay unreachable.
The agent's config and caches go to :data:`CONFIG_DIR` in the sandbox, which is the episode's own.

The runner owns the budgets (``_EpisodeIO.run_agent``): the gateway refuses calls past ``max_turns``
or a full context and the agent is killed then; its wall clock is capped at the task's agent timeout
within ``wall_timeout_s``. Exit 0 is ``done``; an exit after a reply cut at the run's per-turn token
budget is ``truncated_turn``, a model outcome (Codex exits 1 on an ``incomplete`` response, as it does
against OpenAI); another exit while the episode still runs is the harness's own crash
(``infra_failure``/``harness_error``), as for :class:`SubprocessHarness`.
"""

from __future__ import annotations

import logging
import shlex

from envs.harnesses.venv import harness_root, npm_package

log = logging.getLogger(__name__)

AGENT_DIR = "/opt/agentrl/agent"
"""Where the CLI's unpacked npm package is mounted (read-only) in each sandbox (its ``package/`` inside)."""
CONFIG_DIR = "/var/lib/agentrl-agent"
"""The agent's config and cache folder in the sandbox (``CLAUDE_CONFIG_DIR``, ``CODEX_HOME`` under it; not in
``/tmp``, where Codex refuses to put its helper binaries)."""
MODEL = "policy"
"""The model name the agent asks for (the gateway samples the policy whatever the name)."""
SIDE_MODEL = "policy-side"
"""The name given for an agent's small model when its calls are side calls (the gateway's ``side_models``)."""


class InstalledAgentHarness:
    """Base: subclasses give the npm ``spec`` and the shell ``invocation`` of their CLI."""

    name = "installed"
    gateway_channel = True  # the gateway also listens where the sandbox reaches it
    cli = ""

    def __init__(self, version: str, wall_timeout_s: float = 900.0, tool_parser: str = "hermes"):
        self.version, self.wall_timeout_s, self.tool_parser = version, wall_timeout_s, tool_parser
        self.name = f"{self.cli}-{version}"
        self.last_output = ""  # the last episode's agent output (for diagnosis)

    @property
    def spec(self) -> str:
        """The npm package spec (its platform build: the binary runs in the sandbox, not under node)."""
        raise NotImplementedError

    def mounts(self) -> dict[str, str]:
        """Host folder -> sandbox path, for ``DockerBackend(agent_mounts=...)`` (the install may come later)."""
        return {str(harness_root(self.name)): AGENT_DIR}

    def prepare(self) -> None:
        """Unpack the pinned package once (``npm pack``; a few hundred MB, cached outside the checkout)."""
        npm_package(self.name, self.spec)

    def invocation(self, base_url: str, key: str) -> tuple[str, dict[str, str]]:
        """The shell command that runs the agent on ``$AGENTRL_INSTRUCTION``, and its environment.

        ``base_url``: the episode's OpenAI base on the channel (ends in ``/v1``); ``key``: its API key.
        """
        raise NotImplementedError

    def act(self, io, max_turns: int) -> None:
        """Run the agent in the episode's sandbox until it exits or the runner ends the episode."""
        if not io.task.acts_in_sandbox:
            raise ValueError(f"harness {self.name} acts in sandboxes: task {io.task.task_id} is a code task "
                             "(one answer, no sandbox); train code tasks with rollout.harness.kind = \"bash-fence\"")
        self.prepare()
        io.acquire()
        if io.ended:
            return
        endpoint = io.open_gateway()
        try:
            if endpoint.channel_base_url is None:
                raise RuntimeError(f"harness {self.name}: the run's gateway has no channel into the sandbox "
                                   "(Gateway(channel_host=...))")
            command, env = self.invocation(endpoint.channel_base_url, endpoint.key)
            from infra.egress.proxy import EGRESS_GATEWAY

            # the gateway is reached directly, never through the task's egress proxy
            script = (f'export NO_PROXY="${{NO_PROXY:+$NO_PROXY,}}{EGRESS_GATEWAY}" no_proxy="${{no_proxy:+$no_proxy,}}'
                      f'{EGRESS_GATEWAY}"; mkdir -p {CONFIG_DIR} && {command}')
            env = {**env, "AGENTRL_INSTRUCTION": io.task.instruction}
            result = io.run_agent(script, env, min(self.wall_timeout_s, io.task.agent_timeout_s))
            if result is None:  # the runner ended it (turns, context, deadline) or the sandbox failed
                return
            self.last_output = result.output[-4000:]
            if result.exit_code == 0:
                io.end("done")
            elif io.last_stop_reason == "length":  # the agent gave up on a reply cut at the per-turn budget
                io.end("truncated_turn")
            else:
                log.warning("harness %s exited %s: %s", self.name, result.exit_code, self.last_output[-1500:])
                io.fail("harness_error")
        finally:
            io.close_gateway(endpoint)


class ClaudeCodeHarness(InstalledAgentHarness):
    """Claude Code (``@anthropic-ai/claude-code``'s linux-x64 build: glibc images) over Anthropic's Messages API.

    ``claude -p`` with the instruction on stdin, ``--output-format json``, permissions bypassed
    (``IS_SANDBOX=1`` allows that as root, as Harbor sets it), non-essential traffic (telemetry, updates)
    off, every model alias pointed at the policy. Its small-model calls (Haiku's alias: a title, a check of
    a command) are side calls by default (``small_model_calls="side"``): the policy answers them on their own
    prompt, counted in the row's ``side_calls``, not trained on; ``"trained"`` keeps them as segments of the row.
    """

    cli = "claude-code"

    def __init__(self, version: str, wall_timeout_s: float = 900.0, tool_parser: str = "hermes",
                 small_model_calls: str = "side"):
        if small_model_calls not in ("side", "trained"):
            raise ValueError(f"small_model_calls must be 'side' or 'trained', got {small_model_calls!r}")
        super().__init__(version, wall_timeout_s, tool_parser)
        self.small_model = SIDE_MODEL if small_model_calls == "side" else MODEL
        self.side_models = (SIDE_MODEL,) if small_model_calls == "side" else ()

    @property
    def spec(self) -> str:
        """The linux-x64 build's package."""
        return f"@anthropic-ai/claude-code-linux-x64@{self.version}"

    def invocation(self, base_url: str, key: str) -> tuple[str, dict[str, str]]:
        """``claude -p`` (see the class docstring)."""
        env = {"ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": key,
               "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": self.small_model,
               "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL, "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
               "ANTHROPIC_DEFAULT_HAIKU_MODEL": self.small_model, "CLAUDE_CONFIG_DIR": f"{CONFIG_DIR}/claude",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
               "DISABLE_TELEMETRY": "1", "IS_SANDBOX": "1"}
        binary = f"{AGENT_DIR}/package/claude"
        command = (f'if [ ! -e /lib64/ld-linux-x86-64.so.2 ]; then echo "agentrl: Claude Code\'s linux-x64 build '
                   f'needs glibc, which this image lacks" >&2; exit 127; fi; '
                   f'mkdir -p "$CLAUDE_CONFIG_DIR"; i="$AGENTRL_INSTRUCTION"; unset AGENTRL_INSTRUCTION; '
                   f'printf "%s" "$i" | '
                   f'{binary} -p --output-format json --dangerously-skip-permissions --model {MODEL} 2>&1')
        return command, env


class CodexHarness(InstalledAgentHarness):
    """Codex CLI (``@openai/codex``'s linux-x64 build: a static binary) over OpenAI's Responses API.

    ``codex exec`` with approvals and its own sandbox off (the task's container is the sandbox), no git
    check, a model provider at the episode's gateway (``wire_api = "responses"``), ``CODEX_HOME`` in the
    sandbox; its bundled ``rg`` on ``PATH`` and ``CODEX_MANAGED_BY_NPM`` set, as npm's launcher does.
    """

    cli = "codex"

    @property
    def spec(self) -> str:
        """The linux-x64 build (an npm alias of ``@openai/codex``)."""
        return f"@openai/codex@{self.version}-linux-x64"

    def invocation(self, base_url: str, key: str) -> tuple[str, dict[str, str]]:
        """``codex exec`` (see the class docstring)."""
        vendor = f"{AGENT_DIR}/package/vendor/x86_64-unknown-linux-musl"
        env = {"AGENTRL_API_KEY": key, "CODEX_HOME": f"{CONFIG_DIR}/codex", "CODEX_MANAGED_BY_NPM": "1"}
        provider = f'model_providers.agentrl={{name="agentrl",base_url="{base_url}",wire_api="responses",' \
                   f'env_key="AGENTRL_API_KEY"}}'
        command = (f'export PATH="{vendor}/codex-path:$PATH"; mkdir -p "$CODEX_HOME"; i="$AGENTRL_INSTRUCTION"; '
                   f'unset AGENTRL_INSTRUCTION; {vendor}/bin/codex exec --dangerously-bypass-approvals-and-sandbox '
                   f'--skip-git-repo-check -m {MODEL} -c model_provider=agentrl -c {shlex.quote(provider)} '
                   f'-- "$i" </dev/null 2>&1')
        return command, env


__all__ = ["AGENT_DIR", "ClaudeCodeHarness", "CodexHarness", "InstalledAgentHarness"]
