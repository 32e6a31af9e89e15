"""Real upstream tasks, vendored verbatim (tests/fixtures/real_tasks, licences beside them), through build_envs."""

from pathlib import Path

import pytest

from envs.taskset import load_taskset
from infra.environments import build_catalog
from infra.store import validate_rows
from tests.helpers import run_scripted_episode

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "real_tasks"


def _one(backend, folder: Path, build_network: bool = True, validate: bool = True):
    """The one task in ``folder`` through ``build_catalog``: (task, its entry, its build and validation log)."""
    tasks, errors = load_taskset(folder)
    assert errors == [] and len(tasks) == 1
    (task,) = tasks
    entries, logs = build_catalog(backend, {task.task_id: task}, {task.task_id: "train"}, max_parallel_builds=1,
                                  build_network=build_network, validate=validate)
    return task, entries[0], logs.get(task.task_id, "")


def test_terminal_bench_task_builds_online_on_its_base_and_names_the_host_it_cannot_reach(backend):
    for image in backend.client.images.list(name="agentrl-task-csv-to-parquet"):  # build it, not reuse it
        backend.client.images.remove(image.id, force=True)
    _, entry, log = _one(backend, FIXTURES / "terminal-bench" / "csv-to-parquet")
    # the registry base image has its local equivalent, and the Dockerfile's apt-get reached Ubuntu's archive
    assert "ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624 -> agentrl-ubuntu:24.04-noble-2" in log
    assert "Step 2/4 : RUN apt-get update && apt-get install -y curl" in log and entry.image  # (layers may be cached)
    # run-tests.sh ran as authored (apt-get, then curl astral.sh | sh): not the solution's fault, not ours
    assert (entry.usable, entry.cause) == (False, "unreachable_host")
    assert entry.fix == "needs astral.sh, which this machine cannot reach"
    assert "Could not resolve host: astral.sh" in log


def test_offline_build_of_a_task_that_downloads_says_so(backend, tmp_path):
    """Not a vendored task (csv-to-parquet builds offline too: its base already has curl): one pip install."""
    task = tmp_path / "tasks" / "needs-pypi"
    (task / "tests").mkdir(parents=True)
    (task / "Dockerfile").write_text("FROM python:3.13-slim-bookworm\nRUN pip install --no-cache-dir six==1.16.0\n")
    (task / "task.yaml").write_text("instruction: Do nothing.\n")
    (task / "tests" / "test_outputs.py").write_text("def test_x():\n    pass\n")
    (task / "solution.sh").write_text("true\n")
    _, entry, log = _one(backend, tmp_path / "tasks", build_network=False)
    assert (entry.usable, entry.cause) == (False, "needs_network")
    assert "Step 2/3: RUN pip install --no-cache-dir six==1.16.0" in entry.fix  # (step 3: our LABEL)
    assert "tasks.build_network = true" in entry.fix


def test_terminal_bench_task_whose_run_tests_installs_its_test_dependencies_validates(backend):
    """stable-parallel-kmeans, as authored: a network build (pip installs numpy, scikit-learn, jupyter...
    on ``t-bench/python-3-13``), then its ``run-tests.sh`` pip-installs pytest and pytest-timeout (PyPI
    through the machine's CA) and runs ``$TEST_DIR/test_outputs.py``, parsed by the task's pytest parser.
    The reference solution (``solution.sh``, run as the agent would) passes; a do-nothing agent does not."""
    _, entry, log = _one(backend, FIXTURES / "terminal-bench" / "stable-parallel-kmeans")
    assert "ghcr.io/laude-institute/t-bench/python-3-13:20250620 -> agentrl-python:3.13-trixie-2" in log
    assert (entry.usable, entry.validation, entry.cause) == (True, "passed", ""), (entry.reason, log[-3000:])
    assert "reference solution passes; do-nothing scores 0.0" in log


def test_built_in_agent_keeps_its_shell_across_turns_on_a_real_task(backend, tiny_tokenizer):
    """The built-in agent (scripted replies) on stable-parallel-kmeans, in a real sandbox of the task's image:
    a ``cd`` and an ``export`` of turn 1 hold in turn 2 (one persistent shell per episode, as Terminal-Bench's
    tmux session), a file written in the image's WORKDIR stays there, and the task's own ``run-tests.sh``
    scores it: no ``stable_kmeans.py``, so the tests fail and it is a model failure, not an infra one."""
    task, entry, _ = _one(backend, FIXTURES / "terminal-bench" / "stable-parallel-kmeans", validate=False)
    assert entry.usable, entry.reason
    replies = ["```bash\ncd /tmp && export SPK_DIR=/app && mkdir -p turn1\n```",
               "```bash\necho \"cwd=$(pwd) dir=$SPK_DIR\" && ls -d turn1 && cd \"$SPK_DIR\" && echo 2 > turn2.txt\n```",
               "```bash\ncat /app/turn2.txt && pwd\n```",
               "DONE"]
    row, engine = run_scripted_episode(backend, tiny_tokenizer, task, entry, replies)
    validate_rows([row])
    assert len(row["commands"]) == 3 and row["agent_end"] == "done"
    seen = [tiny_tokenizer.decode(r.request.prompt_ids) for r in engine.received]
    assert "cwd=/tmp dir=/app\nturn1\n" in seen[2]  # turn 1's cd, export and folder held in turn 2
    assert "2\n/app" in seen[3]  # turn 2's file, and its cd held in turn 3
    # scored by the task's run-tests.sh and pytest parser: its tests ran and failed (no stable_kmeans.py)
    assert (row["outcome"], row["reason"], row["reward"]) == ("model_failure", "tests_failed", 0.0), row["reason"]
