"""Reference-less validation on real dockerd: a Terminal-Bench and a Harbor task without their solutions."""

import shutil
from pathlib import Path

import pytest

from envs.taskset import load_taskset
from infra.environments import build_catalog

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_tasks_without_solution_validate_by_their_do_nothing_run(backend, tmp_path):
    """hello-file (hardened pytest) and count-words (Harbor test.sh) lose their solution: their tests run
    and fail a do-nothing agent, so both are usable, marked unverified_reference. A copy whose
    ``run-tests.sh`` looks for its tests where the harness does not put them (``tests/`` under the
    WORKDIR, as some real task sets do) gives no test result: unusable, tests_environment_broken."""
    shutil.copytree(ROOT / "envs" / "terminal" / "hello-file", tmp_path / "hello-file")
    (tmp_path / "hello-file" / "solution.sh").unlink()
    shutil.copytree(ROOT / "envs" / "harbor" / "count-words", tmp_path / "count-words")
    shutil.rmtree(tmp_path / "count-words" / "solution")
    shutil.copytree(tmp_path / "hello-file", tmp_path / "tests-elsewhere")
    run_tests = "#!/bin/bash\npython3 -m pytest -v tests/test_outputs.py\n"
    (tmp_path / "tests-elsewhere" / "run-tests.sh").write_text(run_tests)
    tasks, errors = load_taskset(tmp_path)
    assert errors == [] and all(t.solution is None for t in tasks)
    by_id = {t.task_id: t for t in tasks}
    cache: dict[str, dict] = {}
    lines: list[str] = []
    entries, logs = build_catalog(backend, by_id, dict.fromkeys(by_id, "train"), cache_get=cache.get,
                                  cache_put=cache.__setitem__, reference_less="usable", progress=lines.append)
    got = {e.task_id: e for e in entries}
    for ok in ("tb/hello-file", "harbor/count-words"):
        assert (got[ok].usable, got[ok].validation) == (True, "unverified_reference"), (ok, logs.get(ok))
        assert "do-nothing scores 0.0 (tests_failed)" in logs[ok]
    broken = got["tb/tests-elsewhere"]
    assert (broken.usable, broken.cause) == (False, "tests_environment_broken"), (broken.reason, logs[broken.task_id])
    assert "(tests_did_not_run)" in broken.reason
    assert len(lines) == 6 and any(line.startswith("[3/3] ") and " validated (" in line for line in lines)
    # the other mode: no solution, no validation run, cause no_solution (its own cache key: nothing reused)
    again, _ = build_catalog(backend, by_id, dict.fromkeys(by_id, "train"), cache_get=cache.get,
                             cache_put=cache.__setitem__, reference_less="unusable")
    assert {e.cause for e in again} == {"no_solution"} and len(cache) == 6
