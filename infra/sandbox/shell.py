"""The agent's persistent shell: one tmux session per sandbox, as Terminal-Bench's harness and Terminus use.

Terminal-Bench agents type into one tmux session per episode (``terminal_bench/terminal/tmux_session.py``),
so tasks assume state persists between commands: ``cd``, ``export``, an activated venv, shell functions,
a server started with ``&``. :func:`driver_argv` is the one command (run with ``docker exec``) that runs
an agent command in that session:

1. The session ``agent`` is started on first use (or when the previous one ended): ``bash`` in a tmux
   pane of 200x50 with 50000 lines of history, in the image's WORKDIR. It is an interactive, non-login
   bash (``/etc/bash.bashrc`` and ``~/.bashrc`` are read; the image's ``ENV PATH`` is kept, which a
   Debian login shell's ``/etc/profile`` would reset; upstream's tmux starts a login shell). Its
   wrapper records bash's exit status and wakes the waiter when bash ends (``exit``, ``exec`` of a
   program that ends, ``set -e`` tripped).
2. The command's text is written to ``<dir>/<n>.cmd`` byte for byte (quotes, ``$``, heredocs and
   backslashes are never retyped), and one line is typed into the pane (``send-keys -l``):
   ``source <n>.cmd > <n>.out 2>&1; echo $? > <n>.rc; tmux wait-for -U agentrl-<n>``. So the command
   runs in the shell itself (its effects persist), its stdout and stderr are merged into a file (not
   scraped from the pane), and stdin stays the terminal (a program reading it waits, as in a terminal,
   until the deadline).
3. The driver blocks on ``timeout T tmux wait-for -L agentrl-<n>``: it took that lock before typing,
   and the typed line releases it, so a command that finishes before the driver waits is never missed
   (a ``wait-for -S`` signal to nobody is lost). Channels are per command, so a late release from an
   earlier command never wakes a later one.
4. At the deadline it types ``C-c`` (as an interactive user would), then checks the shell is back at
   its prompt (a probe line releasing ``agentrl-<n>-ready-<i>``, typed again every 2 s, within 12 s).
   Each probe has its own channel: a probe line swallowed by a program still reading the terminal
   never releases its lock, and a waiter killed by ``timeout`` stays queued on its channel in tmux,
   so a shared channel would hand every later release to a dead waiter. A shell that is not back (a
   program ignoring SIGINT, a REPL the command ``exec``'d into) has its session killed; the next
   command gets a new one.

The outcome is written to ``<dir>/<n>.status`` (``done <rc>``, ``exited <rc>``, ``timeout``,
``stuck``, ``lost``, or ``notmux``; then ``fresh`` when the session was started for this command),
read back with the output's first ``OUTPUT_LIMIT_BYTES`` by :func:`read_argv` and turned into an
:class:`ExecResult` by :func:`parse_result`.

Limits: the session's state is what one bash keeps; it is lost when bash ends or the session is
killed, which the next command's output says. Old outputs are truncated before each command (a
background job may still write to its command's output file; truncated, it takes no space on the
small private tmpfs). The tmux socket lives in ``/tmp`` (upstream's default socket, so the agent's
own ``tmux`` sees the session): an agent that removes ``/tmp/tmux-*`` gets a new shell next time. The
files live in the sandbox's private exec tmpfs (mode 700: the image's user must be root, as for
``exec``). Not isolation: the agent can see and signal the tmux server like any process.
"""

from __future__ import annotations

from infra.sandbox.base import ExecResult

SESSION = "agent"
PANE_SIZE = (200, 50)
HISTORY_LINES = 50_000
PROBE_S = 12
"""How long a shell has to come back to its prompt after ``C-c`` before its session is killed (CI's 2 cores
under two test workers once took longer than 5 s)."""
PROBE_EVERY_S = 2
"""The probe line is typed again this often until it answers (a program still reading the terminal may take one)."""
DRIVER_SLACK_S = 30
"""Added to a command's deadline as the ``timeout -s KILL`` of the driver itself (tmux wedged)."""

