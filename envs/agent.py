"""The terminal agent's protocol: what the model is told and how its replies become actions.

The model answers each turn with one shell command in a fenced ```bash block, or with the
word ``DONE`` on a line of its own when it has finished. Its command's output is sent back as
the next user message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from envs.task import Task


def system_prompt(workdir: str) -> str:
    """The terminal agent's system prompt, naming the sandbox's working directory ``workdir``.

    ``workdir`` is where the agent's shell starts: the image's ``WORKDIR``, ``/`` when it sets none
    (``Sandbox.workdir``).
    """
    return (
        "You are an agent working in a Linux shell. Each turn, reply with exactly one shell command "
        f"in a ```bash code block; you will see its output. The working directory is {workdir}. "
        "When the task is complete, reply with DONE."
        # One worked exchange: SmolLM2-135M's first reply holds a bash block 80% of the time with it and
        # 42% without (144 first turns over 5 multi-turn instructions, temperature 0.7, probed 2026-12-01
        # with workdir /app).
        f"\n\nExample:\nuser: Show the files in {workdir}.\nassistant: ```bash\nls {workdir}\n```\n"
        "user: notes.txt\n[exit code 0]\nassistant: DONE"
    )


SYSTEM_PROMPT = system_prompt("/app")
"""The prompt in a sandbox whose image sets ``WORKDIR /app`` (Terminal-Bench's images; the prompt probed)."""
CODE_SYSTEM_PROMPT = "You are an expert Python programmer."

# Fences pair left to right (an opening fence with any info string, then its closing fence), so a
# closing fence is never mistaken for the opening of a new block.
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)(?:```|\Z)", re.DOTALL)
_SHELL_LANGS = ("", "bash", "sh", "shell", "console")
_DONE = re.compile(r"^\s*DONE\s*\.?\s*$", re.MULTILINE)
OBSERVATION_LIMIT_CHARS = 2000


@dataclass(frozen=True)
class Action:
    """The parsed reply: a command to run, or done (``command`` is None and ``done`` True)."""

    command: str | None
    done: bool


def initial_messages(task: Task, workdir: str | None = None) -> list[dict[str, str]]:
    """The chat that opens an episode; ``workdir``: the sandbox's working directory (tasks that act in one).

    Raises:
        ValueError: ``task`` acts in a sandbox and ``workdir`` is None (the prompt names it).
    """
    if not task.acts_in_sandbox:
        system = CODE_SYSTEM_PROMPT
    elif workdir is None:
        raise ValueError(f"{task.task_id}: acts in a sandbox; its prompt needs the sandbox's working directory")
    else:
        system = system_prompt(workdir)
    return [{"role": "system", "content": system}, {"role": "user", "content": task.instruction}]


def parse_action(reply: str) -> Action:
    """Parse one model reply.

    The command is the first fenced block tagged bash/sh/shell/console or untagged (blocks in
    other languages are skipped). A command wins over ``DONE`` when both are present: the command
    runs, and the episode ends after it when ``DONE`` follows the block. A reply with neither is
    neither a command nor done: the harness answers it with a format reminder.
    """
    for block in _FENCE.finditer(reply):
        if block.group(1).strip().lower() in _SHELL_LANGS and block.group(2).strip():
            return Action(block.group(2).strip(), done=bool(_DONE.search(reply[block.end():])))
    return Action(None, done=bool(_DONE.search(reply)))


def observation(exit_code: int, output: str, timed_out: bool, timeout_s: float) -> str:
    """The user message that reports a command's result to the model."""
    text = output if len(output) <= OBSERVATION_LIMIT_CHARS else output[:OBSERVATION_LIMIT_CHARS] + "\n[truncated]"
    if timed_out:
        return f"{text}\n[command killed after {timeout_s:g} s]"
    return f"{text}\n[exit code {exit_code}]"


FORMAT_REMINDER = "No command found. Reply with one command in a ```bash block, or DONE."
