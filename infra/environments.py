"""The environment catalog: every task of a run, its image, and whether it is usable.

Terminal tasks get an image built from their Dockerfile on the local base image, tagged by the
hash of the build context (rebuilt only when that changes). Code tasks run in the base image.
A task whose folder does not load or whose image fails to build is marked unusable with the
reason; the others go on.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import docker.errors

from envs.humaneval import load_humaneval
from envs.task import Task
from envs.terminal_bench import load_terminal_tasks
from infra.sandbox.docker_backend import DockerBackend

BASE_IMAGE = "agentrl-base:bookworm"


@dataclass(frozen=True)
class EnvEntry:
    """One task's environment: image tag and digest, split (train/eval), usable or why not."""

    task_id: str
    split: str
    image: str
    image_digest: str
    built: bool
    usable: bool
    reason: str = ""


def load_tasks(terminal_dir: Path | None, terminal_eval_ids: list[str], humaneval_train: int,
               humaneval_eval: int, code_file: Path | None = None) -> tuple[dict[str, Task], dict[str, str], list[str]]:
    """All tasks of a run.

    Terminal tasks (none when ``terminal_dir`` is None), HumanEval slices, and every problem of
    ``code_file`` (HumanEval format), the latter for training.

    Returns:
        (tasks by id, split by id (``train``/``eval``), load errors naming the file).

    Raises:
        ValueError: the HumanEval train and eval slices overlap, or an eval id is not a task.
    """
    if humaneval_train + humaneval_eval > 164:
        raise ValueError(f"tasks.humaneval_train ({humaneval_train}) + tasks.humaneval_eval ({humaneval_eval}) "
                         "> 164: the train and held-out HumanEval problems would overlap")
    terminal, errors = load_terminal_tasks(terminal_dir) if terminal_dir is not None else ([], [])
    tasks, split = {}, {}
    for t in terminal:
        tasks[t.task_id] = t
        split[t.task_id] = "eval" if t.task_id.removeprefix("tb/") in terminal_eval_ids else "train"
    unknown = set(terminal_eval_ids) - {t.task_id.removeprefix("tb/") for t in terminal}
    if unknown:
        raise ValueError(f"tasks.terminal_eval_ids: {sorted(unknown)} are not tasks in {terminal_dir}")
    for t in load_humaneval(path=str(code_file)) if code_file is not None else []:
        tasks[t.task_id], split[t.task_id] = t, "train"
    for t in load_humaneval(first=humaneval_train) if humaneval_train else []:
        tasks[t.task_id], split[t.task_id] = t, "train"
    for t in load_humaneval(last=humaneval_eval) if humaneval_eval else []:
        tasks[t.task_id], split[t.task_id] = t, "eval"
    return tasks, split, errors


def build_catalog(backend: DockerBackend, tasks: dict[str, Task], split: dict[str, str],
                  max_parallel_builds: int = 2) -> tuple[list[EnvEntry], dict[str, str]]:
    """Build every terminal task's image (bounded concurrency); code tasks use the base image.

    Returns:
        (one entry per task, build logs by task id).
    """
    base_digest = backend.image_digest(BASE_IMAGE)
    logs: dict[str, str] = {}

    def build(task: Task) -> EnvEntry:
        if task.kind != "terminal":
            return EnvEntry(task.task_id, split[task.task_id], BASE_IMAGE, base_digest, False, True)
        assert task.build_context is not None
        name = task.task_id.removeprefix("tb/")
        try:
            tag, built, log = backend.build_image(name, task.build_context)
        except (docker.errors.BuildError, docker.errors.APIError) as e:
            logs[task.task_id] = "".join(str(c.get("stream", "")) for c in getattr(e, "build_log", []) or [])
            return EnvEntry(task.task_id, split[task.task_id], "", "", False, False, f"image build failed: {e}")
        logs[task.task_id] = log
        return EnvEntry(task.task_id, split[task.task_id], tag, backend.image_digest(tag), built, True)

    with ThreadPoolExecutor(max_workers=max_parallel_builds) as pool:
        entries = list(pool.map(build, tasks.values()))
    return entries, logs


def catalog_to_json(entries: list[EnvEntry], errors: list[str]) -> dict:
    """The catalog as stored (``envs.json``)."""
    return {"tasks": [asdict(e) for e in entries], "load_errors": errors}
