"""The persistent shell's outcome lines (``infra.sandbox.shell.parse_result``) and its driver's argv."""

from __future__ import annotations

import pytest

from infra.sandbox import shell
from infra.sandbox.base import ExecResult

NEW = "[new shell in /app: the previous one had ended, and its working directory, variables and jobs with it]\n"


@pytest.mark.parametrize(("text", "had_session", "expected"), [
    ("done 0\nhi\n", False, ExecResult(0, "hi\n", False, 1.5)),
    ("done 3 fresh\n", False, ExecResult(3, "", False, 1.5)),  # the first session: nothing to report
    ("done 0 fresh\nhi\n", True, ExecResult(0, NEW + "hi\n", False, 1.5)),  # an earlier session had ended
    ("timeout\npartial", True, ExecResult(137, "partial", True, 1.5)),  # as exec's `timeout -s KILL`
    ("stuck\n", False, ExecResult(137, "\n[the shell did not come back to its prompt after Ctrl-C at the 10 s "
                                       "deadline and was closed: the next command starts in a new shell in /app]",
                                  True, 1.5)),
    ("exited 3\nbye\n", False, ExecResult(3, "bye\n\n[the shell exited (status 3): the next command starts in a "
                                             "new shell in /app]", False, 1.5)),
    ("lost\n", False, ExecResult(129, "\n[the shell exited (status 129): the next command starts in a new shell "
                                      "in /app]", False, 1.5)),  # 129: SIGHUP, the terminal gone
])
def test_outcome_lines(text, had_session, expected):
    assert shell.parse_result(text, 1.5, 10.0, "/app", had_session) == expected


def test_no_tmux_is_none_and_no_outcome_is_an_error():
    assert shell.parse_result("notmux\n", 0.1, 10.0, "/app", False) is None
    with pytest.raises(ValueError, match="no outcome line"):
        shell.parse_result("\nsh: 1: cannot create x.cmd: No space left on device\n", 0.1, 10.0, "/app", False)


def test_the_command_is_an_argument_never_part_of_the_script():
    command = "echo \"$HOME\" 'it''s' \\\\ <<EOF\nx\nEOF"
    argv = shell.driver_argv(7, command, 2.5, "/app", "/.agentrl-exec/sh")
    # the driver's own deadline is the command's + the Ctrl-C probe (12 s) + slack (30 s): 2.5 + 42 = 44.5
    assert argv[:4] == ["timeout", "-s", "KILL", "44.5"]
    assert argv[-5:] == ["7", "2.5", "/app", command, "/.agentrl-exec/sh"]
    assert command not in argv[6]
