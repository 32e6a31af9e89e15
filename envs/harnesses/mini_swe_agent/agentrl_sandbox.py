"""mini-swe-agent's environment extension point, backed by the episode's sandbox (loaded inside the harness's venv).

``environment.environment_class: agentrl_sandbox.SandboxEnvironment``: upstream's ``LocalEnvironment``
with ``execute`` sending each command to the episode's runner (``POST {exec_url}``), which runs it in
the sandbox's shell with the task's deadline and budget. Everything else (template variables, the
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` submission check, serialisation) is upstream's.
"""

from typing import Any

import requests
from minisweagent.environments.local import LocalEnvironment, LocalEnvironmentConfig


class SandboxEnvironmentConfig(LocalEnvironmentConfig):
    """Upstream's local config plus where the episode's runner takes commands."""

    exec_url: str = ""


class SandboxEnvironment(LocalEnvironment):
    """``LocalEnvironment`` whose commands run in the episode's sandbox (see the module docstring)."""

    def __init__(self, **kwargs):
        super().__init__(config_class=SandboxEnvironmentConfig, **kwargs)

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run the action's command in the sandbox; the result dict as upstream's environments return it."""
        command = action.get("command", "")
        if cwd or self.config.cwd:
            command = f"cd {cwd or self.config.cwd} && {command}"
        timeout_s = timeout or self.config.timeout
        resp = requests.post(self.config.exec_url, json={"command": command, "timeout_s": timeout_s},
                             timeout=timeout_s + 120)
        if resp.status_code == 409:  # the runner ended the episode (its budget): stop, as a limit would
            raise RuntimeError(resp.json()["error"]["message"])
        resp.raise_for_status()
        r = resp.json()
        if r["timed_out"]:
            output = {"output": r["output"], "returncode": -1,
                      "exception_info": f"An error occurred while executing the command: timed out after {timeout_s}s",
                      "extra": {"exception_type": "TimeoutExpired", "exception": f"timed out after {timeout_s}s"}}
        else:
            output = {"output": r["output"], "returncode": r["exit_code"], "exception_info": ""}
        self._check_finished(output)
        return output
