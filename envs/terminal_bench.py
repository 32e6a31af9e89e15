"""Terminal-Bench 1.x task folders.

A folder holds ``task.yaml``, the environment as a ``Dockerfile`` or a ``docker-compose.yaml``
whose services are built from the folder, the hidden ``run-tests.sh`` and
``tests/``, and the reference solution ``solution.sh`` or ``solution.yaml``.
``load_terminal_tasks(dir)`` loads every folder under ``dir``; a broken folder does not stop the
others: it is returned in the error list with a message naming the file and the field.

task.yaml fields read, with upstream's defaults (``terminal_bench/handlers/trial_handler.py``,
``Task``, terminal-bench 0.2.18):

- ``instruction`` (required), ``difficulty``, ``tags``;
- ``parser_name`` (default ``pytest``; also ``swebench``, ``swelancer``, ``mlebench``,
  ``sweperf``: ``envs/parsers.py``);
- ``max_agent_timeout_sec`` (default 360): the episode budget and the reference solution's limit;
- ``max_test_timeout_sec`` (default 60): the limit for ``run-tests.sh`` (upstream's limit for
  the whole test run, despite its description "for each individual test");
- ``run_tests_in_same_shell`` (default false): true gives the tests the agent's shell's cwd and
  exported variables (``envs.verify.agent_shell_state``; upstream types the command into that shell);
- ours: ``per_command_timeout_sec`` (default: ``max_agent_timeout_sec``; upstream has no limit
  per command, only the agent's), ``setup_command`` (an expensive set-up run once and snapshotted).

Verification (``envs/verify.py``): with ``run-tests.sh``, as the upstream harness does it
(``verify_run_tests``); a folder without ``run-tests.sh`` (this project's own older layout) runs
``tests/test_outputs.py`` with the image's pytest under a hardened configuration
(``verify_terminal``). The reference solution runs as upstream's oracle agent runs it
(``terminal_bench/agents/oracle_agent.py``): copied to ``/oracle/solution.sh`` and run with
``bash /oracle/solution.sh`` in the agent's persistent shell (started in the image's WORKDIR); a
``solution.yaml`` is turned into the equivalent script (``solution_yaml_script``).

A multi-service ``docker-compose.yaml`` (a server or database beside the agent) runs through Docker
Compose itself, as upstream's ``DockerComposeManager``: the agent acts in ``client``, the other
services run beside it (``DockerBackend.start`` with ``SandboxLimits.services``).

Not supported (load errors): a compose service not built from the task folder (a registry image
cannot be pulled here), a ``parser_name`` upstream does not have.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import yaml

from envs.parsers import PARSERS
from envs.task import ComposeServices, SandboxLimits, Task, TaskError, TerminalTask, Verdict, is_finite, read_task_text
from envs.verify import verify_run_tests, verify_terminal

SUPPORTED_PARSERS = tuple(PARSERS)
ORACLE_PATH = "/oracle/solution.sh"
COMPOSE_MAIN = "client"
"""The service the agent acts in, in a multi-service compose file (upstream's ``client``)."""
"""Where upstream's oracle agent puts ``solution.sh`` (``OracleAgent.perform_task``)."""

if TYPE_CHECKING:
    from infra.sandbox.base import ExecResult, Sandbox


@dataclass(frozen=True, kw_only=True)
class TerminalBenchTask(TerminalTask):
    """A Terminal-Bench 1.x task.

    Attributes:
        run_tests: the text of ``run-tests.sh``; None: the folder has none, and
            ``tests/test_outputs.py`` runs under our hardened pytest instead.
        parser_name: how ``run-tests.sh``'s output is scored (``envs/parsers.py``).
        run_tests_in_same_shell: task.yaml's flag: the tests get the agent's shell's cwd and exports.
    """

    run_tests: str | None = None
    parser_name: str = "pytest"
    run_tests_in_same_shell: bool = False
    task_format: ClassVar[str] = "terminal-bench"
    verifier_name: ClassVar[str] = "pytest"

    def verify(self, sandbox: Sandbox, final_reply: str) -> Verdict:
        """``run-tests.sh`` as upstream runs it, else the hardened pytest run (``envs.verify``)."""
        if self.run_tests is not None:
            return verify_run_tests(sandbox, self)
        return verify_terminal(sandbox, self)

    def run_solution(self, sandbox: Sandbox) -> ExecResult:
        """Upstream's oracle: the script at ``/oracle/solution.sh``, ``bash`` on it in the agent's shell, agent timeout.

        Upstream types ``bash /oracle/solution.sh`` into the agent's tmux session (started in the
        WORKDIR); here it runs in the same persistent shell the agent's commands use.
        """
        sandbox.exec("mkdir -p /oracle", timeout_s=10, workdir="/")
        sandbox.put_file((self.solution or "").encode(), ORACLE_PATH)
        return sandbox.run_in_shell(f"bash {ORACLE_PATH}", timeout_s=self.agent_timeout_s)

    def verification_parts(self) -> list[str]:
        """As :meth:`TerminalTask.verification_parts`; a ``run-tests.sh`` task adds the script and its parser.

        A folder without ``run-tests.sh`` keeps the parts (and the cached validations) it had.
        """
        parts = super().verification_parts()
        if self.run_tests is not None:
            parts[0] = f"run-tests.sh:{self.parser_name}"
            parts[3] = self.run_tests
        return parts


_SOLUTION_COMMAND_FIELDS = {"command": str, "min_timeout_sec": (int, float), "max_timeout_sec": (int, float),
                            "block": bool, "append_enter": bool}


def solution_yaml_script(path: Path) -> str:
    """The bash script equivalent to an upstream ``solution.yaml`` (a list of ``TerminalCommand``).

    Upstream (``terminal_bench/terminal/models.py``, ``TerminalCommand``; ``OracleAgent``) types each
    ``command`` into one tmux shell, followed by Enter unless ``append_enter: false``. Here the
    commands become the lines of one script run by one bash, so shell state (``cd``, variables)
    carries over as it does in the tmux shell. A command with ``append_enter: false`` is joined to
    the next one on the same line (as typed keys would be); a trailing one is dropped (typed
    but never entered, it never runs upstream either).

    Dropped, as they only matter with tmux: ``block`` and ``min_timeout_sec`` (how long the oracle
    waits before typing the next command: a script runs them one after another anyway) and
    ``max_timeout_sec`` (the whole script is bounded by the agent timeout instead). Not
    reproduced: keys typed into an interactive program (an editor, a REPL) and tmux key names
    (``C-c``, ``Escape``): a script runs each line as a shell command; such a solution fails
    validation instead of passing.

    Raises:
        TaskError: not YAML, not a list of mappings with a string ``command``, or a field of the
            wrong type; the message names the file, the entry and the field.
    """
    try:
        data = yaml.safe_load(read_task_text(path))
    except yaml.YAMLError as e:
        raise TaskError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, list) or not data:
        raise TaskError(f"{path}: expected a non-empty list of commands ({{command: ..., append_enter: ...}})")
    lines: list[str] = []
    pending = ""
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or "command" not in entry:
            raise TaskError(f"{path}: entry {i} must be a mapping with a field 'command'")
        for key, kind in _SOLUTION_COMMAND_FIELDS.items():
            value = entry.get(key)
            if key in entry and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
                want = "a string" if kind is str else "true or false" if kind is bool else "a number of seconds"
                raise TaskError(f"{path}: entry {i} field '{key}' must be {want}, got {value!r}")
        pending += entry["command"]
        if entry.get("append_enter", True):
            lines.append(pending)
            pending = ""
    return "#!/bin/bash\n" + "".join(line + "\n" for line in lines)


