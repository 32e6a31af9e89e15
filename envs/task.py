"""The Task contract shared by every task format, and the episode outcome classes.

A task says what the agent is asked (instruction), where it acts (an image build context or an
image reference), how it is verified (hidden tests, never part of the image), and its budgets.
"""

from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from infra.sandbox.base import ExecResult, Sandbox


class Outcome(enum.StrEnum):
    """How an episode ended (DESIGN.md, Episode outcome).

    ``infra_failure`` episodes are excluded from the policy gradient and retried; failures the
    model caused itself (command timeout, budget exhausted, broken environment, failing tests)
    are ``model_failure`` and keep their reward; ``unknown`` means the verifier gave no
    parsable result.
    """

    SUCCESS = "success"
    MODEL_FAILURE = "model_failure"
    INFRA_FAILURE = "infra_failure"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Verdict:
    """What the verifier concluded.

    Attributes:
        reward: 1.0 pass, 0.0 fail (binary, as Terminal-Bench and HumanEval score; Harbor's may lie between).
        outcome: success, model_failure (tests fail) or unknown (no parsable result).
        reason: reason code (``tests_passed``, ``tests_failed``, ``tests_skipped``, ``tests_did_not_run``,
            ``no_tests_collected``, ``verifier_timeout``, ``verifier_error``, ``no_reward_file``,
            ``verifier_tampered``; each defined in ``envs/verify.py``; ``solution_timeout`` from a
            reference run).
        log: the verifier's output, truncated.
    """

    reward: float
    outcome: Outcome
    reason: str
    log: str


@dataclass(frozen=True)
class ComposeServices:
    """A multi-service task's Docker Compose project: the agent acts in ``main``, the others run beside it.

    Attributes:
        file: the task's compose file (build contexts are relative to its folder).
        main: the service the agent acts in (Terminal-Bench: ``client``).
    """

    file: Path
    main: str


@dataclass(frozen=True)
class SandboxLimits:
    """A task's sandbox limits (``DockerBackend.start`` keywords); None: the backend's default.

    Attributes:
        cpus: CPU limit.
        memory_mb: memory limit in MiB.
        network: the task opts in to network access (default: no network at all).
        disk_mb: disk limit for the sandbox's writable layer in MiB (enforced when the engine's
            storage driver supports it, see ``DockerBackend``).
        services: the task's other services (a multi-service compose file); None: one container.
        egress_hosts: with ``network``, the only hosts the task may reach (Harbor's ``network_mode =
            "allowlist"`` with ``allowed_hosts``; enforced by the egress proxy, ``infra.egress``); None: any.
    """

    cpus: float | None = None
    memory_mb: int | None = None
    network: bool = False
    disk_mb: int | None = None
    services: ComposeServices | None = None
    egress_hosts: tuple[str, ...] | None = None

    def kwargs(self) -> dict:
        """As keywords of ``SandboxBackend.start`` / ``WarmPool.acquire`` (``services``, ``egress_hosts`` when set)."""
        kw = {"cpus": self.cpus, "memory_mb": self.memory_mb, "network": self.network, "disk_mb": self.disk_mb}
        if self.egress_hosts is not None:
            kw["egress_hosts"] = self.egress_hosts
        return {**kw, "services": self.services} if self.services is not None else kw


