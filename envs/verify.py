"""Verifiers: pure functions of a finished sandbox, returning reward, outcome and reason code.

Terminal tasks: the hidden tests are copied to ``/tests`` only after the agent finished (any
``/tests`` the agent made is removed first). Commands run in the image's ``WORKDIR`` (the sandbox
default), as upstream runs them. Before anything else, what the agent changed against the image
is judged (``envs/tamper.py``, ``check_toolchain``): a shadowed interpreter, test runner, shell or
loader is ``verifier_tampered``, whatever the tests would say. Every verifier's Python reads and
writes bytecode under a fresh ``PYTHONPYCACHEPREFIX``, so a planted ``__pycache__`` is never loaded.

- Terminal-Bench with ``run-tests.sh`` (every upstream task): run as the Terminal-Bench harness
  runs it (``terminal_bench/harness/harness.py``, ``_setup_test_env``, ``_run_tests``,
  ``_parse_results``, ``_is_resolved``): ``tests/`` and ``run-tests.sh`` copied into ``/tests``,
  ``bash /tests/run-tests.sh`` with ``TEST_DIR=/tests`` under ``max_test_timeout_sec``, its output
  scored by the task's parser (``envs/parsers.py``); resolved iff every parsed test passed. Its
  exit status is ignored, as upstream ignores it. The agent's processes keep running, as upstream
  (a server it started is what the tests query); ``/tests`` is compared before and after the run
  instead (``tamper.hidden_tests_findings``).
- Terminal-Bench without ``run-tests.sh`` (this project's own format, which stops the agent's
  processes first): ``tests/test_outputs.py`` runs with pytest, hardened against an agent that
  plants configuration (see ``_PYTEST``).
- Harbor: ``tests/test.sh`` runs as Harbor's verifier runs it (``harbor/verifier/verifier.py``,
  ``Verifier.verify``, harbor 0.26): made executable and run directly, with ``[verifier] env``, its
  output to ``/logs/verifier/test-stdout.txt``; the reward file is read from a ``/logs/verifier``
  emptied just before (an agent cannot pre-write its reward). The agent's processes keep running, as
  in Harbor; ``/tests`` and the reward directory are compared before, at ``test.sh``'s exit and after
  (``tamper.hidden_tests_findings``, ``tamper.reward_findings``).

Not defended (see ``envs/tamper.py`` for the detail): a package the agent built to look like an
install of pytest; code the tests import from the solution, which runs in the test process; an
agent process that writes the reward file while ``test.sh`` runs and stops before it exits; a
``run-tests.sh`` task's tests run as authored, without the pytest hardening (upstream's own
protection is the same: none). Code tasks: the extracted program, followed by the problem's tests,
runs with python3 inside the sandbox.

Reason codes (``Verdict.reason``) of the terminal verifiers:

- ``tests_passed`` (success): every test passed / reward 1.
- ``tests_failed`` (model_failure): the tests ran and at least one failed / reward below 1.
- ``tests_skipped`` (model_failure, hardened pytest only): a test was skipped.
- ``tests_did_not_run`` (unknown): ``run-tests.sh`` printed no result section its parser knows
  (pytest: no ``short test summary info``): the test environment is broken (pytest missing,
  a download that failed), not the solution. Upstream: ``FailureMode.PARSE_ERROR``.
- ``no_tests_collected`` (unknown): a result section without a single test (hardened pytest: a
  JUnit report with 0 tests). Upstream would call an empty pytest summary resolved; we do not.
- ``verifier_timeout`` (unknown): the tests ran past the task's test timeout (upstream
  ``FailureMode.TEST_TIMEOUT``).
- ``verifier_error`` (unknown): the hardened run wrote no readable report, or Harbor's reward
  file does not parse.
- ``no_reward_file`` (unknown, Harbor): ``test.sh`` wrote neither reward file.
- ``verifier_tampered`` (model_failure, reward 0): the agent changed the verifier's toolchain, or
  the tests or reward files changed under the verifier (``envs/tamper.py``); the log lists the paths.

Every unknown verdict keeps the verifier's log tail in ``Verdict.log``.
"""

from __future__ import annotations

import re
import uuid
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from envs import tamper
from envs.parsers import ParseError, parse_test_output
from envs.task import Outcome, Task, TerminalTask, Verdict
from infra.sandbox.base import Sandbox

if TYPE_CHECKING:
    from envs.harbor import HarborTask
    from envs.terminal_bench import TerminalBenchTask

