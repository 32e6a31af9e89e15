"""Docker sandboxes and task images on a real dockerd: isolation basics, deadlines, verification."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from envs.task import Outcome
from envs.terminal_bench import load_terminal_task, load_terminal_tasks
from envs.verify import verify_terminal
from infra.environments import BASE_IMAGE

TERMINAL = Path(__file__).parents[2] / "envs" / "terminal"
pytestmark = pytest.mark.integration


@pytest.fixture
def sandbox(backend):
    box = backend.start(BASE_IMAGE, {"agentrl.test": "sandbox"})
    yield box
    box.close()


def test_command_deadline_is_reported_not_raised(sandbox):
    r = sandbox.exec("sleep 5", timeout_s=1)
    assert r.timed_out and r.exit_code == 137 and r.duration_s < 4
    ok = sandbox.exec("echo hi; exit 3", timeout_s=5)
    assert (ok.exit_code, ok.output.strip(), ok.timed_out) == (3, "hi", False)


# AGENT_CAPABILITIES as a mask (linux/capability.h): CHOWN 0, DAC_OVERRIDE 1, FOWNER 3, FSETID 4, KILL 5,
# SETGID 6, SETUID 7, NET_BIND_SERVICE 10 -> 0x4fb; no NET_RAW (13), MKNOD (27), SYS_ADMIN (21)...
AGENT_CAP_EFF = "00000000000004fb"


def test_no_network_and_only_the_agents_caps(sandbox):
    r = sandbox.exec("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\"", 10)
    assert r.exit_code != 0 and "unreachable" in r.output.lower()
    assert sandbox.exec("cat /proc/self/status | grep CapEff", 5).output.split()[-1] == AGENT_CAP_EFF


def test_vanished_container_is_infra_error(backend):
    from infra.sandbox.base import SandboxInfraError

    box = backend.start(BASE_IMAGE, {"agentrl.test": "vanish"})
    subprocess.run(["docker", "rm", "-f", box.sandbox_id], check=True, capture_output=True)
    with pytest.raises(SandboxInfraError) as err:
        box.exec("true", 5)
    assert err.value.reason in ("container_vanished", "docker_api_error")
    box.close()


def test_image_tag_follows_build_context_and_excludes_hidden_files(backend, tmp_path):
    ctx = tmp_path / "t"
    shutil.copytree(TERMINAL / "hello-file", ctx)
    tag1, built1, _ = backend.build_image("test-hash", ctx)
    tag2, built2, _ = backend.build_image("test-hash", ctx)
    assert tag1 == tag2 and not built2  # unchanged context: no rebuild
    (ctx / "tests" / "test_outputs.py").write_text("# hidden tests changed\n")
    (ctx / "solution.sh").write_text("echo changed\n")
    assert backend.build_image("test-hash", ctx)[0] == tag1  # hidden files are not part of the context
    (ctx / "Dockerfile").write_text((ctx / "Dockerfile").read_text() + "\nRUN echo v2 > /etc/v2\n")
    tag3, built3, _ = backend.build_image("test-hash", ctx)
    assert tag3 != tag1 and built3
    box = backend.start(tag3, {"agentrl.test": "hidden"})
    try:
        assert box.exec("ls /tests /app/tests /app/solution.sh 2>&1; true", 5).output.count("No such file") == 3
    finally:
        box.close()
    for tag in (tag1, tag3):
        backend.client.images.remove(tag, force=True)


@pytest.mark.parametrize("name", sorted(p.name for p in TERMINAL.iterdir() if p.is_dir()))
def test_reference_solution_passes_and_doing_nothing_fails(backend, name):
    from infra.environments import validate_task

    task = load_terminal_task(TERMINAL / name)
    tag, _, _ = backend.build_image(name, task.build_context, task.dockerfile, fallback_base=BASE_IMAGE)
    ok, message = validate_task(backend, task, tag)
    assert ok, message
    assert message.startswith("reference solution passes; do-nothing scores 0.0 (tests_failed)")


def test_agent_made_tests_dir_is_replaced(backend):
    task = load_terminal_tasks(TERMINAL)[0][0]
    tag, _, _ = backend.build_image(task.task_id.removeprefix("tb/"), task.build_context)
    box = backend.start(tag, {"agentrl.test": "tamper"})
    try:
        box.exec("mkdir -p /tests && echo 'def test_x(): pass' > /tests/test_outputs.py", 5)
        assert verify_terminal(box, task).reward == 0.0  # the hidden tests replaced the agent's
    finally:
        box.close()


def test_reaper_removes_labelled_containers(backend):
    for _ in range(2):
        backend.start(BASE_IMAGE, {"agentrl.test": "reap"})
    assert backend.reap({"agentrl.test": "reap"}) == 2
    assert backend.reap({"agentrl.test": "reap"}) == 0


def test_failed_build_marks_task_unusable_others_go_on(backend, tmp_path):
    from infra.environments import build_catalog

    shutil.copytree(TERMINAL / "hello-file", tmp_path / "good")
    shutil.copytree(TERMINAL / "hello-file", tmp_path / "broken")
    (tmp_path / "broken" / "Dockerfile").write_text("FROM agentrl-base:bookworm\nRUN exit 3\n")
    tasks, errors = load_terminal_tasks(tmp_path)
    assert errors == []
    entries, logs = build_catalog(backend, {t.task_id: t for t in tasks}, {t.task_id: "train" for t in tasks})
    by_id = {e.task_id: e for e in entries}
    assert by_id["tb/good"].usable and by_id["tb/good"].image_digest.startswith("sha256:")
    assert not by_id["tb/broken"].usable and "image build failed" in by_id["tb/broken"].reason
    assert "exit 3" in by_id["tb/broken"].reason or "returned a non-zero code" in by_id["tb/broken"].reason


@pytest.mark.parametrize("plant", [
    # a conftest at the filesystem root that skips every test
    "printf 'import pytest\\ndef pytest_collection_modifyitems(items):\\n"
    "    [i.add_marker(pytest.mark.skip) for i in items]\\n' > /conftest.py",
    # the same in the working directory, plus an ini that deselects everything
    "printf 'import pytest\\ndef pytest_runtest_setup(item):\\n    pytest.skip(\"x\")\\n' > /app/conftest.py;"
    " printf '[pytest]\\naddopts = -k nothing_matches\\n' > /app/pytest.ini; cp /app/pytest.ini /pytest.ini",
    # a pre-written passing report
    "mkdir -p /tests && printf '<testsuite tests=\"1\" failures=\"0\" errors=\"0\" skipped=\"0\"/>'"
    " > /tests/.agentrl-verdict.xml",
])
def test_planted_configuration_does_not_earn_reward(backend, plant):
    task = load_terminal_task(TERMINAL / "hello-file")
    tag, _, _ = backend.build_image("hello-file", task.build_context)
    box = backend.start(tag, {"agentrl.test": "plant"})
    try:
        assert box.exec(plant, 5).exit_code == 0
        verdict = verify_terminal(box, task)
        assert verdict.reward == 0.0 and verdict.outcome == Outcome.MODEL_FAILURE, verdict
        box.exec("echo 'hello world' > /app/hello.txt", 5)  # a genuine fix still scores 1
        assert verify_terminal(box, task).reward == 1.0
    finally:
        box.close()


def test_junit_verdicts():
    from envs.verify import junit_verdict

    ok = '<testsuites><testsuite tests="2" failures="0" errors="0" skipped="0"/></testsuites>'
    assert junit_verdict(ok, "").reward == 1.0
    assert junit_verdict('<testsuite tests="2" failures="0" errors="0" skipped="1"/>', "").reason == "tests_skipped"
    assert junit_verdict('<testsuite tests="2" failures="1" errors="0" skipped="0"/>', "").reason == "tests_failed"
    assert junit_verdict('<testsuite tests="0"/>', "").outcome == Outcome.UNKNOWN
    assert junit_verdict("<testsuite", "").reason == "verifier_error"



_WARM_THEN_EXIT = r"""
import sys
from infra.config import RunConfig
from infra.environments import BASE_IMAGE
from infra.sandbox.docker_backend import OWNER_LABEL, owner_id
from infra.run import Run

