"""Verifiers: pure functions of a finished sandbox, returning reward, outcome and reason code.

Terminal tasks: the hidden tests are copied to ``/tests`` only after the agent finished (any
``/tests`` the agent made is removed first), then run with pytest, hardened against an agent
that plants configuration (see ``_PYTEST``). Not defended: an agent that, as root in its
container, replaces python3 or pytest themselves. Code tasks: the extracted
program, followed by the problem's tests, runs with python3 inside the sandbox.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass

from envs.task import Outcome, Task
from infra.sandbox.base import Sandbox


@dataclass(frozen=True)
class Verdict:
    """What the verifier concluded.

    Attributes:
        reward: 1.0 pass, 0.0 fail (binary, as Terminal-Bench and HumanEval score).
        outcome: success, model_failure (tests fail) or unknown (no parsable result).
        reason: reason code (``tests_passed``, ``tests_failed``, ``tests_skipped``, ``no_tests_collected``,
            ``verifier_timeout``, ``verifier_error``).
        log: the verifier's output, truncated.
    """

    reward: float
    outcome: Outcome
    reason: str
    log: str


# pytest runs with our own ini (agent-written pytest.ini/pyproject/setup.cfg are ignored), conftest
# discovery cut at /tests (a /conftest.py or /app/conftest.py written by the agent is not loaded),
# and the verdict read from a JUnit report written by this run (any stale one is removed first):
# every collected test must pass and none may be skipped.
_REPORT = "/tmp/agentrl-verdict.xml"
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


def verify_terminal(sandbox: Sandbox, task: Task) -> Verdict:
    """Copy the hidden tests in (replacing any ``/tests`` the agent made) and run them.

    Raises:
        SandboxInfraError: the sandbox died while verifying (an infra failure, not a verdict).
    """
    assert task.tests_dir is not None, f"{task.task_id}: terminal task without tests"
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
