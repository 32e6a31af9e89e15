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
