"""Harbor task folders (the format of Harbor and Terminal-Bench 2).

A folder holds ``task.toml``, ``instruction.md``, ``environment/Dockerfile``, hidden
``tests/test.sh`` (the verifier entry point: it writes a float to ``/logs/verifier/reward.txt``
or ``{"reward": x}`` to ``/logs/verifier/reward.json``) and the reference solution
``solution/solve.sh``. ``task.toml`` fields read (Harbor's names, schema 1.x):

- ``[agent] timeout_sec``: the episode budget; ``[agent] command_timeout_sec`` (our extension,
  default 10): the limit for one command;
- ``[verifier] timeout_sec``: the limit for ``tests/test.sh``;
- ``[environment] cpus``, ``memory_mb`` (or ``memory = "2G"``), ``storage_mb`` (or ``storage``),
  ``allow_internet``; ``build_timeout_sec`` is read and checked but not enforced;
  ``setup_command`` (our extension): run once after start, snapshotted, attempts start from it;
- ``[metadata] difficulty``, ``tags``, ``category``.

Unknown keys are ignored, as Harbor ignores them. Not supported (load errors):
``environment/docker-compose.yaml`` with more than one service, multi-step tasks (``steps/``).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from envs.task import SandboxLimits, Task, TaskError, TerminalTask, Verdict, is_finite, read_task_text
from envs.verify import verify_harbor

if TYPE_CHECKING:
    from infra.sandbox.base import Sandbox


@dataclass(frozen=True, kw_only=True)
class HarborTask(TerminalTask):
    """A Harbor task: verified by its ``tests/test.sh``, which writes the reward file."""

    task_format: ClassVar[str] = "harbor"
    verifier_name: ClassVar[str] = "harbor"

    def verify(self, sandbox: Sandbox, final_reply: str) -> Verdict:
        """``tests/test.sh`` run with a fresh ``/logs/verifier``; reward read from it (``envs.verify``)."""
        return verify_harbor(sandbox, self)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_MB_PER_UNIT = {"": 1 / 2**20, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}


def _size_mb(value: object, where: str) -> int:
    """``2048`` (MiB) or ``"2G"``/``"512M"`` as MiB.

    Raises:
        TaskError: anything else; the message names ``where``.
    """
    if isinstance(value, int | float) and not isinstance(value, bool) and is_finite(value) and value > 0:
        return int(value)
    if isinstance(value, str) and (m := _SIZE.match(value)):
        return max(1, int(float(m.group(1)) * _MB_PER_UNIT[m.group(2).upper()]))
    raise TaskError(f"{where} must be a positive size in MiB or a string like '2G', got {value!r}")


def load_harbor_task(folder: Path) -> Task:
    """Load one Harbor task folder.

    Raises:
        TaskError: a missing file, unparseable TOML, or a field of the wrong type; the message
            names the file and the field.
    """
    spec_path = folder / "task.toml"
    try:
        spec = tomllib.loads(read_task_text(spec_path))
    except FileNotFoundError as e:
        raise TaskError(f"{spec_path}: missing (a Harbor task needs task.toml)") from e
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"{spec_path}: not valid TOML: {e}") from e
    if (folder / "steps").is_dir():
        raise TaskError(f"{folder / 'steps'}: multi-step Harbor tasks are not supported")
    instruction_path = folder / "instruction.md"
    if not instruction_path.is_file() or not read_task_text(instruction_path).strip():
        raise TaskError(f"{instruction_path}: missing or empty (the instruction the agent is given)")
    env_dir = folder / "environment"
    if (env_dir / "docker-compose.yaml").is_file():
        from envs.terminal_bench import _compose_dockerfile

        dockerfile = _compose_dockerfile(env_dir)
    elif (env_dir / "Dockerfile").is_file():
        dockerfile = "Dockerfile"
    else:
        raise TaskError(f"{env_dir / 'Dockerfile'}: missing (the task's environment is built from it)")
    if not (folder / "tests" / "test.sh").is_file():
        raise TaskError(f"{folder / 'tests' / 'test.sh'}: missing (the verifier entry point)")

    def section(name: str) -> dict:
        value = spec.get(name, {})
        if not isinstance(value, dict):
            raise TaskError(f"{spec_path}: [{name}] must be a table")
        return value

    def seconds(table: str, key: str, default: float) -> float:
        value = section(table).get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not is_finite(value) or value <= 0:
            raise TaskError(f"{spec_path}: field '{table}.{key}' must be a positive number of seconds, got {value!r}")
        return float(value)

    env = section("environment")
    cpus = env.get("cpus")
    if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, int | float) or not is_finite(cpus)
                             or cpus <= 0):
        raise TaskError(f"{spec_path}: field 'environment.cpus' must be a positive number, got {cpus!r}")
    memory = env.get("memory_mb", env.get("memory"))
    memory_mb = _size_mb(memory, f"{spec_path}: field 'environment.memory_mb'") if memory is not None else None
    disk_mb = None
    for key in ("storage_mb", "storage"):
        if key in env:
            disk_mb = _size_mb(env[key], f"{spec_path}: field 'environment.{key}'")
    seconds("environment", "build_timeout_sec", 600.0)
    allow_internet = env.get("allow_internet", False)
    if not isinstance(allow_internet, bool):
        raise TaskError(f"{spec_path}: field 'environment.allow_internet' must be true or false")
    setup_command = env.get("setup_command", "")
    if not isinstance(setup_command, str):
        raise TaskError(f"{spec_path}: field 'environment.setup_command' must be a string")
    meta = section("metadata")
    tags = meta.get("tags", []) or []
    if not isinstance(tags, list):
        raise TaskError(f"{spec_path}: field 'metadata.tags' must be a list")
    solution = folder / "solution" / "solve.sh"
    return HarborTask(
        task_id=f"harbor/{folder.name}",
        instruction=read_task_text(instruction_path).strip(),
        build_context=env_dir,
        tests_dir=folder / "tests",
        agent_timeout_s=seconds("agent", "timeout_sec", 600.0),
        command_timeout_s=seconds("agent", "command_timeout_sec", 10.0),
        verifier_timeout_s=seconds("verifier", "timeout_sec", 120.0),
        difficulty=str(meta.get("difficulty", "")),
        tags=tuple(str(t) for t in tags) + ((str(meta["category"]),) if "category" in meta else ()),
        dockerfile=dockerfile,
        solution=read_task_text(solution) if solution.is_file() else None,
        limits=SandboxLimits(cpus=float(cpus) if cpus is not None else None, memory_mb=memory_mb,
                             network=allow_internet, disk_mb=disk_mb),
        setup_command=setup_command.strip(),
    )
