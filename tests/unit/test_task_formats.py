"""Terminal-Bench and Harbor semantics as upstream runs them: parsers, run-tests.sh, oracles, task-file defaults.

Pane outputs are real ``pytest -rA`` output (pytest 9.2, copied from a run); sandboxes are
in-memory (``tests.fakes.InMemorySandbox``, recording each exec's ``env`` here).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from envs.harbor import HarborTask, load_harbor_task
from envs.parsers import ParseError, parse_test_output
from envs.task import Outcome, TaskError
from envs.terminal_bench import TerminalBenchTask, load_terminal_task, solution_yaml_script
from envs.verify import HARBOR_TEST_COMMAND, parsed_verdict
from tests.fakes import InMemorySandbox

ROOT = Path(__file__).parents[2]
TERMINAL, HARBOR = ROOT / "envs" / "terminal", ROOT / "envs" / "harbor"
LOG = "/agentrl-run-tests.log"

# pytest -rA on a file with one pass, one failing assert whose message holds " - ", a skip, an
# xfail and a parametrized test failing for n=2.
MIXED = """\
============================= test session starts ==============================
collected 6 items

test_outputs.py .F.sxF                                                   [100%]

=================================== FAILURES ===================================
___________________________________ test_bad ___________________________________
E   AssertionError: one is not two - really
==================================== PASSES ====================================
=========================== short test summary info ============================
PASSED test_outputs.py::test_ok
PASSED test_outputs.py::test_param[1]
SKIPPED [1] test_outputs.py:4: later
XFAIL test_outputs.py::test_xf
FAILED test_outputs.py::test_bad - AssertionError: one is not two - really
FAILED test_outputs.py::test_param[2] - assert 2 == 1
============== 2 failed, 2 passed, 1 skipped, 1 xfailed in 0.02s ===============
"""
COLLECTION_ERROR = """\
E   ModuleNotFoundError: No module named 'nonexistent_module'
=========================== short test summary info ============================
ERROR test_broken.py
!!!!!!!!!!!!!!!!!!!! Interrupted: 1 error during collection !!!!!!!!!!!!!!!!!!!!
=============================== 1 error in 0.09s ===============================
"""
ALL_PASS = """\
test_outputs.py ..                                                       [100%]

