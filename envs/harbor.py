"""Harbor task folders (the format of Harbor and Terminal-Bench 2).

A folder holds ``task.toml``, ``instruction.md``, ``environment/Dockerfile``, hidden
``tests/test.sh`` (the verifier entry point: it writes a float to ``/logs/verifier/reward.txt``
or ``{"reward": x}`` to ``/logs/verifier/reward.json``) and the reference solution
``solution/solve.sh`` (with whatever else ``solution/`` holds). ``task.toml`` fields read
(Harbor's names and defaults, ``harbor/models/task/config.py``, harbor 0.26):

- ``[agent] timeout_sec``: the episode budget and the reference solution's limit (Harbor's
  default is no limit; ours 600 s, as a budget must be finite); ``[agent] command_timeout_sec``
  (our extension, default: the agent timeout): the limit for one command;
- ``[verifier] timeout_sec`` (default 600): the limit for ``tests/test.sh``; ``[verifier] env``:
  added to ``test.sh``'s environment;
- ``[solution] env``: added to ``solve.sh``'s environment (with ``DEBIAN_FRONTEND=noninteractive``,
  as Harbor's oracle sets it);
- ``[environment] cpus``, ``memory_mb`` (or ``memory = "2G"``), ``storage_mb`` (or ``storage``):
  no default (the backend's: no limit, as Harbor); ``network_mode`` (``public`` or ``no-network``)
  or the older ``allow_internet``: network access, on unless the task turns it off, as Harbor's
  default ``public`` (``tasks.sandbox_network = "none"`` turns it off for a run); ``build_timeout_sec`` is read and
  checked but not enforced; ``setup_command`` (our extension): run once after start,
  snapshotted, attempts start from it;
- ``[metadata] difficulty``, ``tags``, ``category``.

``env`` values may be ``${VAR}`` or ``${VAR:-default}`` templates, resolved from this process's
environment when the task is loaded (Harbor resolves them on the host at run time, the same
source); an unset variable without a default is a load error.

Verification and the reference run follow Harbor (``envs/verify.py``, ``verify_harbor``;
``harbor/agents/oracle.py``, ``OracleAgent.run``): the whole ``solution/`` folder is uploaded to
``/solution`` and ``/solution/solve.sh`` runs directly, in the image's WORKDIR.

An ``environment/docker-compose.yaml`` with more services runs through Docker Compose, as Harbor
merges it over its base file: the agent acts in ``main`` (built from ``environment/Dockerfile``
unless the file builds it otherwise), the others beside it (``infra.sandbox.compose``).

Unknown keys are ignored, as Harbor ignores them. Not supported (load errors): a compose service
not built from the task folder, multi-step tasks (``steps/``),
``[environment] workdir`` (a WORKDIR override the sandbox cannot
apply to the agent's commands).
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from envs.task import SandboxLimits, Task, TaskError, TerminalTask, Verdict, is_finite, read_task_text, tree_hash
from envs.verify import verify_harbor

if TYPE_CHECKING:
    from infra.sandbox.base import ExecResult, Sandbox

SOLUTION_DIR = "/solution"
COMPOSE_MAIN = "main"
"""The service the agent acts in, in a multi-service ``environment/docker-compose.yaml`` (Harbor's)."""
"""Where Harbor's oracle uploads ``solution/`` (``EnvironmentPaths.solution_dir``)."""


@dataclass(frozen=True, kw_only=True)
class HarborTask(TerminalTask):
    """A Harbor task: verified by its ``tests/test.sh``, which writes the reward file.

    Attributes:
        solution_dir: the ``solution/`` folder, uploaded whole for the reference run; None: none.
        verifier_env: ``[verifier] env``, resolved: added to ``test.sh``'s environment.
        solution_env: ``[solution] env``, resolved: added to ``solve.sh``'s environment.
    """

    solution_dir: Path | None = None
    verifier_env: tuple[tuple[str, str], ...] = ()
    solution_env: tuple[tuple[str, str], ...] = ()
    task_format: ClassVar[str] = "harbor"
    verifier_name: ClassVar[str] = "harbor"

    def verify(self, sandbox: Sandbox, final_reply: str) -> Verdict:
        """``tests/test.sh`` run with a fresh ``/logs/verifier``; reward read from it (``envs.verify``)."""
        return verify_harbor(sandbox, self)

    def run_solution(self, sandbox: Sandbox) -> ExecResult:
        """Harbor's oracle: ``solution/`` uploaded to ``/solution``, ``solve.sh`` run directly, ``[solution] env``."""
        if self.solution_dir is not None:
            sandbox.put_dir(self.solution_dir, SOLUTION_DIR)
        else:  # a Task built by hand with only the script's text
            sandbox.exec(f"mkdir -p {SOLUTION_DIR}", timeout_s=10, workdir="/")
            sandbox.put_file((self.solution or "").encode(), f"{SOLUTION_DIR}/solve.sh")
        env = {"DEBIAN_FRONTEND": "noninteractive", **dict(self.solution_env)}
        return sandbox.exec(f"chmod +x {SOLUTION_DIR}/solve.sh && {SOLUTION_DIR}/solve.sh",
                            timeout_s=self.agent_timeout_s, env=env)

    def verification_parts(self) -> list[str]:
        """As :meth:`TerminalTask.verification_parts`, with the solution folder's hash and both env tables."""
        parts = super().verification_parts()
        parts[0] = "harbor-0.26"  # the verifier runs test.sh as Harbor 0.26 does (a new key for cached verdicts)
        parts[2] = f"{parts[2]}\0{tree_hash(self.solution_dir)}"
        parts[3] = repr((self.verifier_env, self.solution_env))
        return parts


_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")  # harbor/utils/env.py, _TEMPLATE_PATTERN


def _env_table(value: object, where: str) -> tuple[tuple[str, str], ...]:
    """An ``env`` table, its ``${VAR}`` / ``${VAR:-default}`` templates resolved (Harbor's ``resolve_env_vars``).

    Raises:
        TaskError: not a table of strings, or a template naming an unset variable without default.
    """
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TaskError(f"{where} must be a table of strings (NAME = \"value\"), got {value!r}")
    resolved = []
    for key, raw in value.items():
        m = _TEMPLATE.fullmatch(raw)
        if m is None:
            resolved.append((key, raw))
        elif m.group(1) in os.environ:
            resolved.append((key, os.environ[m.group(1)]))
        elif m.group(2) is not None:
            resolved.append((key, m.group(2)))
        else:
            raise TaskError(f"{where}.{key}: environment variable {m.group(1)!r} is not set and has no default")
    return tuple(resolved)


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
    context, services = env_dir, None
    if (env_dir / "docker-compose.yaml").is_file():
        from envs.terminal_bench import compose_build

        default = (env_dir, "Dockerfile") if (env_dir / "Dockerfile").is_file() else None
        context, dockerfile, services = compose_build(env_dir / "docker-compose.yaml", main=COMPOSE_MAIN,
                                                      main_build=default)
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
    network, egress_hosts = _network(env, spec_path)
    if "workdir" in env:
        raise TaskError(f"{spec_path}: field 'environment.workdir' is not supported (the sandbox runs commands in "
                        "the image's WORKDIR; set WORKDIR in environment/Dockerfile instead)")
    setup_command = env.get("setup_command", "")
    if not isinstance(setup_command, str):
        raise TaskError(f"{spec_path}: field 'environment.setup_command' must be a string")
    meta = section("metadata")
    tags = meta.get("tags", []) or []
    if not isinstance(tags, list):
        raise TaskError(f"{spec_path}: field 'metadata.tags' must be a list")
    solution = folder / "solution" / "solve.sh"
    agent_timeout_s = seconds("agent", "timeout_sec", 600.0)
    return HarborTask(
        task_id=f"harbor/{folder.name}",
        instruction=read_task_text(instruction_path).strip(),
        build_context=context,
        tests_dir=folder / "tests",
        agent_timeout_s=agent_timeout_s,
        command_timeout_s=seconds("agent", "command_timeout_sec", agent_timeout_s),
        verifier_timeout_s=seconds("verifier", "timeout_sec", 600.0),
        difficulty=str(meta.get("difficulty", "")),
        tags=tuple(str(t) for t in tags) + ((str(meta["category"]),) if "category" in meta else ()),
        dockerfile=dockerfile,
        solution=read_task_text(solution) if solution.is_file() else None,
        limits=SandboxLimits(cpus=float(cpus) if cpus is not None else None, memory_mb=memory_mb,
                             network=network, disk_mb=disk_mb, services=services, egress_hosts=egress_hosts),
        setup_command=setup_command.strip(),
        solution_dir=solution.parent if solution.is_file() else None,
        verifier_env=_env_table(section("verifier").get("env", {}), f"{spec_path}: field 'verifier.env'"),
        solution_env=_env_table(section("solution").get("env", {}), f"{spec_path}: field 'solution.env'"),
    )


def _network(env: dict, spec_path: Path) -> tuple[bool, tuple[str, ...] | None]:
    """Whether the sandbox gets network, and its allowlist: ``network_mode`` (Harbor), else ``allow_internet``.

    Default on, as Harbor's (``network_mode = "public"``); ``"allowlist"`` with ``allowed_hosts`` (host
    patterns, ``*.example.com``) reaches only those hosts, enforced by the egress proxy (``infra.egress``);
    ``tasks.sandbox_network = "none"`` turns it off for a whole run.

    Returns:
        (network, allowed hosts or None for any host).

    Raises:
        TaskError: a value of the wrong type, an unknown mode, or an allowlist without ``allowed_hosts``.
    """
    mode = env.get("network_mode")
    if mode is not None:
        if mode not in ("public", "no-network", "allowlist"):
            raise TaskError(f"{spec_path}: field 'environment.network_mode' must be 'public', 'no-network' or "
                            f"'allowlist', got {mode!r}")
        if mode == "allowlist":
            hosts = env.get("allowed_hosts")
            if not isinstance(hosts, list) or not all(isinstance(h, str) and h for h in hosts):
                raise TaskError(f"{spec_path}: field 'environment.allowed_hosts' must be a list of host names "
                                "(network_mode = 'allowlist')")
            return True, tuple(hosts)
        return mode == "public", None
    allow_internet = env.get("allow_internet", True)
    if not isinstance(allow_internet, bool):
        raise TaskError(f"{spec_path}: field 'environment.allow_internet' must be true or false")
    return allow_internet, None
