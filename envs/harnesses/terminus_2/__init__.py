"""Harbor's Terminus-2 (PyPI ``harbor``, laude-institute/harbor) as a harness, run unmodified.

Harbor needs Python 3.12+ and this machine's Python is 3.11, so Terminus-2 runs in a container: the
local equivalent of ``python:3.13`` (``infra.base_images.TRIXIE_PY``, Debian trixie's python3.13) with
harbor's wheels for CPython 3.13 installed on the host (``pip install --target``, mounted read-only)
and the host's network (the episode's gateway listens on loopback). :mod:`driver` calls what
Harbor's trial calls (``Terminus2(...)``, ``setup``, ``run``): upstream's prompts, JSON (or XML) reply
parser, tmux session, turn loop and context summarization. What we set: the model (``openai/policy``
at the episode's gateway endpoint, ``model_info`` from the run's context length), no asciinema
recording, and the environment (each command under ``bash -c`` in the episode's sandbox).
The runner enforces the task's budgets; see :class:`envs.harnesses.SubprocessHarness`.
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

from envs.harnesses.subprocess_harness import SubprocessHarness, log
from envs.harnesses.venv import harness_target

PLUGIN_DIR = Path(__file__).parent
PYTHON_VERSION = "3.13"  # the local python image's (TRIXIE_PY)


class Terminus2Harness(SubprocessHarness):
    """Terminus-2 of harbor ``version``; ``parser``: ``json`` (upstream's default) or ``xml``."""

    def __init__(self, version: str = "0.25.0", parser: str = "json", wall_timeout_s: float = 900.0,
                 enable_summarize: bool = True, proactive_summarization_threshold: int | None = None,
                 max_output_tokens: int = 512, tool_parser: str = ""):
        super().__init__(f"harbor-{version}-py{PYTHON_VERSION}", [f"harbor=={version}"], wall_timeout_s)
        self.parser, self.tool_parser = parser, tool_parser
        self.enable_summarize, self.summarize_at = enable_summarize, proactive_summarization_threshold
        self.max_output_tokens, self.max_input_tokens = max_output_tokens, 0
        self.name = f"terminus-2-harbor-{version}"
        self._lock = threading.Lock()
        self._ready: tuple[Path, str] | None = None  # (harbor's lib, the python image), once per harness
        self._client = None

    def prepare(self) -> Path:
        """Harbor's wheels for CPython 3.13 and the python image, made ready once (installed/built on first use)."""
        with self._lock:
            if self._ready is None:
                from infra.base_images import TRIXIE_PY, ensure_local_base
                from infra.sandbox.docker_backend import DockerBackend

                lib = harness_target(self.venv_name, self.requirements, PYTHON_VERSION)
                backend = DockerBackend()
                self._client = backend.client
                self._ready = (lib, ensure_local_base(backend.client, TRIXIE_PY, backend.state_dir,
                                                      backend.ca_bundle))
            return self._ready[0]

    def act(self, io, max_turns: int) -> None:
        """See :meth:`SubprocessHarness.act`; the context length is the engine's."""
        self.max_input_tokens = io.runner.engine.max_model_len
        super().act(io, max_turns)

    def deadline_s(self, io) -> float:
        """The task's agent timeout as wall clock (Harbor bounds ``agent.run`` so), within ``wall_timeout_s``.

        Terminus-2 types commands into tmux and waits in its own process, so the sandbox time the runner
        counts (``tool_s``) sees only its tmux housekeeping, not the commands themselves.
        """
        return min(self.wall_timeout_s, io.task.agent_timeout_s)

    def command(self, workdir: Path, endpoint, instruction: str, max_turns: int, command_timeout_s: float) -> list[str]:
        """The driver, given the episode's endpoint and limits in ``workdir/config.json``."""
        # No max_turns for upstream (its default): the runner counts turns and refuses the call past them
        summarize_at = self.summarize_at if self.summarize_at is not None else min(8000, self.max_input_tokens // 4)
        config = {"base_url": endpoint.base_url, "api_key": endpoint.key, "exec_url": endpoint.exec_url,
                  "instruction": instruction, "logs_dir": str(workdir / "logs"),
                  "parser": self.parser, "enable_summarize": self.enable_summarize,
                  "proactive_summarization_threshold": summarize_at,
                  "max_input_tokens": self.max_input_tokens, "max_output_tokens": self.max_output_tokens}
        (workdir / "config.json").write_text(json.dumps(config))
        (workdir / "logs" / "agent").mkdir(parents=True)
        return ["/agentrl/driver.py", str(workdir / "config.json")]

    def env(self, workdir: Path) -> dict[str, str]:
        """Harbor importable, litellm's local cost map (no fetch at import), no telemetry."""
        return {"PYTHONPATH": "/opt/harbor:/agentrl", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "HOME": str(workdir), "NO_PROXY": "127.0.0.1,localhost", "HARBOR_TELEMETRY": "0"}

    def launch(self, python: Path, args: list[str], workdir: Path, env: dict[str, str]) -> ContainerProcess:
        """``python3 args`` in the python image, harbor at ``/opt/harbor``, ``workdir`` shared, host network."""
        ours = {k: env[k] for k in self.env(workdir)}
        volumes = {str(python): {"bind": "/opt/harbor", "mode": "ro"},
                   str(PLUGIN_DIR): {"bind": "/agentrl", "mode": "ro"},
                   str(workdir): {"bind": str(workdir), "mode": "rw"}}
        from infra.sandbox.docker_backend import LABEL, OWNER_LABEL, owner_id

        # our labels and owner: the reaper removes it if this process dies before removing it itself
        container = self._client.containers.create(
            self._ready[1], ["python3", *args], network_mode="host", volumes=volumes,
            environment=ours, working_dir=str(workdir), name=f"agentrl-harness-{uuid.uuid4().hex[:12]}",
            labels={LABEL: "1", OWNER_LABEL: owner_id(), "agentrl.harness": self.name})
        try:
            container.start()
        except Exception:
            container.remove(force=True)
            raise
        return ContainerProcess(container)


class ContainerProcess:
    """A harness container, with :class:`envs.harnesses.subprocess_harness.Process`'s interface."""

    def __init__(self, container):
        self._c, self.returncode, self._logs = container, None, ""
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        try:
            self.returncode = int(self._c.wait()["StatusCode"])
        except Exception:  # removed under us (kill): the kill's side records nothing more
            self.returncode = self.returncode if self.returncode is not None else -9

    def poll(self) -> int | None:
        """The container's exit status; None while it runs."""
        return self.returncode

    def kill(self) -> None:
        """Kill it if it still runs, keep its logs, remove it; idempotent (left to the reaper if the engine fails)."""
        import docker.errors
        import requests

        engine_errors = (docker.errors.DockerException, requests.exceptions.RequestException)
        if self.returncode is None:
            try:
                self._c.kill()
            except engine_errors:  # it exited meanwhile, or is gone
                pass
        self._waiter.join(timeout=30)
        try:
            self._logs = self._c.logs().decode(errors="replace")
        except engine_errors:
            pass
        try:
            self._c.remove(force=True)
        except docker.errors.NotFound:
            pass
        except engine_errors as e:
            log.warning("harness container %s not removed (%s): the reaper will", self._c.name, e)

    def output(self) -> str:
        """Its stdout and stderr, as kept by :meth:`kill`."""
        return self._logs


__all__ = ["Terminus2Harness"]