def compose_file(folder: Path) -> Path | None:
    """``folder``'s ``docker-compose.yaml`` (or ``.yml``); None when it has none."""
    return next((folder / n for n in ("docker-compose.yaml", "docker-compose.yml") if (folder / n).is_file()), None)


def _service_build(path: Path, name: str, service: object) -> tuple[Path, str]:
    """``(context folder, Dockerfile path in it)`` of compose service ``name``; TaskError naming the field."""
    build = service.get("build") if isinstance(service, dict) else None
    if build is None:
        raise TaskError(f"{path}: field 'services.{name}.build' missing (every service must be built from the "
                        "task folder: a registry image cannot be pulled here)")
    if isinstance(build, str):
        build = {"context": build}
    if not isinstance(build, dict):
        raise TaskError(f"{path}: field 'services.{name}.build' must be a path or a mapping")
    context = (path.parent / str(build.get("context", "."))).resolve()
    if not context.is_dir() or not context.is_relative_to(path.parent.resolve()):
        raise TaskError(f"{path}: field 'services.{name}.build.context' must be a folder inside the task folder, "
                        f"got {build.get('context')!r}")
    dockerfile = str(build.get("dockerfile", "Dockerfile"))
    if not (context / dockerfile).is_file():
        raise TaskError(f"{path}: field 'services.{name}.build.dockerfile' names {dockerfile!r}, "
                        f"which is not a file in {context}")
    return context, dockerfile