__all__ = ["Verdict", "junit_verdict", "parse_reward", "parsed_verdict", "verify_code", "verify_harbor",
           "verify_run_tests", "verify_terminal"]

_LOG_CHARS = 4000

# pytest runs with our own ini (agent-written pytest.ini/pyproject/setup.cfg are ignored), conftest
# discovery cut at /tests (a /conftest.py or /app/conftest.py written by the agent is not loaded),
# and the verdict read from a JUnit report written by this run (any stale one is removed first):
# every collected test must pass and none may be skipped.
_REPORT = "/tests/.agentrl-verdict.xml"  # not /tmp: a tmpfs the archive API cannot read
_INI = "/tests/.agentrl-pytest.ini"
_PYTEST = (f"rm -f {_REPORT}; python3 -m pytest -q -p no:cacheprovider -c {_INI} --rootdir=/tests "
           f"--confcutdir=/tests --junitxml={_REPORT} /tests/test_outputs.py")


def junit_verdict(report_xml: str, log: str) -> Verdict:
    """Verdict from a pytest JUnit XML report.

    Success needs at least one test, no failure or error, and nothing skipped (a skip is not a
    pass: a conftest that skips everything must not earn the reward). An unreadable report is
    ``unknown``.
    """
    try:
        root = ET.fromstring(report_xml)
    except ET.ParseError:
        return Verdict(0.0, Outcome.UNKNOWN, "verifier_error", log)
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return Verdict(0.0, Outcome.UNKNOWN, "verifier_error", log)
    tests, failures, errors, skipped = (int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped"))
    if tests == 0:
        return Verdict(0.0, Outcome.UNKNOWN, "no_tests_collected", log)
    if failures or errors:
        return Verdict(0.0, Outcome.MODEL_FAILURE, "tests_failed", log)
    if skipped:
        return Verdict(0.0, Outcome.MODEL_FAILURE, "tests_skipped", log)
    return Verdict(1.0, Outcome.SUCCESS, "tests_passed", log)


def verify_terminal(sandbox: Sandbox, task: TerminalTask) -> Verdict:
    """Stop the agent's processes, judge its changes, copy the hidden tests in (its ``/tests`` replaced), run them.

    Raises:
        SandboxInfraError: the sandbox died while verifying (an infra failure, not a verdict).
    """
    sandbox.phase = "verifier"  # what the tests fetch goes out under the verifier's egress session
    sandbox.stop_agent_processes()  # this format's rule: nothing the agent started runs beside its tests
    if found := tamper.check_toolchain(sandbox):
        return tamper.tampered(found)
    sandbox.put_dir(task.tests_dir, "/tests")
    sandbox.put_file(b"[pytest]\n", _INI)
    result = sandbox.exec(_PYTEST, timeout_s=task.verifier_timeout_s, env=_pycache_env())
    log = result.output[-_LOG_CHARS:]
    if result.timed_out:
        return Verdict(0.0, Outcome.UNKNOWN, "verifier_timeout", log)
    report = sandbox.get_file(_REPORT)
    if report is None:
        return Verdict(0.0, Outcome.UNKNOWN, "verifier_error", log)
    return junit_verdict(report.decode("utf-8", "replace"), log)


TEST_DIR = "/tests"
"""Upstream ``DockerComposeManager.CONTAINER_TEST_DIR``; ``run-tests.sh`` gets it as ``$TEST_DIR``."""
# run-tests.sh's merged output goes to a file read back whole: an exec's own output is cut at the
# backend's limit (16 KiB, the head), and pytest's summary is at the end. Not under /tmp (a tmpfs
# the archive API cannot read), not under /tests (a script may collect everything there).
_RUN_TESTS_LOG = "/agentrl-run-tests.log"


def _pycache_env() -> dict[str, str]:
    """``PYTHONPYCACHEPREFIX`` at a fresh path: the verifier's Python never loads a planted bytecode file."""
    return {tamper.PYCACHE_ENV: f"/tmp/.agentrl-pycache-{uuid.uuid4().hex[:12]}"}


def _manifest(sandbox: Sandbox, roots: list[str]) -> tamper.Manifest | None:
    """The manifest of ``roots`` (None when the sandbox wrote none: an in-memory one, an image without GNU find)."""
    out = f"/.agentrl-manifest-{uuid.uuid4().hex[:12]}"
    sandbox.exec(tamper.manifest_command(roots, out), timeout_s=30, workdir="/")
    raw = sandbox.get_file(out)
    sandbox.exec(f"rm -f {out}", timeout_s=10, workdir="/")
    # empty: no GNU find (-printf) in the image; the roots themselves always print otherwise
    return tamper.parse_manifest(raw.decode("utf-8", "replace")) or None if raw is not None else None


def parsed_verdict(parser_name: str, output: str) -> Verdict:
    """Verdict of ``run-tests.sh``'s ``output`` under the task's parser (upstream ``_parse_results``, ``_is_resolved``).

    Resolved (reward 1) iff every parsed test passed; a parse error is ``tests_did_not_run`` and
    a result section without tests ``no_tests_collected`` (both ``unknown``: the test environment,
    not the agent, is at fault). The log keeps the output's tail.
    """
    log = output[-_LOG_CHARS:]
    try:
        results = parse_test_output(parser_name, output)
    except ParseError as e:
        return Verdict(0.0, Outcome.UNKNOWN, "tests_did_not_run", f"{e}\n{log}")
    if not results:
        return Verdict(0.0, Outcome.UNKNOWN, "no_tests_collected", log)
    if all(results.values()):
        return Verdict(1.0, Outcome.SUCCESS, "tests_passed", log)
    failed = [name for name, ok in results.items() if not ok]
    named = ", ".join(failed[:10]) + (f" and {len(failed) - 10} more" if len(failed) > 10 else "")
    summary = f"{len(failed)} of {len(results)} failed: {named}"
    return Verdict(0.0, Outcome.MODEL_FAILURE, "tests_failed", f"{summary}\n{log}")


# What an agent's shell may not hand to the tests (run_tests_in_same_shell): what a shell or the loader
# runs by itself (BASH_ENV, exported functions, LD_*), what changes which pytest or plugins load, and ours.
_UNSAFE_ENV = re.compile(r"^(BASH_ENV|ENV|BASH_FUNC_.*|SHELLOPTS|BASHOPTS|PS4|PROMPT_COMMAND|LD_.*|PYTHONPATH|"
                         r"PYTHONHOME|PYTHONSTARTUP|PYTHONINSPECT|PYTHONPYCACHEPREFIX|PYTHONWARNINGS|PYTEST_.*|"
                         r"TMUX.*|OLDPWD|PWD|SHLVL|_)$")


def agent_shell_state(sandbox: Sandbox) -> tuple[str | None, dict[str, str]]:
    """The working directory and exported variables of the agent's persistent shell, as it left them.

    Read with ``pwd`` and ``env -0`` run in that shell (``Sandbox.run_in_shell``). Variables that make
    a shell, the loader, Python or pytest run code of their own choosing (``_UNSAFE_ENV``) are left
    out: the state may carry the agent's venv, its cwd and its exports to the tests, not a hook on
    them. ``(None, {})`` when the shell reported nothing.
    """
    out = f"/.agentrl-shell-{uuid.uuid4().hex[:12]}"
    sandbox.run_in_shell(f"pwd > {out}.cwd; env -0 > {out}.env", timeout_s=10)
    cwd, raw = sandbox.get_file(f"{out}.cwd"), sandbox.get_file(f"{out}.env")
    sandbox.exec(f"rm -f {out}.cwd {out}.env", timeout_s=10, workdir="/")
    env: dict[str, str] = {}
    for item in (raw or b"").decode("utf-8", "replace").split("\0"):
        name, sep, value = item.partition("=")
        if sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and not _UNSAFE_ENV.match(name):
            env[name] = value
    workdir = (cwd or b"").decode("utf-8", "replace").strip()
    return (workdir if workdir.startswith("/") else None), env


def verify_run_tests(sandbox: Sandbox, task: TerminalBenchTask) -> Verdict:
    """Run a Terminal-Bench task's ``run-tests.sh`` as the upstream harness does and parse its output.

    The agent's changes are judged first (``tamper.check_toolchain``); its processes keep running.
    ``/tests`` is emptied, then gets ``tests/`` (when the task has it) and ``run-tests.sh``;
    ``bash /tests/run-tests.sh`` runs in the image's WORKDIR with ``TEST_DIR=/tests`` for at most
    the task's ``max_test_timeout_sec``. Upstream runs it in a fresh tmux session and parses the
    pane; here it is one exec and its output. With ``run_tests_in_same_shell`` upstream types it into
    the agent's own session; here the exec gets that session's cwd and exported variables
    (:func:`agent_shell_state`: the agent's venv and exports reach the tests, its shell functions,
    aliases and hooks do not) and the toolchain check judges the agent's ``PATH``. ``/tests``
    changed under the run (``tamper.hidden_tests_findings``) is ``verifier_tampered``.

    Raises:
        SandboxInfraError: the sandbox died while verifying.
    """
    sandbox.phase = "verifier"  # what the tests fetch goes out under the verifier's egress session
    if task.run_tests is None:
        raise ValueError(f"{task.task_id}: has no run-tests.sh (its verifier is verify_terminal)")
    workdir, test_env = None, {"TEST_DIR": TEST_DIR, **_pycache_env()}
    if task.run_tests_in_same_shell:
        workdir, shell_env = agent_shell_state(sandbox)
        test_env = {**shell_env, **test_env}
    if found := tamper.check_toolchain(sandbox, path=test_env.get("PATH")):
        return tamper.tampered(found)
    sandbox.exec(f"rm -rf {TEST_DIR} {_RUN_TESTS_LOG} && mkdir -p {TEST_DIR}", timeout_s=10, workdir="/")
    if task.tests_dir.is_dir():
        sandbox.put_dir(task.tests_dir, TEST_DIR)
    sandbox.put_file(task.run_tests.encode(), f"{TEST_DIR}/run-tests.sh")
    before = _manifest(sandbox, [TEST_DIR])
    planted = tamper.content_findings(sandbox, tamper.expected_files(
        TEST_DIR, task.tests_dir, {f"{TEST_DIR}/run-tests.sh": task.run_tests.encode()}), TEST_DIR)
    result = sandbox.exec(f"bash {TEST_DIR}/run-tests.sh > {_RUN_TESTS_LOG} 2>&1",
                          timeout_s=task.verifier_timeout_s, workdir=workdir, env=test_env)
    after = _manifest(sandbox, [TEST_DIR])
    written = sandbox.get_file(_RUN_TESTS_LOG)
    output = written.decode("utf-8", "replace") if written is not None else result.output
    if before is not None and after is not None:
        found = planted + tamper.hidden_tests_findings(before, after, TEST_DIR)
        if found:
            return tamper.tampered(found, output[-_LOG_CHARS:])
    if result.timed_out:
        return Verdict(0.0, Outcome.UNKNOWN, "verifier_timeout", output[-_LOG_CHARS:])
    return parsed_verdict(task.parser_name, output)


_REWARD_DIR = "/logs/verifier"
_TEST_STDOUT = f"{_REWARD_DIR}/test-stdout.txt"
_REWARD_FILES = (f"{_REWARD_DIR}/reward.txt", f"{_REWARD_DIR}/reward.json")
# Harbor's verifier: ``chmod +x`` (done before, with the reward dir: a chmod moves the file's ctime, which
# the tamper check compares) then ``(/tests/test.sh) > /logs/verifier/test-stdout.txt 2>&1``
# (harbor/utils/scripts.py, build_execution_command); then, in the same command, the reward dir's manifest
# as test.sh left it, to this command's output.
HARBOR_TEST_COMMAND = (f"({TEST_DIR}/test.sh) > {_TEST_STDOUT} 2>&1; "
                       + tamper.manifest_command([_REWARD_DIR], "/dev/stdout"))


def parse_reward(reward_txt: bytes | None, reward_json: bytes | None) -> float | None:
    """Harbor's reward: ``{"reward": x}`` in ``reward.json``, else a float in ``reward.txt``; None if it does not parse.

    ``reward.json`` wins when both exist, as in Harbor's ``Verifier.verify`` (harbor 0.26). A value
    outside [0, 1] or not finite is treated as unparsable (a verifier bug, not a score).
    """
    import json
    import math

    value: object = None
    if reward_json is not None:
        try:
            data = json.loads(reward_json)
        except ValueError:
            return None
        value = data.get("reward") if isinstance(data, dict) else None
    elif reward_txt is not None:
        try:
            value = float(reward_txt.decode("utf-8", "replace").strip())
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value) if 0.0 <= value <= 1.0 else None