==================================== PASSES ====================================
=========================== short test summary info ============================
PASSED test_outputs.py::test_file_exists
PASSED test_outputs.py::test_content
============================== 2 passed in 0.01s ===============================
"""
NO_SUMMARY = "bash: line 3: pytest: command not found\n"  # run-tests.sh could not start the tests


def test_pytest_parser_follows_upstream_line_by_line():
    assert parse_test_output("pytest", MIXED) == {
        "test_ok": True,
        "test_param[1]": True,
        "[1] test_outputs.py:4: later": True,  # SKIPPED counts as passed; no "::", so the whole rest is the name
        "test_xf": True,  # XFAIL passes
        # FAILED lines lose their last " - " part only: the rest of the description stays in the name
        "test_bad - AssertionError: one is not two": False,
        "test_param[2]": False,
    }
    assert parse_test_output("pytest", COLLECTION_ERROR) == {"test_broken.py": False}  # ERROR fails
    assert parse_test_output("pytest", "== short test summary info ==\nXPASS t.py::test_x\n") == {"test_x": False}
    with pytest.raises(ParseError, match="short test summary info"):
        parse_test_output("pytest", NO_SUMMARY)


def test_escape_codes_are_dropped_before_parsing():
    colored = ALL_PASS.replace("PASSED", "\x1b[32mPASSED\x1b[0m")
    assert parse_test_output("pytest", colored) == {"test_file_exists": True, "test_content": True}


@pytest.mark.parametrize(("output", "reward", "outcome", "reason"), [
    (ALL_PASS, 1.0, Outcome.SUCCESS, "tests_passed"),
    (MIXED, 0.0, Outcome.MODEL_FAILURE, "tests_failed"),
    (COLLECTION_ERROR, 0.0, Outcome.MODEL_FAILURE, "tests_failed"),
    (NO_SUMMARY, 0.0, Outcome.UNKNOWN, "tests_did_not_run"),
    ("=== short test summary info ===\n=== no tests ran in 0.01s ===\n", 0.0, Outcome.UNKNOWN, "no_tests_collected"),
])
def test_pytest_output_verdicts(output, reward, outcome, reason):
    v = parsed_verdict("pytest", output)
    assert (v.reward, v.outcome, v.reason) == (reward, outcome, reason)
    assert output.splitlines()[-1] in v.log  # the log keeps the output's tail


def test_mixed_failures_are_named_in_the_log():
    v = parsed_verdict("pytest", MIXED)
    assert v.log.startswith("2 of 6 failed: test_bad - AssertionError: one is not two, test_param[2]\n")


@pytest.mark.parametrize(("parser", "output", "reason"), [
    ("swebench", "x\nSWEBench results starts here\nPASSED\nSWEBench results ends here\n", "tests_passed"),
    ("swebench", "SWEBench results starts here\nFAILED\nSWEBench results ends here", "tests_failed"),
    ("swebench", "fatal: could not read from remote repository", "tests_did_not_run"),
    ("sweperf", "SWE-Perf results starts here\n PASSED \nSWE-Perf results ends here", "tests_passed"),
    ("sweperf", "SWE-Perf results starts here\nPASSED", "tests_did_not_run"),
    ("mlebench", "MLEBench results starts here\nALL TESTS PASSED\nMLEBench results ends here", "tests_passed"),
    ("mlebench", "ALL TESTS PASSED", "tests_passed"),  # upstream: no markers, the whole text is the block
    ("mlebench", "3 tests failed", "tests_failed"),
    ("swelancer", "... SWE Lancer Success ...", "tests_passed"),
    ("swelancer", "swe lancer failure; user_tool completed", "tests_failed"),  # failure wins over user_tool
    ("swelancer", "user_tool run completed", "tests_passed"),
    ("swelancer", "nothing", "tests_failed"),
])
def test_other_upstream_parsers(parser, output, reason):
    assert parsed_verdict(parser, output).reason == reason


# -- run-tests.sh in a sandbox ---------------------------------------------------------------
@dataclass
class EnvSandbox(InMemorySandbox):
    """An in-memory sandbox that also records each exec's ``env``."""

    envs: list[dict | None] = field(default_factory=list)

    def exec(self, command, timeout_s, workdir=None, env=None):
        self.envs.append(env)
        return super().exec(command, timeout_s, workdir, env)

    def run_in_shell(self, command, timeout_s):
        self.envs.append(None)  # envs stays aligned with execs
        return super().run_in_shell(command, timeout_s)


def tb_world(pane: str, timed_out: bool = False):
    """``run-tests.sh`` prints ``pane`` into the log file; its exec output is only the head the backend keeps."""

    def exec_fn(box, command):
        if command.startswith("rm -rf /tests "):
            for k in [k for k in box.files if k.startswith("/tests/") or k == LOG]:
                del box.files[k]
            return (0, "", 0.0, False)
        if command == f"bash /tests/run-tests.sh > {LOG} 2>&1":
            assert "/tests/run-tests.sh" in box.files
            box.files[LOG] = pane.encode()
            return (137, "", 60.0, True) if timed_out else (0, "", 1.0, False)
        return (0, "", 0.0, False)

    return exec_fn


def box_for(exec_fn) -> EnvSandbox:
    return EnvSandbox("mem-0", "img", {}, {}, exec_fn)


def tb_folder(tmp_path: Path, yaml_text: str = "instruction: Do it.\n", tests: bool = True) -> Path:
    d = tmp_path / "task"
    d.mkdir()
    (d / "task.yaml").write_text(yaml_text)
    (d / "Dockerfile").write_text("FROM agentrl-base:bookworm\nWORKDIR /app\n")
    (d / "run-tests.sh").write_text("#!/bin/bash\npytest $TEST_DIR/test_swe.py -rA\n")
    (d / "solution.sh").write_text("echo solved > /app/out\n")
    if tests:
        (d / "tests").mkdir()
        (d / "tests" / "test_swe.py").write_text("def test_x():\n    pass\n")
    return d


