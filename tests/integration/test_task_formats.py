"""Terminal-Bench run-tests.sh and Harbor test.sh on a real dockerd, in the base image (python3, pytest, no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from envs.harbor import load_harbor_task
from envs.task import Outcome
from envs.terminal_bench import load_terminal_task
from infra.environments import BASE_IMAGE

pytestmark = pytest.mark.integration

TEST_OUTPUTS = ("import os\n\n"
                "def test_cwd_is_workdir():\n    assert os.getcwd() == '/app'\n\n"
                "def test_file():\n    assert open('/app/out.txt').read() == 'ok\\n'\n")


def tb_task(tmp_path: Path, run_tests: str):
    d = tmp_path / "tb"
    (d / "tests").mkdir(parents=True)
    (d / "task.yaml").write_text("instruction: Write ok to /app/out.txt.\nmax_test_timeout_sec: 60\n")
    (d / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nWORKDIR /app\n")
    (d / "solution.yaml").write_text("- command: cd /app\n- {command: 'echo ok > ', append_enter: false}\n"
                                     "- command: out.txt\n")
    (d / "run-tests.sh").write_text(run_tests)
    (d / "tests" / "test_outputs.py").write_text(TEST_OUTPUTS)
    return load_terminal_task(d)


@pytest.fixture
def start(backend):
    """Builds the task's image (``FROM`` the base image, ``WORKDIR /app``) and starts sandboxes from it."""
    boxes = []

    def make(task):
        tag, _, _ = backend.build_image("task-formats", task.build_context, task.dockerfile)
        boxes.append(backend.start(tag, {"agentrl.test": "task-formats"}))
        return boxes[-1]

    yield make
    for b in boxes:
        b.close()


def test_run_tests_sh_in_workdir_with_test_dir_scored_by_its_summary(tmp_path, start):
    # upstream's template ends the same way (`uv run pytest $TEST_DIR/test_outputs.py -rA`), offline here
    task = tb_task(tmp_path, "#!/bin/bash\npython3 -m pytest $TEST_DIR/test_outputs.py -rA\n")
    box = start(task)
    assert box.workdir == "/app"
    idle = task.verify(box, "")
    assert (idle.outcome, idle.reason) == (Outcome.MODEL_FAILURE, "tests_failed"), idle.log
    assert "1 of 2 failed: test_file" in idle.log
    solved = task.reference(box, with_solution=True)  # solution.yaml's script, from /oracle/solution.sh
    assert (solved.reward, solved.reason) == (1.0, "tests_passed"), solved.log


def test_run_tests_sh_that_cannot_start_pytest_did_not_run(tmp_path, start):
    task = tb_task(tmp_path, "#!/bin/bash\nno-such-runner $TEST_DIR/test_outputs.py -rA\n")
    v = task.verify(start(task), "")
    assert (v.outcome, v.reason) == (Outcome.UNKNOWN, "tests_did_not_run") and "not found" in v.log


def test_harbor_test_sh_gets_verifier_env_and_the_oracle_its_folder(tmp_path, start):
    d = tmp_path / "h"
    (d / "environment").mkdir(parents=True)
    (d / "environment" / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nWORKDIR /app\n")
    (d / "instruction.md").write_text("Copy the greeting.\n")
    (d / "task.toml").write_text('[verifier]\ntimeout_sec = 30.0\nenv = { WANT = "hello" }\n'
                                 '[solution]\nenv = { SRC = "greeting.txt" }\n')
    (d / "solution").mkdir()
    (d / "solution" / "solve.sh").write_text('#!/bin/bash\ncp "/solution/$SRC" /app/out.txt\n')
    (d / "solution" / "greeting.txt").write_text("hello\n")
    (d / "tests").mkdir()
    (d / "tests" / "test.sh").write_text('#!/bin/bash\necho "in $PWD"\n'
                                         '[ "$(cat out.txt)" = "$WANT" ] && echo 1 > /logs/verifier/reward.txt '
                                         "|| echo 0 > /logs/verifier/reward.txt\n")
    task = load_harbor_task(d)
    box = start(task)
    assert task.verify(box, "").reason == "tests_failed"
    v = task.reference(box, with_solution=True)
    assert (v.reward, v.reason) == (1.0, "tests_passed"), v.log
    assert "in /app" in v.log  # test.sh ran in the image's WORKDIR, its output read from test-stdout.txt
