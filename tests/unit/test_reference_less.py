"""Reference-less validation: a task without a reference solution, judged by its do-nothing run alone."""

from dataclasses import dataclass
from typing import ClassVar

import pytest

from envs.task import Outcome, Task, Verdict
from infra.environments import BASE_IMAGE, Catalog, EnvEntry, build_catalog, validate_task, validation_key
from tests.fakes import InMemoryBackend

# Do-nothing verdicts as the terminal verifiers give them (envs/verify.py's reason codes).
FAILED = Verdict(0.0, Outcome.MODEL_FAILURE, "tests_failed", "FAILED tests/test_outputs.py::test_output - missing")
NOT_RUN = Verdict(0.0, Outcome.UNKNOWN, "tests_did_not_run", "ERROR: file or directory not found: tests/x.py")
PASSED = Verdict(1.0, Outcome.SUCCESS, "tests_passed", "1 passed")
JUDGE_DOWN = Verdict(0.0, Outcome.MODEL_FAILURE, "tests_failed",
                     "E   requests.exceptions.HTTPError: 503 Server Error: Service Unavailable for url: "
                     "https://judge.example.org/grade\nFAILED tests/test_outputs.py::test_graded")


@dataclass(frozen=True, kw_only=True)
class ScriptedTask(Task):
    """A task in the base image whose validation runs answer with fixed verdicts (no solution unless given)."""

    idle: Verdict = FAILED
    solved: Verdict = PASSED
    task_format: ClassVar[str] = "scripted"
    verifier_name: ClassVar[str] = "scripted"

    def reference(self, sandbox, with_solution: bool) -> Verdict:
        return self.solved if with_solution else self.idle


class Backend(InMemoryBackend):
    """The in-memory backend with the one image the catalog asks about."""

    def image_digest(self, image: str) -> str:
        assert image == BASE_IMAGE
        return "sha256:base"


def _catalog(tasks: list[Task], **kw) -> tuple[dict[str, EnvEntry], Backend, list[str]]:
    backend, lines = Backend(), []
    by_id = {t.task_id: t for t in tasks}
    entries, _ = build_catalog(backend, by_id, dict.fromkeys(by_id, "train"), progress=lines.append, **kw)
    return {e.task_id: e for e in entries}, backend, lines


def test_a_task_whose_tests_run_and_fail_a_do_nothing_agent_is_usable_marked_unverified():
    got, backend, _ = _catalog([ScriptedTask(task_id="t/ok", instruction="x")], reference_less="usable")
    e = got["t/ok"]
    assert (e.usable, e.validation, e.cause) == (True, "unverified_reference", "")
    assert backend.starts == 1  # only the do-nothing run: there is no solution to run


def test_reference_less_failures_get_their_cause():
    tasks = [ScriptedTask(task_id="t/not-run", instruction="x", idle=NOT_RUN),
             ScriptedTask(task_id="t/trivial", instruction="x", idle=PASSED),
             ScriptedTask(task_id="t/judge", instruction="x", idle=JUDGE_DOWN)]
    got, _, _ = _catalog(tasks, reference_less="usable")
    assert {t: (e.usable, e.validation, e.cause) for t, e in got.items()} == {
        "t/not-run": (False, "failed", "tests_environment_broken"),
        "t/trivial": (False, "failed", "do_nothing_passes"),
        "t/judge": (False, "failed", "unreachable_host"),
    }
    assert got["t/judge"].fix == "needs judge.example.org, which this machine cannot reach"


def test_mode_unusable_keeps_a_task_without_solution_unusable_and_runs_nothing():
    got, backend, _ = _catalog([ScriptedTask(task_id="t/ok", instruction="x")], reference_less="unusable")
    assert (got["t/ok"].usable, got["t/ok"].cause) == (False, "no_solution")
    assert backend.starts == 0


def test_a_task_with_a_solution_validates_as_before_in_either_mode():
    for mode in ("usable", "unusable"):
        got, backend, _ = _catalog([ScriptedTask(task_id="t/s", instruction="x", solution="true")],
                                   reference_less=mode)
        assert (got["t/s"].usable, got["t/s"].validation) == (True, "passed")
        assert backend.starts == 2


