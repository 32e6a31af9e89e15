"""Runs Harbor's Terminus-2 (PyPI ``harbor``, unmodified) for one episode; Python 3.12+, inside the harness container.

Reads one JSON file (``argv[1]``): ``base_url``/``api_key`` (the episode's gateway endpoint), ``exec_url``,
``instruction``, ``logs_dir``, ``parser``, ``max_input_tokens``, ``max_output_tokens``,
``enable_summarize``, ``proactive_summarization_threshold``. Calls what Harbor's trial calls
(``Terminus2(...)``, ``setup``, ``run``) with an environment whose ``exec`` runs each command in the
episode's sandbox through the gateway (``POST exec_url``, ``"shell": false``: one ``bash -c`` per
command, as Harbor's Docker environment runs them). Upstream's own turn limit (none): the runner counts
turns and refuses the call past them. Exit 0 when ``run`` returns, or when the runner ended the episode.
"""

import asyncio
import json
import shlex
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from harbor.agents.terminus_2.terminus_2 import Terminus2
from harbor.environments.base import ExecResult
from harbor.models.agent.context import AgentContext


class EpisodeEnded(RuntimeError):
    """The runner ended the episode (its budget, max turns): the harness stops, as on a limit."""


class GatewayEnvironment:
    """What Terminus-2 uses of Harbor's ``BaseEnvironment``, on the episode's sandbox.

    ``exec``, ``is_dir``/``is_file``, ``default_user``, ``session_id`` and ``trial_paths``.
    """

    default_user = None

    def __init__(self, exec_url: str, logs_dir: Path):
        self.exec_url, self.session_id = exec_url, "agentrl"
        self.trial_paths = SimpleNamespace(agent_dir=logs_dir / "agent")

    def _post(self, body: dict) -> dict:
        req = urllib.request.Request(self.exec_url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=(body.get("timeout_s") or 600) + 120) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            if e.code == 409:
                raise EpisodeEnded(json.loads(e.read())["error"]["message"]) from None
            raise

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None, **_) -> ExecResult:
        """``command`` under ``bash -c`` in the sandbox (``user`` is ignored: the sandbox's own user runs it)."""
        prefix = "".join(f"export {k}={shlex.quote(v)}; " for k, v in (env or {}).items())
        if cwd:
            prefix += f"cd {shlex.quote(cwd)} && "
        r = await asyncio.to_thread(self._post, {"command": prefix + command, "timeout_s": timeout_sec,
                                                 "shell": False})
        return ExecResult(stdout=r["output"], stderr="", return_code=124 if r["timed_out"] else r["exit_code"])

    async def is_dir(self, path: str, **_) -> bool:
        """Whether ``path`` is a directory in the sandbox."""
        return (await self.exec(f"test -d {shlex.quote(path)}")).return_code == 0

    async def is_file(self, path: str, **_) -> bool:
        """Whether ``path`` is a file in the sandbox."""
        return (await self.exec(f"test -f {shlex.quote(path)}")).return_code == 0


async def main(cfg: dict) -> None:
    """One Terminus-2 run, as Harbor's trial runs the agent (``setup``, then ``run``)."""
    logs = Path(cfg["logs_dir"])
    env = GatewayEnvironment(cfg["exec_url"], logs)
    agent = Terminus2(
        logs_dir=logs, model_name="openai/policy", api_base=cfg["base_url"],
        parser_name=cfg["parser"], record_terminal_session=False, enable_summarize=cfg["enable_summarize"],
        proactive_summarization_threshold=cfg["proactive_summarization_threshold"],
        model_info={"max_input_tokens": cfg["max_input_tokens"], "max_output_tokens": cfg["max_output_tokens"],
                    "input_cost_per_token": 0.0, "output_cost_per_token": 0.0},
        llm_kwargs={"api_key": cfg["api_key"]},
    )
    await env.exec("mkdir -p /logs/agent")  # Harbor's environments create it; the pane log goes there
    await agent.setup(env)
    await agent.run(cfg["instruction"], env, AgentContext())


if __name__ == "__main__":
    try:
        asyncio.run(main(json.loads(Path(sys.argv[1]).read_text())))
    except EpisodeEnded as e:
        sys.stderr.write(f"episode ended by the runner: {e}\n")
