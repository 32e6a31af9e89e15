"""Verifiers: pure functions of a finished sandbox, returning reward, outcome and reason code.

Terminal tasks: every process the agent left running is killed, then the hidden tests are
copied to ``/tests`` only after the agent finished (any ``/tests`` the agent made is removed
first). Terminal-Bench tests run with pytest, hardened against an agent that plants
configuration (see ``_PYTEST``); Harbor tests run ``tests/test.sh``, whose reward file is read
from a ``/logs/verifier`` emptied just before (an agent cannot pre-write its reward). Not
defended: an agent that, as root in its container, replaces python3, pytest or bash themselves.
Code tasks: the extracted program, followed by the problem's tests, runs with python3 inside
the sandbox.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from envs.task import Outcome, Task, TerminalTask, Verdict
from infra.sandbox.base import Sandbox

__all__ = ["Verdict", "junit_verdict", "parse_reward", "verify_code", "verify_harbor", "verify_terminal"]


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
    """Copy the hidden tests in (replacing any ``/tests`` the agent made) and run them.

    Raises:
        SandboxInfraError: the sandbox died while verifying (an infra failure, not a verdict).
    """
    sandbox.stop_agent_processes()
    sandbox.put_dir(task.tests_dir, "/tests")
    sandbox.put_file(b"[pytest]\n", _INI)
    result = sandbox.exec(_PYTEST, timeout_s=task.verifier_timeout_s, workdir="/app")
    log = result.output[-4000:]
    if result.timed_out:
        return Verdict(0.0, Outcome.UNKNOWN, "verifier_timeout", log)
    report = sandbox.get_file(_REPORT)
    if report is None:
        return Verdict(0.0, Outcome.UNKNOWN, "verifier_error", log)
    return junit_verdict(report.decode("utf-8", "replace"), log)


_REWARD_DIR = "/logs/verifier"


def parse_reward(reward_txt: bytes | None, reward_json: bytes | None) -> float | None:
    """Harbor's reward: a float in ``reward.txt``, else ``{"reward": x}`` in ``reward.json``; None if neither parses.

    A value outside [0, 1] or not finite is treated as unparsable (a verifier bug, not a score).
    """
    import json
    import math

    value: object = None
    if reward_txt is not None:
        try:
            value = float(reward_txt.decode("utf-8", "replace").strip())
        except ValueError:
            return None
    elif reward_json is not None:
        try:
            data = json.loads(reward_json)
        except ValueError:
            return None
        value = data.get("reward") if isinstance(data, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value) if 0.0 <= value <= 1.0 else None


def verify_harbor(sandbox: Sandbox, task: TerminalTask) -> Verdict:
    """Run a Harbor task's ``tests/test.sh`` and read the reward it wrote.

    Reward 1 is ``success``; below 1 is ``model_failure`` (reason ``tests_failed``, reward kept);
    no reward file or an unparsable one is ``unknown``; ``test.sh`` past its timeout is ``unknown``
    (``verifier_timeout``).

    Raises:
        SandboxInfraError: the sandbox died while verifying.
    """
    sandbox.stop_agent_processes()
    sandbox.put_dir(task.tests_dir, "/tests")
    sandbox.exec(f"rm -rf {_REWARD_DIR} && mkdir -p {_REWARD_DIR} /logs/agent", timeout_s=10, workdir="/")
    result = sandbox.exec("bash /tests/test.sh", timeout_s=task.verifier_timeout_s, workdir="/tests")
    log = result.output[-4000:]
    if result.timed_out:
        return Verdict(0.0, Outcome.UNKNOWN, "verifier_timeout", log)
    txt = sandbox.get_file(f"{_REWARD_DIR}/reward.txt")
    raw_json = sandbox.get_file(f"{_REWARD_DIR}/reward.json") if txt is None else None
    reward = parse_reward(txt, raw_json)
    if reward is None:
        reason = "no_reward_file" if txt is None and raw_json is None else "verifier_error"
        return Verdict(0.0, Outcome.UNKNOWN, reason, log)
    if reward >= 1.0:
        return Verdict(reward, Outcome.SUCCESS, "tests_passed", log)
    return Verdict(reward, Outcome.MODEL_FAILURE, "tests_failed", log)


def verify_code(sandbox: Sandbox, task: Task, program: str) -> Verdict:
    """Run ``program`` (code plus the problem's ``check``) with python3 in the sandbox.

    Exit 0 passes, any other exit fails the tests; a run past the verifier timeout is a
    model failure too (the model's code looped), with reason ``program_timeout``.
    """
    sandbox.exec("mkdir -p /work", timeout_s=5)
    sandbox.put_file(program.encode(), "/work/program.py")
    result = sandbox.exec("python3 /work/program.py", timeout_s=task.verifier_timeout_s, workdir="/work")
    log = result.output[-4000:]
    if result.timed_out:
        return Verdict(0.0, Outcome.MODEL_FAILURE, "program_timeout", log)
    if result.exit_code == 0:
        return Verdict(1.0, Outcome.SUCCESS, "tests_passed", log)
    return Verdict(0.0, Outcome.MODEL_FAILURE, "tests_failed", log)
