"""What a run leaves behind when it is killed: removed by a watchdog the moment its process ends.

A run's process may die by SIGKILL (an OOM kill, a cancelled deployment, ``kill -9``) with no
``finally`` or ``atexit`` running: its vLLM servers (own sessions), the egress proxy, a local Ray
instance, and the sandbox containers of its warm pool would stay until the next run reaps them.
:func:`ensure_watchdog` marks the process with ``AGENTRL_OWNER=<host>:<pid>`` in its environment,
which every process it starts inherits, and which labels every container it starts
(:func:`infra.sandbox.docker_backend.owner_id`), then starts ``python -m infra.reaper`` detached (its own
session, no child of the run: a Ray worker's exit kills its children; reparented to init, or to a
subreaper such as Ray's raylet when Ray is set to be one, which then ends it with the worker). The
watchdog waits on a pidfd of the owner (no polling, no pid-reuse race) and, when the owner ends for any
reason, SIGKILLs every process whose environment carries the mark and removes every container with that
owner label. Services shared by runs (dockerd, SeaweedFS, the Prefect server) are started without the mark.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

OWNER_ENV = "AGENTRL_OWNER"


def unmarked_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``) without the owner mark: for a process that must outlive the run."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k != OWNER_ENV}


def owner_mark() -> dict[str, str]:
    """``{AGENTRL_OWNER: mark}`` when this process is marked: for a child started with an environment of its own."""
    return {OWNER_ENV: os.environ[OWNER_ENV]} if os.environ.get(OWNER_ENV) else {}


def ensure_watchdog() -> str:
    """Mark this process and start its watchdog, once; returns the owner id (``host:pid``).

    A process that inherited a mark (started by a run: a Ray worker, a flow's subprocess) keeps it
    and starts none: its parent's watchdog covers it.
    """
    owner = os.environ.get(OWNER_ENV)
    if owner:
        return owner
    owner = f"{socket.gethostname()}:{os.getpid()}"
    # Detached (it forks, its parent exits here): no child of this process, so nothing that kills this
    # process's children on its exit takes the watchdog with it (a Ray worker's exit does: Ray kills them)
    started = subprocess.run([sys.executable, "-m", "infra.reaper", "--detach", str(os.getpid()), owner],
                             start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, env=unmarked_env(), cwd=Path(__file__).resolve().parents[1],
                             check=False, timeout=60)
    if started.returncode != 0:  # marked all the same: the next run's reaper still finds its containers
        sys.stderr.write(f"agentrl: the watchdog of {owner} did not start: {started.stderr.decode()[-500:]}\n")
    os.environ[OWNER_ENV] = owner
    return owner


def marked_pids(owner: str, proc: Path = Path("/proc")) -> list[int]:
    """Processes whose environment holds ``AGENTRL_OWNER=<owner>`` (this one excluded)."""
    mark = f"{OWNER_ENV}={owner}".encode()
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or a kernel thread
            continue
        if mark in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def clean_up(owner: str) -> tuple[int, int]:
    """SIGKILL the owner's marked processes and remove its containers; returns ``(processes, containers)``."""
    killed = 0
    for _ in range(3):  # a process may start another while the first pass runs
        pids = marked_pids(owner)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        if not pids:
            break
    removed = 0
    try:
        import docker

        from infra.sandbox.docker_backend import OWNER_LABEL

        client = docker.from_env(timeout=60)
        for c in client.containers.list(all=True, ignore_removed=True, filters={"label": f"{OWNER_LABEL}={owner}"}):
            try:
                c.remove(force=True)
                removed += 1
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as e:  # e.g. 409, its removal already under way: the next one goes on
                sys.stderr.write(f"agentrl reaper: container {c.short_id} not removed: {e}\n")
    except Exception as e:  # no engine: nothing of ours runs there; the next run's reaper retries
        sys.stderr.write(f"agentrl reaper: containers of {owner} not removed: {type(e).__name__}: {e}\n")
    return killed, removed


def main(argv: list[str]) -> int:
    """``python -m infra.reaper [--detach] <pid> <owner>``: wait for ``pid`` to end, then :func:`clean_up` ``owner``.

    ``--detach``: open the pidfd, fork, and return at once (so returning means watching); the fork,
    reparented to init (or to the nearest subreaper), waits and cleans up.
    """
    detach = bool(argv) and argv[0] == "--detach"
    pid, owner = int(argv[detach]), argv[detach + 1]
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None  # already gone
    if detach:
        if os.fork():
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        for stream in (0, 1, 2):  # let go of the starter's pipes: it waits for them to close
            os.dup2(devnull, stream)
    if fd is not None:
        select.select([fd], [], [])  # readable when the process has ended
    clean_up(owner)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
