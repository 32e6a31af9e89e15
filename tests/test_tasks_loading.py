"""Task formats: shipped tasks load; broken folders get one clear error and do not stop the others."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from envs.humaneval import extract_program, load_humaneval
from envs.task import TaskError
from envs.terminal_bench import load_terminal_tasks
from infra.environments import load_tasks

TERMINAL = Path(__file__).parent.parent / "envs" / "terminal"


def test_shipped_terminal_tasks_load_with_graded_difficulty():
    tasks, errors = load_terminal_tasks(TERMINAL)
    assert errors == []
    assert len(tasks) >= 6
    assert {t.difficulty for t in tasks} >= {"easy", "medium", "hard"}
    for t in tasks:
        assert t.kind == "terminal" and t.instruction and t.tests_dir.is_dir()
        assert (t.build_context / "solution.sh").is_file()


def test_broken_folders_reported_others_load(tmp_path):
    shutil.copytree(TERMINAL / "hello-file", tmp_path / "good")
    shutil.copytree(TERMINAL / "hello-file", tmp_path / "no-dockerfile")
    (tmp_path / "no-dockerfile" / "Dockerfile").unlink()
    shutil.copytree(TERMINAL / "hello-file", tmp_path / "bad-yaml")
    (tmp_path / "bad-yaml" / "task.yaml").write_text("instruction: [unclosed\n")
    shutil.copytree(TERMINAL / "hello-file", tmp_path / "bad-timeout")
    (tmp_path / "bad-timeout" / "task.yaml").write_text("instruction: hi\nmax_agent_timeout_sec: -3\n")
    tasks, errors = load_terminal_tasks(tmp_path)
    assert [t.task_id for t in tasks] == ["tb/good"]
    assert len(errors) == 3
    joined = "\n".join(errors)
    assert "no-dockerfile/Dockerfile: missing" in joined
    assert "bad-yaml/task.yaml: not valid YAML" in joined
    assert "bad-timeout/task.yaml: field 'max_agent_timeout_sec' must be a positive number" in joined


def test_missing_task_root_is_an_error(tmp_path):
    with pytest.raises(TaskError, match="task folder not found"):
        load_terminal_tasks(tmp_path / "nope")


def test_humaneval_split_does_not_overlap():
    train, evals = load_humaneval(first=10), load_humaneval(last=5)
    assert {t.task_id for t in train}.isdisjoint({t.task_id for t in evals})
    assert train[0].task_id == "humaneval/HumanEval/0" and evals[-1].task_id == "humaneval/HumanEval/163"
    with pytest.raises(ValueError, match="overlap"):
        load_tasks(TERMINAL, [], 100, 100)
    with pytest.raises(ValueError, match="not tasks"):
        load_tasks(TERMINAL, ["no-such-task"], 1, 1)


def test_extract_program_full_function_or_body():
    task = load_humaneval(first=1)[0]  # has_close_elements, prompt imports List
    full = "Here:\n```python\ndef has_close_elements(numbers, threshold):\n    return True\n```"
    prog = extract_program(task, full)
    assert prog.startswith("from typing import List\ndef has_close_elements")
    assert "check(has_close_elements)" in prog
    body = "    return False\n"
    assert extract_program(task, body).startswith(task.prompt + body)


def test_code_file_tasks_load_for_training(tmp_path):
    code_file = Path(__file__).parent.parent / "envs" / "simple_code" / "problems.jsonl"
    tasks, split, errors = load_tasks(None, [], 0, 0, code_file)
    assert errors == [] and len(tasks) == 12 and set(split.values()) == {"train"}
    add = tasks["code/SimpleCode/0"]
    prog = extract_program(add, "```python\ndef add(a, b):\n    return a + b\n```")
    ns: dict = {}
    exec(compile(prog, "prog", "exec"), ns)  # the reference-style answer passes its own check
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "X/0", "prompt": "def f():\\n"}\n')
    with pytest.raises(ValueError, match="bad.jsonl: problem X/0 lacks fields \\['entry_point', 'test'\\]"):
        load_tasks(None, [], 0, 0, bad)