# POSIX sh (@NAME@ filled in below): $1 command number, $2 deadline (s), $3 WORKDIR, $4 command text, $5 folder.
_DRIVER = r"""
d=$5; n=$1; t=$2; w=$3; s="=@SESSION@"; p="=@SESSION@:"
mkdir -p "$d" && cd "$d" || exit 3
for f in *.out; do [ -f "$f" ] && : > "$f"; done
rm -f -- *.cmd *.rc *.exit *.status *.err
exec 2> "$n.err"
if ! command -v tmux >/dev/null 2>&1; then echo notmux > "$n.status"; exit 0; fi
printf '%s\n' "$4" > "$n.cmd" && echo "$n" > current || exit 4
fresh=
if ! tmux has-session -t "$s" 2>/dev/null; then
  tmux start-server \; set-option -g history-limit @HISTORY@ \; \
    new-session -d -s @SESSION@ -x @X@ -y @Y@ -c "$w" \
    "bash; e=\$?; c=\$(cat $d/current); echo \$e > $d/\$c.exit; tmux wait-for -U agentrl-\$c" || exit 5
  fresh=" fresh"
fi
type_line() { tmux send-keys -t "$p" -l "$1" \; send-keys -t "$p" Enter; }
tmux wait-for -L "agentrl-$n"
type_line " source $d/$n.cmd > $d/$n.out 2>&1; echo \$? > $d/$n.rc; tmux wait-for -U agentrl-$n" || exit 6
timeout "$t" tmux wait-for -L "agentrl-$n"; waited=$?
if [ -f "$n.rc" ]; then r="done $(cat "$n.rc")"
elif [ -f "$n.exit" ]; then r="exited $(cat "$n.exit")"
elif [ "$waited" = 124 ]; then
  tmux send-keys -t "$p" C-c
  r=stuck; i=0
  while [ "$i" -lt @PROBE@ ]; do
    tmux wait-for -L "agentrl-$n-ready-$i"
    type_line " tmux wait-for -U agentrl-$n-ready-$i"
    if timeout @PROBE_EVERY@ tmux wait-for -L "agentrl-$n-ready-$i"; then r=timeout; break; fi
    i=$((i + @PROBE_EVERY@))
  done
  [ "$r" = stuck ] && tmux kill-session -t "$s" 2>/dev/null
else r=lost; fi
echo "$r$fresh" > "$n.status"
"""
for _key, _value in {"SESSION": SESSION, "HISTORY": HISTORY_LINES, "X": PANE_SIZE[0], "Y": PANE_SIZE[1],
                     "PROBE": PROBE_S, "PROBE_EVERY": PROBE_EVERY_S}.items():
    _DRIVER = _DRIVER.replace(f"@{_key}@", str(_value))


def driver_argv(n: int, command: str, timeout_s: float, workdir: str, folder: str) -> list[str]:
    """The ``docker exec`` argv that runs ``command`` (the sandbox's ``n``-th) in the session and waits for it.

    ``folder`` is the private directory of the command, output, exit status and outcome files.
    """
    guard = f"{timeout_s + PROBE_S + DRIVER_SLACK_S:g}"
    return ["timeout", "-s", "KILL", guard, "sh", "-c", _DRIVER, "sh", str(n), f"{timeout_s:g}", workdir, command,
            folder]


def read_argv(n: int, folder: str, limit_bytes: int) -> list[str]:
    """The argv that prints command ``n``'s outcome line, then its output's first ``limit_bytes``.

    When the driver wrote no outcome, it prints an empty line, then the driver's errors.
    """
    script = ('cd "$1" || exit; if [ -f "$2.status" ]; then cat "$2.status"; head -c "$3" "$2.out" 2>/dev/null; '
              'else echo; cat "$2.err"; fi')
    return ["sh", "-c", script, "sh", folder, str(n), str(limit_bytes)]


def parse_result(text: str, duration_s: float, timeout_s: float, workdir: str,
                 had_session: bool) -> ExecResult | None:
    """The :class:`ExecResult` of what :func:`read_argv` printed; None when the image has no tmux.

    A timed-out command reports exit 137 (as ``exec``'s ``timeout -s KILL``) with its output so far.
    Notes in the output: a shell started anew though one ran before (``had_session``) says so first;
    a shell that ended (or was closed after a deadline) says so last.

    Raises:
        ValueError: ``text`` does not start with an outcome line.
    """
    status, _, output = text.partition("\n")
    words = status.split()
    if words == ["notmux"]:
        return None
    if not words or words[0] not in ("done", "exited", "timeout", "stuck", "lost"):
        raise ValueError(f"no outcome line from the shell driver: {text[:200]!r}")
    fresh = words[-1] == "fresh"
    kind = words[0]
    if fresh and had_session:
        output = (f"[new shell in {workdir}: the previous one had ended, and its working directory, variables "
                  f"and jobs with it]\n{output}")
    if kind == "done":
        return ExecResult(int(words[1]), output, False, duration_s)
    if kind in ("timeout", "stuck"):
        if kind == "stuck":
            output += (f"\n[the shell did not come back to its prompt after Ctrl-C at the {timeout_s:g} s deadline "
                       f"and was closed: the next command starts in a new shell in {workdir}]")
        return ExecResult(137, output, True, duration_s)
    code = int(words[1]) if kind == "exited" else 129  # lost: the terminal hung up (tmux server gone)
    output += f"\n[the shell exited (status {code}): the next command starts in a new shell in {workdir}]"
    return ExecResult(code, output, False, duration_s)
