"""The Task contract shared by every task format, and the episode outcome classes.

A task says what the agent is asked (instruction), where it acts (an image build context or an
image reference), how it is verified (hidden tests, never part of the image), and its budgets.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path


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
class Task:
    """One task, whatever its source format.

    Attributes:
        task_id: unique id, prefixed by its source (``tb/hello-file``, ``humaneval/HumanEval/0``).
        kind: ``terminal`` (multi-turn shell agent) or ``code`` (single completion, tests run in a sandbox).
        instruction: what the agent is told.
        build_context: folder holding the Dockerfile (terminal tasks); None for code tasks.
        tests_dir: hidden tests copied into ``/tests`` only after the agent finished (terminal tasks).
        test_program: for code tasks, the verifier program appended to the completion.
        prompt: for code tasks, the code prefix the model continues.
        agent_timeout_s: wall-clock budget for the agent's whole episode.
        command_timeout_s: limit for one command, enforced inside the container.
        verifier_timeout_s: limit for the hidden tests.
        difficulty: the task author's label (easy, medium, hard) or empty.
        tags: free labels.
        task_format: ``terminal-bench``, ``harbor`` or ``humaneval`` (the folder/file format it came from).
        verifier: ``pytest`` (Terminal-Bench: ``tests/test_outputs.py``), ``harbor`` (``tests/test.sh``
            writes ``/logs/verifier/reward.txt`` or ``reward.json``) or ``code`` (program + ``check``).
        dockerfile: the Dockerfile's path inside ``build_context``.
        solution: the reference solution (a shell script for terminal tasks, source code for code
            tasks); validation runs it and it must verify as success. None: cannot be validated.
        allow_internet: the task opts in to network access (default: no network at all).
        cpus: CPU limit for the sandbox (None: the backend's default).
        memory_mb: memory limit for the sandbox in MiB (None: the backend's default).
        disk_mb: disk limit for the sandbox's writable layer in MiB (None: the backend's default;
            enforced when the engine's storage driver supports it, see ``DockerBackend``).
        setup_command: an expensive set-up to run once in a started sandbox before any attempt
            (``[environment] setup_command`` in task.toml, ``setup_command`` in task.yaml; our
            extension): its result is committed as a snapshot image attempts start from.
    """

    task_id: str
    kind: str
    instruction: str
    build_context: Path | None = None
    tests_dir: Path | None = None
    test_program: str = ""
    prompt: str = ""
    agent_timeout_s: float = 120.0
    command_timeout_s: float = 10.0
    verifier_timeout_s: float = 30.0
    difficulty: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)
    task_format: str = "terminal-bench"
    verifier: str = "pytest"
    dockerfile: str = "Dockerfile"
    solution: str | None = None
    allow_internet: bool = False
    cpus: float | None = None
    memory_mb: int | None = None
    disk_mb: int | None = None
    setup_command: str = ""


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