def test_the_cache_key_tells_the_modes_apart_only_for_a_task_without_solution():
    bare = ScriptedTask(task_id="t/a", instruction="x")
    solved = ScriptedTask(task_id="t/b", instruction="x", solution="true")
    assert validation_key(bare, "d", "usable") != validation_key(bare, "d", "unusable")
    assert validation_key(bare, "d", "unusable") == validation_key(bare, "d")  # the key stored catalogs have
    assert validation_key(solved, "d", "usable") == validation_key(solved, "d", "unusable")
    with pytest.raises(ValueError, match="tasks.reference_less"):
        validation_key(bare, "d", "yes")


def test_cached_verdicts_are_reused_per_mode():
    task = ScriptedTask(task_id="t/ok", instruction="x")
    cache: dict[str, dict] = {}
    backend = Backend()
    kw = {"cache_get": cache.get, "cache_put": cache.__setitem__}
    first, _ = build_catalog(backend, {task.task_id: task}, {task.task_id: "train"}, reference_less="usable", **kw)
    again, _ = build_catalog(backend, {task.task_id: task}, {task.task_id: "train"}, reference_less="usable", **kw)
    assert backend.starts == 1 and first == again and again[0].validation == "unverified_reference"
    other, _ = build_catalog(backend, {task.task_id: task}, {task.task_id: "train"}, reference_less="unusable", **kw)
    assert other[0].cause == "no_solution" and len(cache) == 2


def test_validate_task_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="tasks.reference_less"):
        validate_task(Backend(), ScriptedTask(task_id="t/a", instruction="x"), BASE_IMAGE, "maybe")


def test_progress_reports_each_task_as_it_is_built_and_validated():
    tasks = [ScriptedTask(task_id="t/a", instruction="x"), ScriptedTask(task_id="t/b", instruction="x", idle=NOT_RUN)]
    _, _, lines = _catalog(tasks, max_parallel_builds=1)
    built = sorted(line.split(" in ")[0] for line in lines if "validated" not in line)
    checked = sorted(line.split(" in ")[0] for line in lines if "validated" in line)
    assert built == ["[1/2] t/a: no image to build (base image)", "[2/2] t/b: no image to build (base image)"]
    # the two validations finish in either order; each line names its verdict
    assert {c.split("] ", 1)[1] for c in checked} == {"t/a: validated (unverified_reference)",
                                                       "t/b: validated (failed)"}
    assert sorted(c.split("]")[0] for c in checked) == ["[1/2", "[2/2"]
    assert all(line.endswith(" s") for line in lines)


def test_the_summary_line_counts_unverified_reference_apart():
    from tasks.build_envs import catalog_summary

    entries = [EnvEntry("t/a", "train", "i", "d", True, True, validation="passed"),
               EnvEntry("t/b", "train", "i", "d", True, True, validation="unverified_reference"),
               EnvEntry("t/c", "train", "i", "d", True, False, "validation failed: x", validation="failed",
                        cause="tests_environment_broken")]
    assert catalog_summary(entries, []) == ("2 of 3 usable (1 unverified reference), 0 not loaded "
                                            "(unusable by cause: tests_environment_broken 1)")
    assert catalog_summary(entries[:1], []) == "1 of 1 usable, 0 not loaded"


def test_a_stored_catalog_of_before_reads_back():
    old = {"tasks": [{"task_id": "t/a", "split": "train", "image": "i", "image_digest": "d", "built": True,
                      "usable": True, "reason": "", "task_format": "terminal-bench", "validation": "passed"}]}
    assert Catalog.from_json(old).entries[0].validation == "passed"


def test_an_aged_reference_solution_is_dependency_drift_however_long_the_test_output():
    """matlab-python-conversion as it fails today: the drift line leads the solution's log, the verifier's
    pytest output after it is far longer than the 500 characters the catalog's reason keeps."""
    aged = Verdict(0.0, Outcome.MODEL_FAILURE, "tests_failed",
                   "solution dependency drift: gnupg=2.2.40-1.1 (no longer served)\nsolution exit 1: ...\n"
                   + "E   FileNotFoundError: [Errno 2] No such file or directory: 'I.mat'\n" * 40)
    got, _, _ = _catalog([ScriptedTask(task_id="t/aged", instruction="x", solution="apt-get install gnupg=2.2.40-1.1",
                                       solved=aged)])
    e = got["t/aged"]
    assert (e.usable, e.cause) == (False, "dependency_drift") and "gnupg=2.2.40-1.1" in e.fix
