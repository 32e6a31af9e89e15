"""Task formats: shipped tasks load; broken folders get one clear error and do not stop the others."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from envs.harbor import HarborTask
from envs.humaneval import extract_program, load_humaneval
from envs.task import SandboxLimits, TaskError
from envs.terminal_bench import TerminalBenchTask, load_terminal_tasks
from infra.environments import load_tasks

TERMINAL = Path(__file__).parents[2] / "envs" / "terminal"


def test_shipped_terminal_tasks_load_with_graded_difficulty():
    tasks, errors = load_terminal_tasks(TERMINAL)
    assert errors == []
    assert len(tasks) >= 6
    assert {t.difficulty for t in tasks} >= {"easy", "medium", "hard"}
    for t in tasks:
        assert isinstance(t, TerminalBenchTask) and t.instruction and t.tests_dir.is_dir()
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
    code_file = Path(__file__).parents[2] / "envs" / "simple_code" / "problems.jsonl"
    tasks, split, errors = load_tasks(None, [], 0, 0, code_file)
    assert errors == [] and len(tasks) == 12 and set(split.values()) == {"train"}
    add = tasks["code/SimpleCode/0"]
    prog = extract_program(add, "```python\ndef add(a, b):\n    return a + b\n```")
    ns: dict = {}
    exec(compile(prog, "prog", "exec"), ns)  # the reference-style answer passes its own check
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "X/0", "prompt": "def f():\\n"}\n')
    with pytest.raises(TaskError, match=r"tasks.code_file: .*bad.jsonl.*problem X/0 lacks fields \['entry_point'"):
        load_tasks(None, [], 0, 0, bad)
    bad.write_bytes(b'\xff\xfe{"task_id": 1}\n')
    with pytest.raises(TaskError, match="tasks.code_file: .*bad.jsonl is not a readable HumanEval-format JSONL"):
        load_tasks(None, [], 0, 0, bad)
    bad.write_text("1\n")  # a line that is JSON but not an object
    with pytest.raises(TaskError, match="tasks.code_file: .*bad.jsonl is not a readable HumanEval-format JSONL"):
        load_tasks(None, [], 0, 0, bad)
    with pytest.raises(TaskError, match="tasks.code_file: .* is not a file"):
        load_tasks(None, [], 0, 0, tmp_path)
    with pytest.raises(TaskError, match="tasks.code_file: .*nope.jsonl not found"):
        load_tasks(None, [], 0, 0, tmp_path / "nope.jsonl")
    with pytest.raises(TaskError, match="tasks.terminal_dir: .*nowhere not found"):
        load_tasks(tmp_path / "nowhere", [], 0, 0)


HARBOR = Path(__file__).parents[2] / "envs" / "harbor"


def test_shipped_harbor_tasks_load():
    from envs.harbor import load_harbor_task

    tasks = [load_harbor_task(p) for p in sorted(HARBOR.iterdir()) if p.is_dir()]
    assert len(tasks) >= 3
    by_id = {t.task_id: t for t in tasks}
    greet = by_id["harbor/write-greeting"]
    assert isinstance(greet, HarborTask) and (greet.task_format, greet.verifier_name) == ("harbor", "harbor")
    assert greet.agent_timeout_s == 120.0 and greet.verifier_timeout_s == 30.0
    assert greet.limits == SandboxLimits(cpus=1.0, memory_mb=512, network=False, disk_mb=1024)
    assert greet.build_context == HARBOR / "write-greeting" / "environment"
    assert greet.solution and "Hello, Harbor!" in greet.solution
    assert by_id["harbor/fix-median"].limits.memory_mb == 512  # memory = "512M"
    assert "file-operations" in greet.tags and greet.difficulty == "easy"


def test_compose_task_builds_from_its_single_service():
    from envs.terminal_bench import load_terminal_task

    t = load_terminal_task(TERMINAL / "csv-column")
    assert t.dockerfile == "Dockerfile" and t.task_format == "terminal-bench" and t.solution


def test_multi_service_compose_task_acts_in_client(tmp_path):
    from envs.task import ComposeServices, SandboxLimits
    from envs.terminal_bench import load_terminal_task

    d = tmp_path / "two"
    shutil.copytree(TERMINAL / "csv-column", d)
    for name in ("client", "server"):
        (d / name).mkdir()
        (d / name / "Dockerfile").write_text("FROM agentrl-base:bookworm\n")
    (d / "docker-compose.yaml").write_text("services:\n  client:\n    build: {context: client}\n"
                                           "  server:\n    build: {context: server, dockerfile: Dockerfile}\n")
    t = load_terminal_task(d)
    assert t.image_build() == (d / "client", "Dockerfile")
    assert t.limits.services == ComposeServices(file=(d / "docker-compose.yaml").resolve(), main="client")
    assert t.limits.kwargs()["services"] is t.limits.services
    assert "services" not in SandboxLimits(network=True).kwargs()  # one container: the keywords as before
    (d / "server" / "Dockerfile").unlink()  # a broken sidecar fails at load, naming its field
    with pytest.raises(Exception, match=r"services.server.build.dockerfile' names 'Dockerfile'"):
        load_terminal_task(d)


def _harbor_copy(tmp_path, name="t"):
    dst = tmp_path / name
    shutil.copytree(HARBOR / "write-greeting", dst)
    return dst


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: (d / "task.toml").write_text("[agent\ntimeout_sec = 1\n"), "task.toml: not valid TOML"),
    (lambda d: (d / "instruction.md").unlink(), "instruction.md: missing or empty"),
    (lambda d: (d / "instruction.md").write_text("  \n"), "instruction.md: missing or empty"),
    (lambda d: (d / "environment" / "Dockerfile").unlink(), "environment/Dockerfile: missing"),
    (lambda d: (d / "tests" / "test.sh").unlink(), "tests/test.sh: missing"),
    (lambda d: (d / "task.toml").write_text("[agent]\ntimeout_sec = 'soon'\n"),
     "task.toml: field 'agent.timeout_sec' must be a positive number of seconds"),
    (lambda d: (d / "task.toml").write_text("[environment]\nmemory = 'lots'\n"),
     "task.toml: field 'environment.memory_mb' must be a positive size"),
    (lambda d: (d / "task.toml").write_text("[environment]\nallow_internet = 'yes'\n"),
     "field 'environment.allow_internet' must be true or false"),
    (lambda d: (d / "task.toml").write_bytes(b"[agent]\ntimeout_sec = 1 # caf\xe9\n"),
     "task.toml: not UTF-8 text"),
    (lambda d: (d / "instruction.md").write_bytes(b"caf\xe9\n"), "instruction.md: not UTF-8 text"),
    (lambda d: (d / "task.toml").write_text("[agent]\ntimeout_sec = inf\n"),
     "field 'agent.timeout_sec' must be a positive number of seconds, got inf"),
    (lambda d: (d / "task.toml").write_text("[agent]\ntimeout_sec = 1" + "0" * 400 + "\n"),
     "field 'agent.timeout_sec' must be a positive number of seconds"),
    (lambda d: (d / "task.toml").write_text("[environment]\nmemory_mb = inf\n"),
     "field 'environment.memory_mb' must be a positive size"),
    (lambda d: (d / "task.toml").write_text("[environment]\ncpus = nan\n"),
     "field 'environment.cpus' must be a positive number, got nan"),
])
def test_bad_harbor_task_names_file_and_field(tmp_path, mutate, message):
    from envs import load_taskset

    _harbor_copy(tmp_path, "good")
    mutate(_harbor_copy(tmp_path, "bad"))
    tasks, errors = load_taskset(tmp_path)
    assert [t.task_id for t in tasks] == ["harbor/good"]
    assert len(errors) == 1 and "/bad/" in errors[0] and message in errors[0], errors


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: (d / "task.yaml").write_text("instruction: hi\nparser_name: junit\n"),
     "task.yaml: field 'parser_name' is 'junit', which is not supported; supported: pytest, swebench"),
    (lambda d: (d / "task.yaml").write_text("difficulty: easy\n"), "task.yaml: field 'instruction' must be"),
    (lambda d: (d / "docker-compose.yaml").write_text("services:\n  a: {build: .}\n  db: {image: postgres}\n"),
     "docker-compose.yaml: field 'services' holds 2 services and none is 'client'"),
    (lambda d: (d / "docker-compose.yaml").write_text("services:\n  client: {build: .}\n  db: {image: postgres}\n"),
     "docker-compose.yaml: field 'services.db.build' missing (every service must be built from the task folder"),
    (lambda d: (d / "docker-compose.yaml").write_text("services:\n  a: {image: ubuntu}\n"),
     "docker-compose.yaml: field 'services.a.build' missing"),
    (lambda d: (d / "docker-compose.yaml").write_text("services:\n  a: {build: {dockerfile: Nope}}\n"),
     "field 'services.a.build.dockerfile' names 'Nope'"),
    (lambda d: (d / "task.yaml").write_bytes(b"instruction: caf\xe9\n"), "task.yaml: not UTF-8 text"),
    (lambda d: (d / "task.yaml").write_text("instruction: hi\nmax_agent_timeout_sec: .nan\n"),
     "task.yaml: field 'max_agent_timeout_sec' must be a positive number of seconds, got nan"),
    # csv-column has run-tests.sh (it would load without test_outputs.py): the hardened layout needs the file
    (lambda d: ((d / "tests" / "test_outputs.py").unlink(), (d / "run-tests.sh").unlink()),
     "tests/test_outputs.py: missing"),
])
def test_bad_terminal_bench_task_names_file_and_field(tmp_path, mutate, message):
    from envs import load_taskset

    shutil.copytree(TERMINAL / "csv-column", tmp_path / "good")
    shutil.copytree(TERMINAL / "csv-column", tmp_path / "bad")
    mutate(tmp_path / "bad")
    tasks, errors = load_taskset(tmp_path)
    assert [t.task_id for t in tasks] == ["tb/good"]
    assert len(errors) == 1 and "/bad/" in errors[0] and message in errors[0], errors


def test_load_taskset_detects_each_format(tmp_path):
    from envs import load_taskset
    from envs.taskset import detect_format

    shutil.copytree(TERMINAL / "hello-file", tmp_path / "tb-task")
    shutil.copytree(HARBOR / "count-words", tmp_path / "harbor-task")
    shutil.copy(Path(__file__).parents[2] / "envs" / "simple_code" / "problems.jsonl", tmp_path / "code.jsonl")
    (tmp_path / "notes").mkdir()
    assert [detect_format(tmp_path / n) for n in ("tb-task", "harbor-task", "code.jsonl", "notes")] == [
        "terminal-bench", "harbor", "humaneval", None]
    tasks, errors = load_taskset(tmp_path)
    formats = sorted({t.task_format for t in tasks})
    assert formats == ["harbor", "humaneval", "terminal-bench"] and len(tasks) == 14
    assert errors == [f"{tmp_path / 'notes'}: neither task.toml (Harbor) nor task.yaml (Terminal-Bench) found"]
    one, errs = load_taskset(tmp_path / "harbor-task")  # a single task folder
    assert [t.task_id for t in one] == ["harbor/harbor-task"] and errs == []
    with pytest.raises(TaskError, match="task set not found"):
        load_taskset(tmp_path / "missing")
    assert all(t.solution for t in tasks)  # every shipped task carries its reference solution


def test_base_image_mapping_rewrites_only_unpullable_from_lines():
    from infra.sandbox.docker_backend import map_base_images

    dockerfile = ("FROM ubuntu:24.04 AS build\nRUN make\nFROM --platform=linux/amd64 python:3.13-slim\n"
                  "COPY --from=build /out /out\nFROM build\nFROM local/have:1\nFROM scratch\n")
    text, mapped = map_base_images(dockerfile, {"python:*": "py-local"}, local={"local/have:1"},
                                   fallback="base-local")
    assert mapped == {"ubuntu:24.04": "base-local", "python:3.13-slim": "py-local"}
    assert text.splitlines() == ["FROM base-local AS build", "RUN make", "FROM --platform=linux/amd64 py-local",
                                 "COPY --from=build /out /out", "FROM build", "FROM local/have:1", "FROM scratch"]
    same, none = map_base_images(dockerfile, {}, local=None, fallback="base-local")
    assert same == dockerfile and none == {}


@pytest.mark.parametrize(("txt", "js", "want"), [
    (b"1\n", None, 1.0), (b" 0.25 ", None, 0.25), (None, b'{"reward": 1}', 1.0), (None, b'{"reward": 0.0}', 0.0),
    (b"yes", None, None), (None, b"[1]", None), (None, b'{"score": 1}', None), (b"1.5", None, None),
    (b"nan", None, None), (None, None, None),
    (b"0", b'{"reward": 1}', 1.0),  # reward.json wins over reward.txt, as in Harbor 0.26's Verifier.verify
])
def test_harbor_reward_parsing(txt, js, want):
    from envs.verify import parse_reward

    assert parse_reward(txt, js) == want