@dataclass(frozen=True, kw_only=True)
class Task:
    """What every task has, whatever its format; the formats are the subclasses, each with its own ``verify``.

    Attributes:
        task_id: unique id, prefixed by its source (``tb/hello-file``, ``humaneval/HumanEval/0``).
        instruction: what the agent is told.
        agent_timeout_s: budget for the agent's own commands, in seconds of tool time.
        command_timeout_s: limit for one command, enforced inside the container.
        verifier_timeout_s: limit for the hidden tests.
        difficulty: the task author's label (easy, medium, hard) or empty.
        tags: free labels.
        solution: the reference solution (a shell script for terminal tasks, source code for code
            tasks); validation runs it and it must verify as success. None: cannot be validated.
        limits: the sandbox's limits (the task's own, else the backend's defaults).
        setup_command: an expensive set-up run once in a started sandbox before any attempt
            (``[environment] setup_command`` in task.toml, ``setup_command`` in task.yaml; our
            extension): its result is committed as a snapshot image attempts start from.
        task_format: the folder/file format it came from (``terminal-bench``, ``harbor``, ``humaneval``).
        acts_in_sandbox: the agent acts in a sandbox over turns (terminal tasks), or answers once and
            its answer is verified in a fresh sandbox (code tasks).
    """

    task_id: str
    instruction: str
    agent_timeout_s: float = 120.0
    command_timeout_s: float = 10.0
    verifier_timeout_s: float = 30.0
    difficulty: str = ""
    tags: tuple[str, ...] = ()
    solution: str | None = None
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    setup_command: str = ""
    task_format: ClassVar[str] = ""
    acts_in_sandbox: ClassVar[bool] = True

    def image_build(self) -> tuple[Path, str] | None:
        """``(build context, Dockerfile path in it)`` of the task's own image; None: it runs in the base image."""
        return None

    def verify(self, sandbox: Sandbox, final_reply: str) -> Verdict:
        """Score a finished episode in ``sandbox`` (``final_reply``: the model's last reply).

        Raises:
            SandboxInfraError: the sandbox died while verifying (an infra failure, not a verdict).
        """
        raise NotImplementedError

    def submitted_commands(self, final_reply: str) -> list[str] | None:
        """What a replay must run for this episode, when not the commands the agent ran (None)."""
        return None

    def replay(self, sandbox: Sandbox, commands: list[str]) -> Verdict:
        """Re-run a stored episode's ``commands`` in ``sandbox`` and verify it again."""
        raise NotImplementedError

    def reference(self, sandbox: Sandbox, with_solution: bool) -> Verdict:
        """The validation gate's run: the reference solution (``with_solution``) or a do-nothing agent, verified."""
        raise NotImplementedError

    verifier_name: ClassVar[str] = ""

    def verification_parts(self) -> list[str]:
        """Everything besides the image a validation verdict depends on, in the cache key's order.

        Verifier, tests' hash, solution, test program, prompt, verifier timeout (as the key was made before).
        """
        return [self.verifier_name, "", self.solution or "", "", "", repr(self.verifier_timeout_s)]


@dataclass(frozen=True, kw_only=True)
class TerminalTask(Task):
    """A task the agent solves with shell commands in a sandbox of its own image, verified there after.

    Attributes:
        build_context: folder holding the Dockerfile.
        tests_dir: hidden tests, copied into ``/tests`` only after the agent finished.
        dockerfile: the Dockerfile's path inside ``build_context``.
    """

    build_context: Path
    tests_dir: Path
    dockerfile: str = "Dockerfile"

    def image_build(self) -> tuple[Path, str]:
        """The task folder's Dockerfile."""
        return self.build_context, self.dockerfile

    def replay(self, sandbox: Sandbox, commands: list[str]) -> Verdict:
        """Each command in order in the sandbox's persistent shell (as the episode ran them), then the verifier."""
        for command in commands:
            sandbox.run_in_shell(command, timeout_s=self.command_timeout_s)
        return self.verify(sandbox, "")

    def run_solution(self, sandbox: Sandbox) -> ExecResult:
        """Run the reference solution as the format's oracle agent does (each format defines it)."""
        raise NotImplementedError

    def reference(self, sandbox: Sandbox, with_solution: bool) -> Verdict:
        """The reference solution run as the format's oracle runs it (``run_solution``), then the task's verifier."""
        if not with_solution or self.solution is None:
            return self.verify(sandbox, "")
        from infra.task_faults import drifted_dependencies, unreachable_hosts

        r = self.run_solution(sandbox)
        # hosts the solution could not reach and dependencies that moved on, named from its whole output
        # (only its tail is kept)
        reach = "".join(f"solution could not reach host: {h}\n" for h in unreachable_hosts(r.output))
        reach += "".join(f"solution dependency drift: {d}\n" for d in drifted_dependencies(r.output))
        if r.timed_out:
            return Verdict(0.0, Outcome.MODEL_FAILURE, "solution_timeout", reach + r.output[-2000:])
        v = self.verify(sandbox, "")
        return Verdict(v.reward, v.outcome, v.reason, f"{reach}solution exit {r.exit_code}: {r.output[-300:]}\n"
                                                      f"verifier: {v.log}")

    def verification_parts(self) -> list[str]:
        """As :meth:`Task.verification_parts`, with the hidden tests' hash."""
        parts = super().verification_parts()
        parts[1] = tree_hash(self.tests_dir)
        return parts


def tree_hash(folder: Path | None) -> str:
    """sha256 over a folder's relative paths and file bytes (empty string for None)."""
    if folder is None:
        return ""
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


class TaskError(ValueError):
    """A task folder that cannot be loaded; the message names the file and what was expected."""


def read_task_text(path: Path) -> str:
    """A task file's text.

    Raises:
        FileNotFoundError: ``path`` does not exist (callers name what the file is for).
        TaskError: the file is not UTF-8 text or cannot be read; the message names the file.
    """
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 text ({e})") from e
    except (IsADirectoryError, PermissionError) as e:
        raise TaskError(f"{path}: cannot be read ({e.strerror})") from e


def is_finite(value: int | float) -> bool:
    """Whether a number from a task file is finite.

    ``inf``/``nan`` are valid TOML and YAML floats; an integer too large for a float counts as not finite.
    """
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