def test_task_yaml_defaults_are_upstreams(tmp_path):
    t = load_terminal_task(tb_folder(tmp_path))
    assert isinstance(t, TerminalBenchTask)
    # trial_handler.Task: max_agent_timeout_sec 360, max_test_timeout_sec 60; per command: the agent's
    assert (t.agent_timeout_s, t.verifier_timeout_s, t.command_timeout_s) == (360.0, 60.0, 360.0)
    assert (t.parser_name, t.run_tests_in_same_shell) == ("pytest", False)
    assert t.run_tests == "#!/bin/bash\npytest $TEST_DIR/test_swe.py -rA\n"


def test_run_tests_task_verifies_as_the_harness_does(tmp_path):
    t = load_terminal_task(tb_folder(tmp_path, "instruction: Do it.\nmax_test_timeout_sec: 45\n"))
    box = box_for(tb_world(ALL_PASS))
    box.files["/tests/planted.py"] = b"agent-made"
    v = t.verify(box, "")
    assert (v.reward, v.outcome, v.reason) == (1.0, Outcome.SUCCESS, "tests_passed")
    assert box.stop_calls == 0  # a server the agent left running stays up for the tests (envs.tamper guards)
    assert "/tests/planted.py" not in box.files  # the agent's /tests is gone; the task's files are in
    assert box.files["/tests/test_swe.py"] == b"def test_x():\n    pass\n"
    assert box.files["/tests/run-tests.sh"] == t.run_tests.encode()
    run = next(i for i, (c, _, _) in enumerate(box.execs) if c == f"bash /tests/run-tests.sh > {LOG} 2>&1")
    assert box.execs[run][1:] == (45.0, None)  # the task's test timeout, in the image's WORKDIR
    env = dict(box.envs[run])
    assert env.pop("PYTHONPYCACHEPREFIX").startswith("/") and env == {"TEST_DIR": "/tests"}


@pytest.mark.parametrize(("pane", "timed_out", "reason"), [
    (MIXED, False, "tests_failed"), (NO_SUMMARY, False, "tests_did_not_run"),
    ("collected 3 items\n", True, "verifier_timeout"),
])
def test_run_tests_failures_keep_their_reason_and_log(tmp_path, pane, timed_out, reason):
    t = load_terminal_task(tb_folder(tmp_path))
    v = t.verify(box_for(tb_world(pane, timed_out)), "")
    assert (v.reward, v.reason) == (0.0, reason)
    assert v.outcome == (Outcome.MODEL_FAILURE if reason == "tests_failed" else Outcome.UNKNOWN)
    assert pane.splitlines()[-1] in v.log


def test_same_shell_gives_the_tests_the_agents_cwd_and_safe_exports(tmp_path):
    t = load_terminal_task(tb_folder(tmp_path, "instruction: Do it.\nrun_tests_in_same_shell: true\n"))
    shell_env = {"ANSWER": "42", "PATH": "/app/.venv/bin:/usr/bin:/bin", "VIRTUAL_ENV": "/app/.venv",
                 "BASH_ENV": "/app/hook.sh", "BASH_FUNC_pytest%%": "() { echo PASSED; }", "LD_PRELOAD": "/x.so",
                 "PYTHONPATH": "/app/fake", "PYTEST_ADDOPTS": "-p evil", "PYTHONPYCACHEPREFIX": "/app/pyc",
                 "TEST_DIR": "/elsewhere", "PWD": "/work", "bad name": "x"}
    world = tb_world(ALL_PASS)

    def exec_fn(box, command):
        if command.startswith("pwd > "):  # the agent's shell reports its state
            out = command.split()[2].rstrip(";")
            box.files[out] = b"/work\n"
            box.files[out.replace(".cwd", ".env")] = b"".join(f"{k}={v}\0".encode() for k, v in shell_env.items())
            return (0, "", 0.0, False)
        return world(box, command)

    box = box_for(exec_fn)
    assert t.verify(box, "").reason == "tests_passed"
    assert box.shell and box.shell[0][0].startswith("pwd > ")
    run = next(i for i, (c, _, _) in enumerate(box.execs) if c == f"bash /tests/run-tests.sh > {LOG} 2>&1")
    assert box.execs[run][2] == "/work"
    env = dict(box.envs[run])
    assert env.pop("PYTHONPYCACHEPREFIX").startswith("/tmp/.agentrl-pycache-")
    assert env == {"ANSWER": "42", "PATH": "/app/.venv/bin:/usr/bin:/bin", "VIRTUAL_ENV": "/app/.venv",
                   "TEST_DIR": "/tests"}


