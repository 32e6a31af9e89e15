"""Verifiers: pure functions of a finished sandbox, returning reward, outcome and reason code.

Terminal tasks: the hidden tests are copied to ``/tests`` only after the agent finished (any
``/tests`` the agent made is removed first), then run with pytest. Code tasks: the extracted
program, followed by the problem's tests, runs with python3 inside the sandbox.
"""

from __future__ import annotations

from dataclasses import dataclass

from envs.task import Outcome, Task
from infra.sandbox.base import Sandbox


@dataclass(frozen=True)
class Verdict:
    """What the verifier concluded.

    Attributes:
        reward: 1.0 pass, 0.0 fail (binary, as Terminal-Bench and HumanEval score).
        outcome: success, model_failure (tests fail) or unknown (no parsable result).
        reason: reason code (``tests_passed``, ``tests_failed``, ``verifier_timeout``, ``verifier_error``).
        log: the verifier's output, truncated.
    """

    reward: float
    outcome: Outcome
    reason: str
    log: str


# pytest exit codes: 0 all passed, 1 some failed; 2-5 mean the run itself went wrong.
def _pytest_verdict(exit_code: int, timed_out: bool, log: str) -> Verdict:
    if timed_out:
        return Verdict(0.0, Outcome.UNKNOWN, "verifier_timeout", log)
    if exit_code == 0:
        return Verdict(1.0, Outcome.SUCCESS, "tests_passed", log)
    if exit_code == 1:
        return Verdict(0.0, Outcome.MODEL_FAILURE, "tests_failed", log)
    return Verdict(0.0, Outcome.UNKNOWN, "verifier_error", log)


def verify_terminal(sandbox: Sandbox, task: Task) -> Verdict:
    """Copy the hidden tests in and run them.

    Raises:
        SandboxInfraError: the sandbox died while verifying (an infra failure, not a verdict).
    """
    assert task.tests_dir is not None, f"{task.task_id}: terminal task without tests"
    sandbox.put_dir(task.tests_dir, "/tests")
    result = sandbox.exec("python3 -m pytest -q -p no:cacheprovider /tests/test_outputs.py",
                          timeout_s=task.verifier_timeout_s, workdir="/app")
    return _pytest_verdict(result.exit_code, result.timed_out, result.output[-4000:])


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
