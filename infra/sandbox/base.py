"""The sandbox backend protocol.

A sandbox is one isolated container an episode acts in. Backends raise :class:`SandboxInfraError`
for anything that is the infrastructure's fault (start failure, container vanished, engine API
error or unreachable), so the harness can classify the episode as ``infra_failure``; a command
that hits its own deadline is *not* an error, it is reported in :class:`ExecResult`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from envs.task import ComposeServices


class SandboxInfraError(RuntimeError):
    """The sandbox failed for reasons outside the model's control.

    Attributes:
        reason: a short reason code (``sandbox_start_failed``, ``container_vanished``,
            ``docker_api_error``, ``engine_unreachable``, ``shell_failed``: the persistent shell's
            driver reported nothing; ``file_unstable``: every read of a file was cut before its header;
            ``exec_start_failed``: the runtime could not start a process in it, attempt after attempt).
    """

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class ExecResult:
    """What one command did.

    Attributes:
        exit_code: the command's exit status (137 when killed, or interrupted, at its deadline).
        output: stdout and stderr, decoded, possibly truncated to the backend's limit.
        timed_out: the command hit its per-command deadline (enforced inside the container).
        duration_s: wall-clock seconds the exec took.
    """

    exit_code: int
    output: str
    timed_out: bool
    duration_s: float


class Sandbox(Protocol):
    """One started container."""

    sandbox_id: str
    workdir: str
    """The image's ``WORKDIR`` (``/`` when it sets none), where commands run unless told otherwise."""
    phase: str
    """``agent`` until verification sets ``verifier`` (``envs.verify``): whose egress session ``exec`` uses."""

    def egress_record(self) -> dict[str, dict]:
        """What each phase sent out through the egress proxy (``EgressSummary`` fields by phase); {} when none."""
        ...

    def exec(self, command: str, timeout_s: float, workdir: str | None = None,
             env: dict[str, str] | None = None, output_limit_bytes: int = 16_384) -> ExecResult:
        """Run a shell command with a deadline enforced inside the sandbox.

        It runs in ``workdir`` (default: the image's ``WORKDIR``), with ``env`` added to the environment;
        its output (stdout and stderr merged) is cut to its first ``output_limit_bytes``.
        """
        ...

    def run_in_shell(self, command: str, timeout_s: float) -> ExecResult:
        """Run the agent's ``command`` in the sandbox's persistent shell, with a deadline.

        One shell per sandbox (so per episode), started in :attr:`workdir` on first use: what a
        command does to the shell (``cd``, ``export``, ``source``, functions, jobs started with ``&``)
        persists to the next. Output is stdout and stderr merged, truncated as :meth:`exec`'s; stdin
        is the terminal (a command reading it waits until its deadline). At the deadline the command
        is interrupted (``C-c``) and reported ``timed_out`` with exit 137, and the shell stays usable;
        a command that ends the shell (``exit``) reports its status, and the next one runs in a new
        shell, which its output says. Backends without a persistent shell run it as :meth:`exec`.
        """
        ...

    def changes(self) -> list[tuple[str, str]]:
        """What the sandbox changed against its image (``docker diff``): ``[(kind, path)]``, kind A/C/D."""
        ...

    def stop_agent_processes(self) -> int:
        """Kill every process the agent left running (before verification); returns how many."""
        ...

    def put_dir(self, local_dir: Path, dest: str) -> None:
        """Copy a local folder's contents to ``dest`` inside the sandbox (replacing what is there)."""
        ...

    def put_file(self, data: bytes, dest: str) -> None:
        """Write ``data`` to the file ``dest`` inside the sandbox."""
        ...

    def get_file(self, path: str) -> bytes | None:
        """Read a regular file from the sandbox; None when it does not exist."""
        ...

    def get_link(self, path: str) -> str | None:
        """The target of the symlink at ``path`` as stored (relative or absolute); None when it is not a symlink."""
        ...

    def close(self) -> None:
        """Remove the sandbox; never raises for an already gone container."""
        ...


class SandboxBackend(Protocol):
    """Starts sandboxes from images."""

    def start(self, image: str, labels: dict[str, str], cpus: float | None = None,
              memory_mb: int | None = None, network: bool = False, disk_mb: int | None = None,
              services: ComposeServices | None = None, egress_hosts: tuple[str, ...] | None = None) -> Sandbox:
        """Start a sandbox from ``image`` with the task's limits; raises SandboxInfraError on failure.

        ``services``: a multi-service task's other services, started beside it. ``egress_hosts``: with
        ``network``, the only hosts it may reach (None: any).
        """
        ...

    def wait_engine(self, timeout_s: float = 60.0) -> bool:
        """Wait until the engine answers again (after a restart); True when it does."""
        ...

    def sweep_leftovers(self) -> int:
        """Remove sandboxes whose removal failed earlier; returns how many remain."""
        ...
