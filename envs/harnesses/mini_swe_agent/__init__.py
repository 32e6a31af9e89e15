"""mini-swe-agent (SWE-agent/mini-swe-agent, PyPI ``mini-swe-agent``) as a harness, run unmodified.

Upstream's own CLI (``python -m minisweagent.run.mini``) runs in the harness's venv with upstream's
text-based config (``mini_textbased.yaml``: its prompts, its ```mswea_bash_command`` action regex,
its observation template and loop) and ``agent_class: default``. What we set: the model
(``litellm_textbased`` against the episode's gateway endpoint), the environment (the extension
point ``environment_class``: :mod:`agentrl_sandbox`, commands run in the episode's sandbox), and its
step limit. The runner enforces the task's budgets; see :class:`envs.harnesses.SubprocessHarness`.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from envs.harnesses.subprocess_harness import SubprocessHarness

PLUGIN_DIR = Path(__file__).parent


class MiniSweAgentHarness(SubprocessHarness):
    """mini-swe-agent ``version`` from PyPI; ``config``: an upstream builtin config name."""

    def __init__(self, version: str = "2.4.6", config: str = "mini_textbased.yaml", wall_timeout_s: float = 900.0,
                 tool_parser: str = ""):
        super().__init__(f"mini-swe-agent-{version}", [f"mini-swe-agent=={version}"], wall_timeout_s)
        self.config, self.tool_parser = config, tool_parser
        self.name = f"mini-swe-agent-{version}"

    def command(self, workdir: Path, endpoint, instruction: str, max_turns: int, command_timeout_s: float) -> list[str]:
        """Upstream's ``mini`` CLI with the builtin config and ours (model, environment, limits) merged over it."""
        ours = {
            "agent": {"agent_class": "default", "step_limit": 0, "cost_limit": 0,  # the runner ends it (max_turns)
                      "output_path": str(workdir / "trajectory.json")},
            "model": {"model_class": "litellm_textbased", "model_name": "openai/policy",
                      "cost_tracking": "ignore_errors",
                      "model_kwargs": {"api_base": endpoint.base_url, "api_key": endpoint.key}},
            "environment": {"environment_class": "agentrl_sandbox.SandboxEnvironment", "exec_url": endpoint.exec_url,
                            "timeout": int(command_timeout_s)},
        }
        (workdir / "agentrl.yaml").write_text(yaml.safe_dump(ours))
        return ["-m", "minisweagent.run.mini", "-c", self.config, "-c", str(workdir / "agentrl.yaml"),
                "-t", instruction, "--exit-immediately", "-o", str(workdir / "trajectory.json")]

    def env(self, workdir: Path) -> dict[str, str]:
        """No setup prompt, no cost lookups online (litellm's local cost map), our environment class importable."""
        return {"PYTHONPATH": str(PLUGIN_DIR), "MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1",
                "MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "MSWEA_GLOBAL_CONFIG_DIR": str(workdir / "config")}