def verify_harbor(sandbox: Sandbox, task: HarborTask) -> Verdict:
    """Run a Harbor task's ``tests/test.sh`` as Harbor's verifier does and read the reward it wrote.

    The agent's changes are judged first (``tamper.check_toolchain``); its processes keep running.
    ``/tests`` gets ``tests/``; ``/logs/verifier`` is emptied; ``test.sh`` runs directly (its
    shebang decides the interpreter) in the image's WORKDIR with ``[verifier] env``, output to
    ``/logs/verifier/test-stdout.txt``. Reward 1 is ``success``; below 1 is ``model_failure``
    (reason ``tests_failed``, reward kept); no reward file or an unparsable one is ``unknown``;
    ``test.sh`` past its timeout is ``unknown`` (``verifier_timeout``). ``/tests`` or the reward
    directory changed under the verifier (``tamper.hidden_tests_findings``, ``tamper.reward_findings``) is
    ``verifier_tampered``.

    Raises:
        SandboxInfraError: the sandbox died while verifying.
    """
    sandbox.phase = "verifier"  # what the tests fetch goes out under the verifier's egress session
    if found := tamper.check_toolchain(sandbox):
        return tamper.tampered(found)
    sandbox.put_dir(task.tests_dir, TEST_DIR)
    sandbox.exec(f"rm -rf {_REWARD_DIR} && mkdir -p {_REWARD_DIR} /logs/agent && chmod +x {TEST_DIR}/test.sh",
                 timeout_s=10, workdir="/")
    created = _manifest(sandbox, [TEST_DIR, _REWARD_DIR])
    planted = tamper.content_findings(sandbox, tamper.expected_files(TEST_DIR, task.tests_dir), TEST_DIR)
    result = sandbox.exec(HARBOR_TEST_COMMAND, timeout_s=task.verifier_timeout_s,
                          env={**dict(task.verifier_env), **_pycache_env()})
    at_exit = (tamper.parse_manifest(result.output) or None) if not result.timed_out else None
    written = sandbox.get_file(_TEST_STDOUT)
    log = (written.decode("utf-8", "replace") if written is not None else result.output)[-_LOG_CHARS:]
    raw_json = sandbox.get_file(f"{_REWARD_DIR}/reward.json")
    txt = sandbox.get_file(f"{_REWARD_DIR}/reward.txt") if raw_json is None else None
    later = _manifest(sandbox, [TEST_DIR, _REWARD_DIR])
    if created is not None and later is not None:
        found = planted + tamper.hidden_tests_findings(_under(created, TEST_DIR), _under(later, TEST_DIR), TEST_DIR)
        if at_exit is not None:
            found += tamper.reward_findings(_under(created, _REWARD_DIR), at_exit, _under(later, _REWARD_DIR),
                                            _REWARD_DIR, _REWARD_FILES)
        if found:
            return tamper.tampered(found, log)
    if result.timed_out:
        return Verdict(0.0, Outcome.UNKNOWN, "verifier_timeout", log)
    reward = parse_reward(txt, raw_json)
    if reward is None:
        reason = "no_reward_file" if txt is None and raw_json is None else "verifier_error"
        return Verdict(0.0, Outcome.UNKNOWN, reason, log)
    if reward >= 1.0:
        return Verdict(reward, Outcome.SUCCESS, "tests_passed", log)
    return Verdict(reward, Outcome.MODEL_FAILURE, "tests_failed", log)


def _under(m: tamper.Manifest, root: str) -> tamper.Manifest:
    return {p: v for p, v in m.items() if p == root or p.startswith(root + "/")}


def verify_code(sandbox: Sandbox, task: Task, program: str) -> Verdict:
    """Run ``program`` (code plus the problem's ``check``) with python3 in the sandbox.

    Exit 0 passes, any other exit fails the tests; a run past the verifier timeout is a
    model failure too (the model's code looped), with reason ``program_timeout``.
    """
    sandbox.phase = "verifier"  # what the tests fetch goes out under the verifier's egress session
    sandbox.exec("mkdir -p /work", timeout_s=5)
    sandbox.put_file(program.encode(), "/work/program.py")
    result = sandbox.exec("python3 /work/program.py", timeout_s=task.verifier_timeout_s, workdir="/work")
    log = result.output[-_LOG_CHARS:]
    if result.timed_out:
        return Verdict(0.0, Outcome.MODEL_FAILURE, "program_timeout", log)
    if result.exit_code == 0:
        return Verdict(1.0, Outcome.SUCCESS, "tests_passed", log)
    return Verdict(0.0, Outcome.MODEL_FAILURE, "tests_failed", log)
