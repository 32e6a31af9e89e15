"""A harness that runs as its own process, in its own venv, talking to the episode's gateway endpoint.

The runner, not the harness, enforces the budgets: the process is stopped (its process group
killed) when the episode ends on the runner's side (``max_turns``, ``context_full``, the tool-time
budget ``agent_timeout``, cancellation) or when it runs past ``wall_timeout_s`` (``agent_timeout``).
A harness that exits 0 ended the episode itself (``done``); one that exits otherwise while the
episode still ran crashed on its own: ``infra_failure`` (``harness_error``), retried and excluded.
A reply the harness cannot parse is the harness's to handle (its own format-error turn), so it
stays a model outcome.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from envs.harnesses.venv import harness_python

log = logging.getLogger(__name__)


class SubprocessHarness:
    """Base: subclasses give the ``command`` (arguments to the venv's python) and extra ``env``."""

    name = "subprocess"
    tool_parser = ""

    def __init__(self, venv_name: str, requirements: list[str], wall_timeout_s: float):
        self.venv_name, self.requirements, self.wall_timeout_s = venv_name, requirements, wall_timeout_s
        self.last_output = ""  # the last episode's harness output tail (for diagnosis)

    def command(self, workdir: Path, endpoint, instruction: str, max_turns: int, command_timeout_s: float) -> list[str]:
        """Arguments to the venv's python that run the harness once against ``endpoint`` (files go in ``workdir``)."""
        raise NotImplementedError

    def env(self, workdir: Path) -> dict[str, str]:
        """Environment variables the harness process needs, over this process's."""
        return {}

    def prepare(self) -> Path:
        """The harness's interpreter (its venv is installed on first use)."""
        return harness_python(self.venv_name, self.requirements)

    def deadline_s(self, io) -> float:
        """Wall-clock seconds the harness process may run for this episode (then ``agent_timeout``)."""
        return self.wall_timeout_s

    def launch(self, python: Path, args: list[str], workdir: Path, env: dict[str, str]) -> Process:
        """Start ``python args`` in ``workdir`` (its own process group, output to ``harness.log``)."""
        return Process(python, args, workdir, env)

    def act(self, io, max_turns: int) -> None:
        """Run the harness process against this episode's endpoint until it exits or the runner ends the episode."""
        if not io.task.acts_in_sandbox:
            raise ValueError(f"harness {self.name} acts in sandboxes: task {io.task.task_id} is a code task "
                             "(one answer, no sandbox); train code tasks with rollout.harness.kind = \"bash-fence\"")
        python = self.prepare()
        io.acquire()
        if io.ended:
            return
        endpoint = io.open_gateway()
        try:
            with tempfile.TemporaryDirectory(prefix="agentrl-harness-") as tmp:
                workdir = Path(tmp)
                args = self.command(workdir, endpoint, io.task.instruction, max_turns, io.task.command_timeout_s)
                loopback = "127.0.0.1,localhost"
                env = {**os.environ, "HOME": str(workdir), "NO_PROXY": loopback, "no_proxy": loopback,
                       **self.env(workdir)}
                proc = self.launch(python, args, workdir, env)
                deadline = time.monotonic() + self.deadline_s(io)
                try:
                    while proc.poll() is None:
                        if io.ended:
                            break
                        if time.monotonic() > deadline:
                            io.end("agent_timeout")
                            break
                        time.sleep(0.1)
                finally:
                    proc.kill()
                self.last_output = proc.output()[-4000:]
                if io.ended:
                    return
                if proc.returncode == 0:
                    io.end("done")
                else:
                    log.warning("harness %s exited %s: %s", self.name, proc.returncode, self.last_output[-1500:])
                    io.fail("harness_error")
        finally:
            io.close_gateway(endpoint)


class Process:
    """A harness process in its own process group, its stdout and stderr merged into ``harness.log``."""

    def __init__(self, python: Path, args: list[str], workdir: Path, env: dict[str, str]):
        self._out = open(workdir / "harness.log", "w+")
        self._proc = subprocess.Popen([str(python), *args], cwd=workdir, env=env, stdout=self._out,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def poll(self) -> int | None:
        """The exit status; None while it runs."""
        return self._proc.poll()

    @property
    def returncode(self) -> int | None:
        """The exit status once it ended (negative: killed by that signal)."""
        return self._proc.returncode

    def kill(self) -> None:
        """Kill its whole process group if it still runs (idempotent)."""
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def output(self) -> str:
        """What it printed (call once, after :meth:`kill`)."""
        self._out.seek(0)
        text = self._out.read()
        self._out.close()
        return text