def test_a_run_tests_task_without_tests_folder_loads_and_verifies(tmp_path):
    t = load_terminal_task(tb_folder(tmp_path, tests=False))  # SWE-bench style: run-tests.sh does it all
    box = box_for(tb_world(ALL_PASS))
    assert t.verify(box, "").reason == "tests_passed"
    assert sorted(k for k in box.files if k.startswith("/tests/")) == ["/tests/run-tests.sh"]


def test_hardened_path_is_kept_without_run_tests(tmp_path):
    t = load_terminal_task(TERMINAL / "hello-file")
    assert t.run_tests is None and t.verification_parts()[0] == "pytest"
    assert t.verification_parts()[3] == ""  # unchanged key parts: cached validations stay valid
    csv = load_terminal_task(TERMINAL / "csv-column")  # the shipped task with run-tests.sh
    assert csv.run_tests is not None and csv.verification_parts()[0] == "run-tests.sh:pytest"
    assert csv.verification_parts()[3] == csv.run_tests


@pytest.mark.parametrize(("yaml_text", "message"), [
    ("instruction: hi\nrun_tests_in_same_shell: 'no'\n", "field 'run_tests_in_same_shell' must be true or false"),
    ("instruction: hi\nparser_name: junit\n", "field 'parser_name' is 'junit', which is not supported"),
    ("instruction: hi\nper_command_timeout_sec: 0\n", "field 'per_command_timeout_sec' must be a positive number"),
])
def test_bad_task_yaml_fields(tmp_path, yaml_text, message):
    with pytest.raises(TaskError, match=message):
        load_terminal_task(tb_folder(tmp_path, yaml_text))


def test_a_non_pytest_parser_needs_run_tests(tmp_path):
    d = tb_folder(tmp_path, "instruction: hi\nparser_name: swebench\n")
    assert load_terminal_task(d).parser_name == "swebench"
    (d / "run-tests.sh").unlink()
    (d / "tests" / "test_outputs.py").write_text("def test_x():\n    pass\n")
    with pytest.raises(TaskError, match=r"run-tests.sh: missing \(field 'parser_name' 'swebench'"):
        load_terminal_task(d)


def test_same_shell_flag_is_stored(tmp_path):
    assert load_terminal_task(tb_folder(tmp_path, "instruction: hi\nrun_tests_in_same_shell: true\n")
                              ).run_tests_in_same_shell is True


def test_tb_oracle_runs_the_script_from_oracle_in_the_agents_shell(tmp_path):
    t = load_terminal_task(tb_folder(tmp_path, "instruction: hi\nmax_agent_timeout_sec: 200\n"))
    box = box_for(tb_world(ALL_PASS))
    v = t.reference(box, with_solution=True)
    assert v.outcome == Outcome.SUCCESS
    assert box.files["/oracle/solution.sh"] == b"echo solved > /app/out\n"
    # upstream's oracle types it into the agent's tmux session (started in the WORKDIR), with the agent timeout
    assert box.shell == [("bash /oracle/solution.sh", 200.0)]


# -- solution.yaml ---------------------------------------------------------------------------
def test_solution_yaml_becomes_one_script(tmp_path):
    path = tmp_path / "solution.yaml"
    path.write_text("- command: cd /app\n"
                    "- {command: 'echo ', append_enter: false, block: true}\n"
                    "- {command: hi > out.txt, min_timeout_sec: 0.1, max_timeout_sec: 30}\n"
                    "- {command: 'never entered', append_enter: false}\n")
    # "echo " is typed without Enter, so it joins the next command; the last one is never entered
    assert solution_yaml_script(path) == "#!/bin/bash\ncd /app\necho hi > out.txt\n"


def test_solution_sh_wins_over_yaml_and_yaml_is_used_alone(tmp_path):
    d = tb_folder(tmp_path)
    (d / "solution.yaml").write_text("- command: echo from-yaml\n")
    assert load_terminal_task(d).solution == "echo solved > /app/out\n"  # upstream TaskPaths.solution_path
    (d / "solution.sh").unlink()
    assert load_terminal_task(d).solution == "#!/bin/bash\necho from-yaml\n"


