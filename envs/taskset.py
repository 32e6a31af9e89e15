"""``load_taskset(path)``: detect a task set's format and load it through the one Task contract.

Detected per entry:

- a folder with ``task.toml`` is a Harbor task (``envs/harbor.py``);
- a folder with ``task.yaml`` is a Terminal-Bench 1.x task (``envs/terminal_bench.py``);
- a ``.jsonl`` / ``.jsonl.gz`` file is a set of HumanEval-format problems (``envs/humaneval.py``).

``path`` may be one task folder, one JSONL file, or a folder of any mix of those. A broken entry
never stops the others: it is listed in the errors with the file and field at fault.
"""

from __future__ import annotations

from pathlib import Path

from envs.harbor import load_harbor_task
from envs.humaneval import load_humaneval
from envs.task import Task, TaskError
from envs.terminal_bench import load_terminal_task


def detect_format(entry: Path) -> str | None:
    """``harbor``, ``terminal-bench``, ``humaneval`` or None when ``entry`` is none of them."""
    if entry.is_dir():
        if (entry / "task.toml").is_file():
            return "harbor"
        if (entry / "task.yaml").is_file():
            return "terminal-bench"
        return None
    if entry.name.endswith((".jsonl", ".jsonl.gz")):
        return "humaneval"
    return None


def _load_entry(entry: Path, fmt: str) -> list[Task]:
    if fmt == "harbor":
        return [load_harbor_task(entry)]
    if fmt == "terminal-bench":
        return [load_terminal_task(entry)]
    try:
        return load_humaneval(path=str(entry))
    except (ValueError, KeyError, TypeError, OSError, EOFError) as e:  # JSON/Unicode decode errors are ValueErrors
        raise TaskError(f"{entry}: not a readable HumanEval-format JSONL ({type(e).__name__}: {e})") from e


def load_taskset(path: str | Path) -> tuple[list[Task], list[str]]:
    """Load every task under ``path``, whatever its format.

    Args:
        path: a task folder, a JSONL of problems, or a folder holding any mix of those
            (entries sorted by name; hidden entries skipped).

    Returns:
        (tasks, errors): the tasks loaded, and one message per entry that failed, naming its
        file and field.

    Raises:
        TaskError: ``path`` does not exist, or holds no task of a known format.
    """
    root = Path(path)
    if not root.exists():
        raise TaskError(f"{root}: task set not found")
    fmt = detect_format(root)
    if fmt is not None:
        return _load_entry(root, fmt), []
    if not root.is_dir():
        raise TaskError(f"{root}: not a task folder (task.toml or task.yaml), a HumanEval JSONL, or a folder of those")
    tasks: list[Task] = []
    errors: list[str] = []
    entries = [e for e in sorted(root.iterdir()) if not e.name.startswith((".", "_"))]
    for entry in entries:
        fmt = detect_format(entry)
        if fmt is None:
            if entry.is_dir():
                errors.append(f"{entry}: neither task.toml (Harbor) nor task.yaml (Terminal-Bench) found")
            continue
        try:
            tasks.extend(_load_entry(entry, fmt))
        except TaskError as e:
            errors.append(str(e))
        except (OSError, ValueError, TypeError, OverflowError) as e:  # unreadable file, a value no check foresaw
            errors.append(f"{entry}: cannot be read ({type(e).__name__}: {e})")
    if not tasks and not errors:
        raise TaskError(f"{root}: holds no task of a known format (Harbor, Terminal-Bench, HumanEval JSONL)")
    seen: set[str] = set()
    for t in tasks:
        if t.task_id in seen:
            errors.append(f"{root}: task id {t.task_id} appears twice; the first one is kept")
        seen.add(t.task_id)
    unique = {}
    for t in tasks:
        unique.setdefault(t.task_id, t)
    return list(unique.values()), errors
