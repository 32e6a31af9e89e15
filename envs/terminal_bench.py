"""Terminal-Bench 1.x task folders.

A folder holds ``task.yaml`` (instruction, ``max_agent_timeout_sec``, ``max_test_timeout_sec``,
``parser_name``, ``difficulty``, ``tags``), the environment as a ``Dockerfile`` or a
single-service ``docker-compose.yaml`` whose service is built from the folder, hidden ``tests/``
(``test_outputs.py``, run with pytest), optionally ``run-tests.sh``, and the reference solution
``solution.sh`` (and, our extension, ``setup_command``: an expensive set-up run once and
snapshotted). ``load_terminal_tasks(dir)`` loads every folder under ``dir``; a broken folder
does not stop the others: it is returned in the error list with a message naming the file and
the field.

Not supported (reported as load errors): compose files with more than one service (tasks that
need a database or a second host), parsers other than ``pytest``. ``run-tests.sh`` is not run:
upstream it installs pytest from the network; our verifier runs ``tests/test_outputs.py`` with
the image's pytest under a hardened configuration (``envs/verify.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import yaml

from envs.task import Task, TaskError, TerminalTask, Verdict, is_finite, read_task_text
from envs.verify import verify_terminal

SUPPORTED_PARSERS = ("pytest",)

if TYPE_CHECKING:
    from infra.sandbox.base import Sandbox


@dataclass(frozen=True, kw_only=True)
class TerminalBenchTask(TerminalTask):
    """A Terminal-Bench 1.x task: verified by ``tests/test_outputs.py`` under our hardened pytest."""

    task_format: ClassVar[str] = "terminal-bench"
    verifier_name: ClassVar[str] = "pytest"

    def verify(self, sandbox: Sandbox, final_reply: str) -> Verdict:
        """Hidden tests copied in fresh, run with pytest, verdict from their JUnit report (``envs.verify``)."""
        return verify_terminal(sandbox, self)


def _compose_dockerfile(folder: Path) -> str:
    """The Dockerfile path (relative to ``folder``) of a single-service ``docker-compose.yaml``.

    Raises:
        TaskError: not YAML, not exactly one service, or a service that is not built from this
            folder (``image:`` alone names a registry image we cannot pull).
    """
    path = next(folder / n for n in ("docker-compose.yaml", "docker-compose.yml") if (folder / n).is_file())
    try:
        spec = yaml.safe_load(read_task_text(path))
    except yaml.YAMLError as e:
        raise TaskError(f"{path}: not valid YAML: {e}") from e
    services = spec.get("services") if isinstance(spec, dict) else None
    if not isinstance(services, dict) or len(services) != 1:
        n = len(services) if isinstance(services, dict) else 0
        raise TaskError(f"{path}: field 'services' must hold exactly one service, found {n} "
                        "(multi-service tasks are not supported)")
    (name, service), = services.items()
    build = service.get("build") if isinstance(service, dict) else None
    if build is None:
        raise TaskError(f"{path}: field 'services.{name}.build' missing (the image must be built from the task folder)")
    if isinstance(build, str):
        build = {"context": build}
    if not isinstance(build, dict):
        raise TaskError(f"{path}: field 'services.{name}.build' must be a path or a mapping")
    context = (folder / str(build.get("context", "."))).resolve()
    if context != folder.resolve():
        raise TaskError(f"{path}: field 'services.{name}.build.context' must be the task folder ('.'), "
                        f"got {build.get('context')!r}")
    dockerfile = str(build.get("dockerfile", "Dockerfile"))
    if not (folder / dockerfile).is_file():
        raise TaskError(f"{path}: field 'services.{name}.build.dockerfile' names {dockerfile!r}, "
                        f"which is not a file in {folder}")
    return dockerfile


def load_terminal_task(folder: Path) -> Task:
    """Load one Terminal-Bench task folder.

    Raises:
        TaskError: missing ``task.yaml``/environment/``tests/``, unparseable YAML, an unknown
            parser, or a field of the wrong type; the message names the file and field.
    """
    spec_path = folder / "task.yaml"
    if not spec_path.is_file():
        raise TaskError(f"{spec_path}: missing (a Terminal-Bench task needs task.yaml)")
    try:
        spec = yaml.safe_load(read_task_text(spec_path))
    except yaml.YAMLError as e:
        raise TaskError(f"{spec_path}: not valid YAML: {e}") from e
    if not isinstance(spec, dict):
        raise TaskError(f"{spec_path}: expected a mapping at top level, got {type(spec).__name__}")
    if (folder / "docker-compose.yaml").is_file() or (folder / "docker-compose.yml").is_file():
        dockerfile = _compose_dockerfile(folder)
    elif (folder / "Dockerfile").is_file():
        dockerfile = "Dockerfile"
    else:
        raise TaskError(f"{folder / 'Dockerfile'}: missing (the task's environment is built from a Dockerfile "
                        "or a single-service docker-compose.yaml)")
    if not (folder / "tests" / "test_outputs.py").is_file():
        raise TaskError(f"{folder / 'tests' / 'test_outputs.py'}: missing (hidden tests verify the episode)")
    instruction = spec.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise TaskError(f"{spec_path}: field 'instruction' must be a non-empty string")
    parser = spec.get("parser_name", "pytest")
    if parser not in SUPPORTED_PARSERS:
        raise TaskError(f"{spec_path}: field 'parser_name' is {parser!r}; supported: {', '.join(SUPPORTED_PARSERS)}")

    def seconds(key: str, default: float) -> float:
        value = spec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not is_finite(value) or value <= 0:
            raise TaskError(f"{spec_path}: field '{key}' must be a positive number of seconds, got {value!r}")
        return float(value)

    tags = spec.get("tags", []) or []
    if not isinstance(tags, list):
        raise TaskError(f"{spec_path}: field 'tags' must be a list")
    setup_command = spec.get("setup_command", "") or ""
    if not isinstance(setup_command, str):
        raise TaskError(f"{spec_path}: field 'setup_command' must be a string")
    solution = folder / "solution.sh"
    return TerminalBenchTask(
        task_id=f"tb/{folder.name}",
        instruction=instruction.strip(),
        build_context=folder,
        tests_dir=folder / "tests",
        agent_timeout_s=seconds("max_agent_timeout_sec", 120.0),
        command_timeout_s=seconds("per_command_timeout_sec", 10.0),
        verifier_timeout_s=seconds("max_test_timeout_sec", 30.0),
        difficulty=str(spec.get("difficulty", "")),
        tags=tuple(str(t) for t in tags),
        dockerfile=dockerfile,
        solution=read_task_text(solution) if solution.is_file() else None,
        setup_command=setup_command.strip(),
    )


def load_terminal_tasks(root: Path) -> tuple[list[Task], list[str]]:
    """Load every task folder directly under ``root`` (sorted by name).

    Returns:
        (tasks, errors): loaded tasks, and one message per folder that failed to load.

    Raises:
        TaskError: ``root`` is not a folder.
    """
    if not root.is_dir():
        raise TaskError(f"{root}: task folder not found")
    tasks, errors = [], []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            tasks.append(load_terminal_task(folder))
        except TaskError as e:
            errors.append(str(e))
        except (OSError, ValueError, TypeError, OverflowError) as e:  # unreadable file, a value no check foresaw
            errors.append(f"{folder}: cannot be read ({type(e).__name__}: {e})")
    return tasks, errors