rt = Run.open(RunConfig(run_id=sys.argv[1]), model=False, tasks=False)
pool = rt.pool
pool.ensure(BASE_IMAGE, 2)
assert pool.wait_ready(120), "warm pool did not fill"
mine = rt.backend.client.containers.list(filters={"label": f"{OWNER_LABEL}={owner_id()}"})
print("owner", owner_id(), "idle", len(mine), flush=True)
"""  # ends without closing the run (a process that never leaves its `with Run.open(...)` block)


def test_idle_warm_sandboxes_are_removed_when_the_process_exits(backend):
    """A flow's process (the CLI, a deployment run) that ends without closing its runtime leaves no
    warm sandbox running: the pool is closed at exit, not left to the next run's reaper."""
    import sys
    import uuid

    from infra.reaper import unmarked_env
    from infra.sandbox.docker_backend import OWNER_LABEL

    r = subprocess.run([sys.executable, "-c", _WARM_THEN_EXIT, f"exit-{uuid.uuid4().hex[:8]}"],
                       cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=300,
                       env=unmarked_env())  # a run of its own: its containers are not this process's
    assert r.returncode == 0, r.stderr[-2000:]
    _, owner, _, idle = r.stdout.split()[-4:]
    assert idle == "2", r.stdout  # two warm sandboxes ran while the process lived
    left = backend.client.containers.list(all=True, ignore_removed=True, filters={"label": f"{OWNER_LABEL}={owner}"})
    assert left == [], [c.name for c in left]


def test_a_file_rewritten_while_read_is_read_whole_or_as_sent(sandbox):
    """An agent's process rewriting a file in a tight loop (the reward-loop attack) never breaks a read."""
    sandbox.exec("nohup sh -c 'while :; do echo 1 > /f; echo 22222222 > /f; done' >/dev/null 2>&1 &", 5)
    reads = [sandbox.get_file("/f") for _ in range(50)]
    # the engine copies at most the size it stat'ed, reading the file at rising offsets while the loop
    # truncates and rewrites it: each byte read is the byte at that offset of some version of the file
    versions = (b"1\n", b"22222222\n")
    torn = [r for r in reads if r is None or any(not any(i < len(v) and v[i] == c for v in versions)
                                                 for i, c in enumerate(r))]
    assert not torn, torn
