"""The watchdog finds a run's processes by the mark in their environment, and only those."""

from infra.reaper import OWNER_ENV, marked_pids, owner_mark, unmarked_env


def test_marked_processes_are_found_by_the_exact_mark(tmp_path, monkeypatch):
    for pid, environ in {"101": f"PATH=/bin\0{OWNER_ENV}=h:7\0", "102": f"{OWNER_ENV}=h:70\0",
                         "103": f"X={OWNER_ENV}=h:7\0", "104": f"{OWNER_ENV}=h:7"}.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "environ").write_bytes(environ.encode())
    (tmp_path / "self").mkdir()
    (tmp_path / "105").mkdir()  # a kernel thread: no readable environ
    assert sorted(marked_pids("h:7", tmp_path)) == [101, 104]
    monkeypatch.setenv(OWNER_ENV, "h:7")
    assert owner_mark() == {OWNER_ENV: "h:7"} and OWNER_ENV not in unmarked_env()
    monkeypatch.delenv(OWNER_ENV)
    assert owner_mark() == {}


def test_the_watchdog_outlives_a_parent_whose_children_are_killed_with_it(tmp_path):
    """As a Ray worker's exit kills the worker's children: the watchdog is none of them, and still cleans up."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    script = ("import subprocess, sys; from infra.reaper import ensure_watchdog; ensure_watchdog(); "
              "p = subprocess.Popen(['sleep', '300']); print(p.pid, flush=True); sys.stdin.read()")
    env = unmarked_env()
    owner = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=env, cwd=Path(__file__).resolve().parents[2])
    sleeper = int(owner.stdout.readline())
    try:
        for child in psutil.Process(owner.pid).children():  # what Ray does to a worker's children as it exits
            if child.pid != sleeper:
                child.kill()
        assert psutil.Process(sleeper).is_running()
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 20
        while _alive(sleeper):
            assert time.monotonic() < deadline, "the marked child outlived its owner: no watchdog cleaned up"
            time.sleep(0.1)
    finally:
        if _alive(sleeper):
            psutil.Process(sleeper).kill()


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