@pytest.mark.parametrize(("text", "message"), [
    ("command: x\n", "expected a non-empty list of commands"),
    ("- {cmd: x}\n", "entry 0 must be a mapping with a field 'command'"),
    ("- command: a\n- {command: b, block: 'yes'}\n", "entry 1 field 'block' must be true or false"),
    ("- {command: a, max_timeout_sec: true}\n", "entry 0 field 'max_timeout_sec' must be a number of seconds"),
    ("- {command: 3}\n", "entry 0 field 'command' must be a string"),
    ("- [unclosed\n", "not valid YAML"),
])
def test_bad_solution_yaml_names_entry_and_field(tmp_path, text, message):
    path = tmp_path / "solution.yaml"
    path.write_text(text)
    with pytest.raises(TaskError, match=f"solution.yaml: {message}"):
        solution_yaml_script(path)


# -- Harbor ----------------------------------------------------------------------------------
def harbor_folder(tmp_path: Path, toml: str) -> Path:
    d = tmp_path / "h"
    shutil.copytree(HARBOR / "write-greeting", d)
    (d / "task.toml").write_text(toml)
    (d / "solution" / "data.txt").write_text("Hello, Harbor!\n")  # solve.sh may use its folder's files
    return d


def test_harbor_defaults_are_harbors(tmp_path):
    t = load_harbor_task(harbor_folder(tmp_path, 'version = "1.0"\n'))
    # [verifier] timeout_sec 600 (Harbor's default); [agent] none upstream, 600 here; per command: the agent's;
    # network "public"
    assert (t.agent_timeout_s, t.verifier_timeout_s, t.command_timeout_s) == (600.0, 600.0, 600.0)
    assert t.limits.network is True and t.verifier_env == () and t.solution_env == ()


