"""Terminal-Bench 1.x task folders: ``task.yaml``, ``Dockerfile``, ``tests/``, ``solution.sh``.

``load_terminal_tasks(dir)`` loads every task folder under ``dir``. A broken folder does not stop
the others: it is returned in the error list with a message naming the file and the problem.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from envs.task import Task, TaskError


def load_terminal_task(folder: Path) -> Task:
    """Load one Terminal-Bench task folder.

    Raises:
        TaskError: missing ``task.yaml``/``Dockerfile``/``tests/``, unparseable YAML, or a field of
            the wrong type; the message names the file and field.
    """
    spec_path = folder / "task.yaml"
    if not spec_path.is_file():
        raise TaskError(f"{spec_path}: missing (a Terminal-Bench task needs task.yaml)")
    try:
        spec = yaml.safe_load(spec_path.read_text())
    except yaml.YAMLError as e:
        raise TaskError(f"{spec_path}: not valid YAML: {e}") from e
    if not isinstance(spec, dict):
        raise TaskError(f"{spec_path}: expected a mapping at top level, got {type(spec).__name__}")
    if not (folder / "Dockerfile").is_file():
        raise TaskError(f"{folder / 'Dockerfile'}: missing (the task's environment is built from it)")
    if not (folder / "tests").is_dir():
        raise TaskError(f"{folder / 'tests'}: missing (hidden tests verify the episode)")
    instruction = spec.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise TaskError(f"{spec_path}: field 'instruction' must be a non-empty string")

    def seconds(key: str, default: float) -> float:
        value = spec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise TaskError(f"{spec_path}: field '{key}' must be a positive number of seconds, got {value!r}")
        return float(value)

    tags = spec.get("tags", []) or []
    if not isinstance(tags, list):
        raise TaskError(f"{spec_path}: field 'tags' must be a list")
    return Task(
        task_id=f"tb/{folder.name}",
        kind="terminal",
        instruction=instruction.strip(),
        build_context=folder,
        tests_dir=folder / "tests",
        agent_timeout_s=seconds("max_agent_timeout_sec", 120.0),
        command_timeout_s=seconds("per_command_timeout_sec", 10.0),
        verifier_timeout_s=seconds("max_test_timeout_sec", 30.0),
        difficulty=str(spec.get("difficulty", "")),
        tags=tuple(str(t) for t in tags),
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
    return tasks, errors
