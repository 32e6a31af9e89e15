"""The harness seam: what acts in an episode, and our own bash-fence harness behind it.

A :class:`Harness` drives one episode through an :class:`EpisodeIO` that the episode runner
(``infra.rollout.collector``) provides: it opens the transcript, asks for model turns (sampled by
the rollout engine, token-exact: the runner records every id, logprob and policy version), runs
commands in the episode's sandbox and appends observations, until it ends the episode. The runner
owns everything around it: sandbox acquisition, verification, classification of infra failures,
cancellation. Another harness (a third-party agent loop) implements the same ``act``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from envs.agent import FORMAT_REMINDER, initial_messages, observation, parse_action
from envs.task import Task

if TYPE_CHECKING:
    from infra.sandbox.base import ExecResult


class EpisodeIO(Protocol):
    """What a harness may do in its episode. Each call returns None once the runner ended the episode.

    Ends the runner decides (the harness just stops): the context is full (``context_full``), the
    engine is unreachable or the attempt was cancelled (infra failures), the sandbox failed (infra
    failure, or ``environment_broken``: the model's doing).
    """

    task: Task
    num_turns: int  # model turns sampled so far
    tool_s: float  # seconds the episode's commands took so far (the agent's budget is counted in these)

    @property
    def workdir(self) -> str | None:
        """The sandbox's working directory (its image's ``WORKDIR``, ``/`` when none), where commands start.

        Starts the episode's sandbox when it has none yet. None: the sandbox failed to start (the runner
        ended the episode) or the task acts in none.
        """

    def start(self, messages: list[dict[str, str]]) -> None:
        """Open the transcript with these chat messages (template tokens, not sampled)."""

    def sample(self) -> str | None:
        """One model turn on the transcript; returns its text (None: the episode ended)."""

    def execute(self, command: str) -> ExecResult | None:
        """Run ``command`` in the sandbox's persistent shell with the task's per-command deadline.

        The shell is the episode's own (``Sandbox.run_in_shell``): ``cd``, variables and jobs persist
        across commands. None: the episode ended.
        """

    def observe(self, text: str) -> None:
        """Append ``text`` as the next user turn."""

    def end(self, agent_end: str) -> None:
        """The harness ends the episode: ``done``, ``max_turns``, ``agent_timeout``, ``single_turn``."""


class Harness(Protocol):
    """Acts in one episode until it ends (see :class:`EpisodeIO`)."""

    name: str

    def act(self, io: EpisodeIO, max_turns: int) -> None:
        """Drive the episode; return when it has ended."""


class BashFenceHarness:
    """Our agent protocol (``envs.agent``): one command per turn in a ```bash fence, ``DONE`` to finish.

    Terminal tasks run up to ``max_turns`` commands or until their tool-time budget is spent; a reply
    without a command gets the format reminder; code tasks are one turn.
    """

    name = "bash-fence"

    def act(self, io: EpisodeIO, max_turns: int) -> None:
        """Run the turn loop (see the class docstring)."""
        task = io.task
        workdir = None
        if task.acts_in_sandbox:  # the prompt names where the shell starts: the sandbox's own working directory
            workdir = io.workdir
            if workdir is None:  # the sandbox failed to start: the runner ended the episode
                return
        io.start(initial_messages(task, workdir))
        while (reply := io.sample()) is not None:
            if not task.acts_in_sandbox:
                io.end("single_turn")
                return
            action = parse_action(reply)
            if action.command is None:
                if action.done:
                    io.end("done")
                    return
                obs = FORMAT_REMINDER
            else:
                result = io.execute(action.command)
                if result is None:
                    return
                obs = observation(result.exit_code, result.output, result.timed_out, task.command_timeout_s)
                if action.done:
                    io.end("done")
                    return
            if io.num_turns >= max_turns:
                io.end("max_turns")
                return
            if io.tool_s >= task.agent_timeout_s:
                io.end("agent_timeout")
                return
            io.observe(obs)