def test_harbor_verifier_and_oracle_get_their_env(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_TEST_JUDGE", "from-host")
    monkeypatch.delenv("AGENTRL_TEST_UNSET", raising=False)
    toml = ('[verifier]\nenv = { MODE = "strict", JUDGE = "${AGENTRL_TEST_JUDGE}" }\n'
            '[solution]\nenv = { GREETING = "${AGENTRL_TEST_UNSET:-hi}" }\n')
    t = load_harbor_task(harbor_folder(tmp_path, toml))
    assert isinstance(t, HarborTask)
    assert t.verifier_env == (("MODE", "strict"), ("JUDGE", "from-host"))
    assert t.solution_env == (("GREETING", "hi"),)

    def exec_fn(box, command):
        if command == HARBOR_TEST_COMMAND:
            box.files["/logs/verifier/reward.json"] = b'{"reward": 1.0}'
            box.files["/logs/verifier/test-stdout.txt"] = b"checked\n"
        return (0, "", 0.0, False)

    box = box_for(exec_fn)
    v = t.reference(box, with_solution=True)
    assert (v.reward, v.reason) == (1.0, "tests_passed") and v.log.endswith("verifier: checked\n")
    assert box.files["/solution/data.txt"] == b"Hello, Harbor!\n"  # the whole solution/ folder
    assert box.files["/solution/solve.sh"] == (HARBOR / "write-greeting" / "solution" / "solve.sh").read_bytes()
    solve = next(i for i, (c, _, _) in enumerate(box.execs) if c.endswith("/solution/solve.sh"))
    assert box.execs[solve] == ("chmod +x /solution/solve.sh && /solution/solve.sh", 600.0, None)
    assert box.shell == []  # Harbor's OracleAgent runs solve.sh with environment.exec, not in a tmux shell
    assert box.envs[solve] == {"DEBIAN_FRONTEND": "noninteractive", "GREETING": "hi"}
    test = [c for c, _, _ in box.execs].index(HARBOR_TEST_COMMAND)
    assert box.execs[test][1:] == (600.0, None)  # [verifier] timeout_sec default, the image's WORKDIR
    env = dict(box.envs[test])
    assert env.pop("PYTHONPYCACHEPREFIX").startswith("/") and env == {"MODE": "strict", "JUDGE": "from-host"}


@pytest.mark.parametrize(("toml", "network"), [
    ('[environment]\nnetwork_mode = "public"\n', True), ('[environment]\nnetwork_mode = "no-network"\n', False),
    ("[environment]\nallow_internet = true\n", True),
    ('[environment]\nnetwork_mode = "no-network"\nallow_internet = true\n', False),  # network_mode wins
])
def test_harbor_network_fields(tmp_path, toml, network):
    assert load_harbor_task(harbor_folder(tmp_path, toml)).limits.network is network


def test_harbor_allowlist_is_the_sandboxs_egress_hosts(tmp_path):
    toml = '[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org", "*.pythonhosted.org"]\n'
    limits = load_harbor_task(harbor_folder(tmp_path, toml)).limits
    assert limits.network is True
    assert limits.egress_hosts == ("pypi.org", "*.pythonhosted.org")
    assert limits.kwargs()["egress_hosts"] == ("pypi.org", "*.pythonhosted.org")
    public = load_harbor_task(harbor_folder(tmp_path / "p", '[environment]\nnetwork_mode = "public"\n')).limits
    assert public.egress_hosts is None and "egress_hosts" not in public.kwargs()


@pytest.mark.parametrize(("toml", "message"), [
    ('[environment]\nnetwork_mode = "allowlist"\n', "field 'environment.allowed_hosts' must be a list of host names"),
    ('[environment]\nnetwork_mode = "lan"\n', "field 'environment.network_mode' must be 'public', 'no-network' or"),
    ('[environment]\nworkdir = "/srv"\n', "field 'environment.workdir' is not supported"),
    ("[verifier]\nenv = { N = 1 }\n", "field 'verifier.env' must be a table of strings"),
    ('[solution]\nenv = { K = "${AGENTRL_TEST_UNSET}" }\n',
     "field 'solution.env'.K: environment variable 'AGENTRL_TEST_UNSET' is not set and has no default"),
])
def test_bad_harbor_fields(tmp_path, monkeypatch, toml, message):
    monkeypatch.delenv("AGENTRL_TEST_UNSET", raising=False)
    with pytest.raises(TaskError, match=f"task.toml: {message}"):
        load_harbor_task(harbor_folder(tmp_path, toml))


REAL_MMTB = Path(__file__).resolve().parents[1] / "fixtures" / "real_tasks" / "harbor-mmtb"


def test_real_harbor_task_with_a_helper_beside_solve_sh(tmp_path):
    """mmtb-core's lipsync-drift-correction, verbatim: ``solve.sh`` runs ``python3 /solution/lipsync_solve.py``,
    a file beside it; ``task.toml`` schema 1.1 with ``[agent]``/``[verifier]``/``[environment]`` set. (Its image
    fetches media from huggingface.co at build, so here it is loaded and scored with an in-memory sandbox.)"""
    folder = REAL_MMTB / "lipsync-drift-correction"
    t = load_harbor_task(folder)
    assert t.task_id == "harbor/lipsync-drift-correction"
    assert (t.agent_timeout_s, t.verifier_timeout_s) == (1200.0, 240.0)  # [agent] / [verifier] timeout_sec
    # [environment] cpus, memory_mb, storage_mb, allow_internet
    assert (t.limits.cpus, t.limits.memory_mb, t.limits.disk_mb, t.limits.network) == (2, 6144, 20480, True)

    def exec_fn(box, command):
        if command == HARBOR_TEST_COMMAND:  # its test.sh (python /tests/verifier.py) writes the reward
            box.files["/logs/verifier/reward.txt"] = b"1\n"
        return (0, "", 0.0, False)

    box = box_for(exec_fn)
    v = t.reference(box, with_solution=True)
    assert (v.reward, v.reason) == (1.0, "tests_passed")
    for name in ("solve.sh", "lipsync_solve.py"):  # Harbor's oracle uploads the whole solution/ folder
        assert box.files[f"/solution/{name}"] == (folder / "solution" / name).read_bytes()
    assert box.files["/tests/verifier.py"] == (folder / "tests" / "verifier.py").read_bytes()
    solve = next(i for i, (c, _, _) in enumerate(box.execs) if c.endswith("/solution/solve.sh"))
    assert box.execs[solve][1] == 1200.0  # the oracle runs within the agent's budget
