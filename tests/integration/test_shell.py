"""The agent's persistent shell (``DockerSandbox.run_in_shell``) on a real dockerd, in the project's base image.

One sandbox (so one tmux session) per test unless the test says otherwise; deadlines are short (1-2 s)
so the module runs in well under a minute.
"""

from __future__ import annotations

import io

import pytest

from infra.environments import BASE_IMAGE
from infra.sandbox.docker_backend import OUTPUT_LIMIT_BYTES

pytestmark = pytest.mark.integration


@pytest.fixture
def box(backend):
    b = backend.start(BASE_IMAGE, {"agentrl.test": "shell"})
    yield b
    b.close()


def run(box, command: str, timeout_s: float = 10.0):
    r = box.run_in_shell(command, timeout_s)
    assert r.exit_code == 0 and not r.timed_out, (command, r)
    return r.output


def test_the_shell_starts_in_the_workdir_in_a_wide_tmux_pane(box):
    assert run(box, "pwd").strip() == box.workdir
    # 200x50, 50000 lines of history, bash (the pane's foreground command)
    fmt = "#{pane_width}x#{pane_height} #{history_limit} #{pane_current_command}"
    assert box.exec(f"tmux display -p -t =agent: '{fmt}'", 5).output.strip() == "200x50 50000 bash"


def test_cd_export_functions_and_a_venv_persist(box):
    run(box, "mkdir -p /tmp/x && cd /tmp/x")
    assert run(box, "pwd") == "/tmp/x\n"
    run(box, "export A=1; greet() { echo \"hi $1\"; }")
    assert run(box, "echo $A; greet you") == "1\nhi you\n"
    run(box, "python3 -m venv --without-pip /v && . /v/bin/activate", timeout_s=60)
    assert run(box, "which python") == "/v/bin/python\n"


def test_a_background_job_keeps_running(box):
    run(box, "sleep 100 &")
    assert "sleep 100" in run(box, "ps -eo args")
    assert "Running" in run(box, "jobs")


def test_a_command_past_its_deadline_is_interrupted_and_the_shell_goes_on(box):
    run(box, "cd /tmp")
    r = box.run_in_shell("echo started; sleep 30", 1)
    # reported as exec reports a deadline (exit 137), with the output so far, after ~1 s (not 30)
    assert (r.exit_code, r.timed_out, r.output) == (137, True, "started\n") and r.duration_s < 10
    assert run(box, "pwd") == "/tmp\n"  # the same shell, its state kept
    assert "sleep 30" not in run(box, "ps -eo args")  # Ctrl-C ended it


def test_reading_stdin_waits_until_the_deadline(box):
    r = box.run_in_shell("cat", 1)
    assert r.timed_out and r.exit_code == 137
    r = box.run_in_shell("read -r line; echo got $line", 1)
    assert r.timed_out
    assert run(box, "echo ok") == "ok\n"


def test_a_probe_line_swallowed_after_ctrl_c_does_not_close_the_shell(box):
    # A program that reads one more line from the terminal after Ctrl-C takes the first probe line as
    # its input (as `read` can when the shell is slow to handle SIGINT); the next probe must still answer.
    run(box, "export KEEP=1")
    r = box.run_in_shell("sh -c 'trap \"read -r eaten; exit 0\" INT; sleep 60'", 1)
    assert r.timed_out and "was closed" not in r.output
    assert run(box, "echo \"[$KEEP]\"") == "[1]\n"


def test_a_command_ignoring_ctrl_c_gets_a_new_shell_next_time(box):
    run(box, "export KEEP=1")
    r = box.run_in_shell("trap '' INT; sleep 60", 1)
    assert r.timed_out and "was closed: the next command starts in a new shell" in r.output
    out = run(box, "echo \"[$KEEP]\"")
    assert out.startswith("[new shell in ") and out.endswith("\n[]\n")


def test_exit_ends_the_shell_and_the_next_command_gets_a_fresh_one(box):
    run(box, "cd /tmp && export B=2")
    r = box.run_in_shell("echo bye; exit 3", 5)
    assert (r.exit_code, r.timed_out) == (3, False)
    assert r.output.startswith("bye\n") and "the shell exited (status 3)" in r.output
    out = run(box, "pwd; echo \"[$B]\"")
    assert out.startswith("[new shell in ") and out.endswith(f"\n{box.workdir}\n[]\n")


def test_the_exit_status_is_the_last_commands(box):
    r = box.run_in_shell("false", 5)
    assert (r.exit_code, r.timed_out) == (1, False)
    r = box.run_in_shell("echo oops >&2; (exit 42)", 5)
    assert (r.exit_code, r.output) == (42, "oops\n")  # stderr merged


def test_output_over_the_limit_is_truncated(box):
    r = box.run_in_shell("head -c 100000 /dev/zero | tr '\\0' a; echo; echo tail", 10)
    assert r.exit_code == 0 and r.output == "a" * OUTPUT_LIMIT_BYTES


def test_quotes_dollars_heredocs_and_backslashes_run_as_written(box):
    command = ("x='it'\"'\"'s'; echo \"$x\" '$HOME' \"\\$HOME\" a\\\\b `echo tick` $((6*7))\n"
               "cat <<'EOF'\nraw $HOME \\n \"q\" 'q'\nEOF\n"
               "cat <<EOF\nexpanded ${x}\nEOF\n"
               "printf '%s|%s\\n' 'a  b' \"c\td\"")
    expected = ("it's $HOME $HOME a\\b tick 42\n"
                "raw $HOME \\n \"q\" 'q'\n"
                "expanded it's\n"
                "a  b|c\td\n")
    assert run(box, command) == expected


def test_a_syntax_error_is_an_error_not_a_hang(box):
    r = box.run_in_shell("echo 'unbalanced", 5)
    assert r.exit_code != 0 and not r.timed_out and "unexpected EOF" in r.output
    assert run(box, "echo fine") == "fine\n"


def test_each_sandbox_has_its_own_session(backend):
    a, b = (backend.start(BASE_IMAGE, {"agentrl.test": "shell"}) for _ in range(2))
    try:
        run(a, "cd /tmp && export WHO=a")
        assert run(b, "pwd; echo \"[$WHO]\"") == f"{b.workdir}\n[]\n"
    finally:
        a.close()
        b.close()


def test_an_image_without_tmux_falls_back_to_exec(backend, caplog):
    dockerfile = f"FROM {BASE_IMAGE}\nRUN rm -f /usr/bin/tmux\n"
    image, _ = backend.client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag="agentrl-test-notmux:1",
                                           rm=True, network_mode="none", labels={"agentrl": "1"})
    b = backend.start(image.id, {"agentrl.test": "shell"})
    try:
        with caplog.at_level("WARNING", logger="infra.sandbox.docker_backend"):
            assert run(b, "cd /tmp; pwd") == "/tmp\n"
            assert run(b, "pwd") == f"{b.workdir}\n"  # plain exec: nothing persists
        # said once (per image and process), not per command
        assert [r.getMessage() for r in caplog.records] == [
            f"image {image.id} has no tmux: the agent's commands run with plain exec, each in a fresh shell "
            "(cd, variables and jobs do not persist)"]
        r = b.run_in_shell("sleep 5", 1)
        assert r.timed_out and r.exit_code == 137
    finally:
        b.close()
        backend.client.images.remove(image.id, force=True)