def compose_build(path: Path, main: str | None = None, service: str | None = None,
                  main_build: tuple[Path, str] | None = None) -> tuple[Path, str, ComposeServices | None]:
    """The agent's image build (or ``service``'s) and the other services of compose file ``path``.

    One service: that service, built from the task folder (``services`` None). More than one: the
    agent's is ``main`` (Terminal-Bench's ``client``, Harbor's ``main``); every service must be
    built from a folder of the task (each is checked here, so a broken one fails at load).
    ``main_build``: the agent's build when its entry has no ``build`` (Harbor merges the task's file
    over a base whose ``main`` is built from ``environment/Dockerfile``).

    Returns:
        ``(context folder, Dockerfile path in it, services or None)``.

    Raises:
        TaskError: not YAML, no services, a service not built from the task folder, or more than
            one service with no ``main`` among them (or ``main`` None: multi-service unsupported).
    """
    try:
        spec = yaml.safe_load(read_task_text(path))
    except yaml.YAMLError as e:
        raise TaskError(f"{path}: not valid YAML: {e}") from e
    services = spec.get("services") if isinstance(spec, dict) else None
    if not isinstance(services, dict) or not services:
        raise TaskError(f"{path}: field 'services' must hold at least one service")
    def build_of(name: str, spec: object) -> tuple[Path, str]:
        if name == main and main_build is not None and not (isinstance(spec, dict) and "build" in spec):
            return main_build
        return _service_build(path, name, spec)

    if len(services) == 1:
        (name, spec), = services.items()
        context, dockerfile = build_of(name, spec)
        return (path.parent if context.resolve() == path.parent.resolve() else context), dockerfile, None
    if main is None or main not in services:
        raise TaskError(f"{path}: field 'services' holds {len(services)} services and none is "
                        + (f"'{main}' (the service the agent acts in)" if main else
                           "usable here (multi-service tasks are not supported for this format)"))
    if service is not None:  # one service's build (the others were checked when the task loaded)
        context, dockerfile = build_of(service, services[service])
    else:
        builds = {name: build_of(name, spec) for name, spec in services.items()}
        context, dockerfile = builds[main]
    return context, dockerfile, ComposeServices(file=path.resolve(), main=main)


def load_terminal_task(folder: Path) -> Task:
    """Load one Terminal-Bench task folder.

    Raises:
        TaskError: missing ``task.yaml``/environment, no ``run-tests.sh`` and no
            ``tests/test_outputs.py``, unparseable YAML, an unknown parser, or a field of the wrong
            type; the message names the file and field.
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
    context, services = folder, None
    if (compose := compose_file(folder)) is not None:
        context, dockerfile, services = compose_build(compose, main=COMPOSE_MAIN)
    elif (folder / "Dockerfile").is_file():
        dockerfile = "Dockerfile"
    else:
        raise TaskError(f"{folder / 'Dockerfile'}: missing (the task's environment is built from a Dockerfile "
                        "or a single-service docker-compose.yaml)")
    run_tests_path = folder / "run-tests.sh"
    run_tests = read_task_text(run_tests_path) if run_tests_path.is_file() else None
    if run_tests is None and not (folder / "tests" / "test_outputs.py").is_file():
        raise TaskError(f"{folder / 'tests' / 'test_outputs.py'}: missing (hidden tests verify the episode; "
                        "or add run-tests.sh)")
    instruction = spec.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise TaskError(f"{spec_path}: field 'instruction' must be a non-empty string")
    parser = spec.get("parser_name", "pytest")
    if parser not in SUPPORTED_PARSERS:
        raise TaskError(f"{spec_path}: field 'parser_name' is {parser!r}, which is not supported; "
                        f"supported: {', '.join(SUPPORTED_PARSERS)}")
    if parser != "pytest" and run_tests is None:
        raise TaskError(f"{run_tests_path}: missing (field 'parser_name' {parser!r} scores run-tests.sh's output)")

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
    same_shell = spec.get("run_tests_in_same_shell", False)
    if not isinstance(same_shell, bool):
        raise TaskError(f"{spec_path}: field 'run_tests_in_same_shell' must be true or false, got {same_shell!r}")
    # Upstream's TaskPaths.solution_path: solution.sh wins over solution.yaml.
    if (folder / "solution.sh").is_file():
        solution: str | None = read_task_text(folder / "solution.sh")
    elif (folder / "solution.yaml").is_file():
        solution = solution_yaml_script(folder / "solution.yaml")
    else:
        solution = None
    agent_timeout_s = seconds("max_agent_timeout_sec", 360.0)
    return TerminalBenchTask(
        task_id=f"tb/{folder.name}",
        instruction=instruction.strip(),
        build_context=context,
        tests_dir=folder / "tests",
        agent_timeout_s=agent_timeout_s,
        command_timeout_s=seconds("per_command_timeout_sec", agent_timeout_s),
        verifier_timeout_s=seconds("max_test_timeout_sec", 60.0),
        difficulty=str(spec.get("difficulty", "")),
        tags=tuple(str(t) for t in tags),
        dockerfile=dockerfile,
        solution=solution,
        setup_command=setup_command.strip(),
        run_tests=run_tests,
        parser_name=parser,
        run_tests_in_same_shell=same_shell,
        # upstream's compose file puts the container on compose's default network (the internet); no
        # CPU or memory limit unless the compose file sets one (the backend's default: none)
        limits=SandboxLimits(network=True, services=services),
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
