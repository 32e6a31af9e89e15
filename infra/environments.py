"""The environment catalog: every task of a run, its image, and whether it is usable.

Terminal tasks get an image built from their Dockerfile on the local base image, tagged by the
hash of the build context (rebuilt only when that changes). Code tasks run in the base image.
A task whose folder does not load or whose image fails to build is marked unusable with the
reason; the others go on.

Validation gate: every task is run twice before it may be trained on: its reference solution
must verify as ``success`` and a do-nothing agent must not. A task that fails either is unusable,
with the reason. A task without a reference solution (synthetic generators and many RL task sets
ship none) is validated by the do-nothing run alone when ``tasks.reference_less = "usable"``: its
tests must run and give a real result (``tests_failed``), which only shows the tests can be
failed, not that they can be passed, so such a task is usable but marked
``validation = "unverified_reference"`` and counted apart. Results are cached by a hash of
everything the verdict depends on (image digest, tests, solution, verifier, and for a task
without a solution the mode), so an unchanged task is validated once.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import docker.errors

from envs.humaneval import load_humaneval
from envs.task import Outcome, Task, TaskError
from envs.taskset import load_taskset
from envs.verify import Verdict
from infra.config import TaskSetConfig
from infra.egress.policy import record_lines
from infra.layout import resolve_path
from infra.sandbox.base import SandboxInfraError
from infra.sandbox.docker_backend import DockerBackend
from infra.task_faults import classify, drifted_dependencies, strip_ansi, unreachable_hosts

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
    task_format: str = ""
    validation: str = ""
    """``passed`` (reference solution passes, do-nothing fails), ``unverified_reference`` (no reference
    solution: the tests ran and a do-nothing agent fails them), ``skipped`` (gate off), ``failed``,
    ``infra_failure``, or empty (not validated: not built)."""
    cause: str = ""
    """Why it is unusable, as a class (``infra.task_faults.CAUSES``); empty when usable."""
    fix: str = ""
    """What would make it usable (one sentence); empty when usable."""


def _short_id(task_id: str) -> str:
    return task_id.split("/", 1)[1] if task_id.startswith(("tb/", "harbor/")) else task_id


def load_tasks(terminal_dir: Path | None, terminal_eval_ids: list[str], humaneval_train: int,
               humaneval_eval: int, code_file: Path | None = None,
               task_sets: list[Path] | None = None) -> tuple[dict[str, Task], dict[str, str], list[str]]:
    """All tasks of a run.

    Tasks of ``terminal_dir`` and of every ``task_sets`` entry (any format ``envs.load_taskset``
    detects: Terminal-Bench, Harbor, HumanEval JSONL), HumanEval slices, and every problem of
    ``code_file`` (HumanEval format). Tasks named in ``terminal_eval_ids`` (by full id or without
    the ``tb/``/``harbor/`` prefix) are held out for evaluation; the rest train.

    Returns:
        (tasks by id, split by id (``train``/``eval``), load errors naming the file).

    Raises:
        ValueError: the HumanEval train and eval slices overlap, or an eval id is not a task.
        envs.task.TaskError: a task set path or ``code_file`` does not exist, or ``code_file`` is not a
            readable HumanEval JSONL.
    """
    if humaneval_train + humaneval_eval > 164:
        raise ValueError(f"tasks.humaneval_train ({humaneval_train}) + tasks.humaneval_eval ({humaneval_eval}) "
                         "> 164: the train and held-out HumanEval problems would overlap")
    tasks: dict[str, Task] = {}
    split: dict[str, str] = {}
    errors: list[str] = []
    roots = [("tasks.terminal_dir", terminal_dir)] if terminal_dir is not None else []
    for field, root in roots + [("tasks.task_sets", p) for p in task_sets or []]:
        if not root.exists():
            raise TaskError(f"{field}: {root} not found (expected a task folder, a folder of tasks or a JSONL)")
        loaded, errs = load_taskset(root)
        errors += errs
        for t in loaded:
            if t.task_id in tasks:
                errors.append(f"{root}: task id {t.task_id} already loaded from another set; kept the first")
                continue
            tasks[t.task_id] = t
            held_out = t.task_id in terminal_eval_ids or _short_id(t.task_id) in terminal_eval_ids
            split[t.task_id] = "eval" if held_out else "train"
    unknown = set(terminal_eval_ids) - set(tasks) - {_short_id(t) for t in tasks}
    if unknown:
        raise ValueError(f"tasks.terminal_eval_ids: {sorted(unknown)} are not tasks of the configured task sets")
    if code_file is not None:
        if not code_file.is_file():
            what = "is not a file" if code_file.exists() else "not found"
            raise TaskError(f"tasks.code_file: {code_file} {what} (expected a HumanEval-format JSONL)")
        try:
            code_tasks = load_humaneval(path=str(code_file))
        except (ValueError, KeyError, TypeError, OSError, EOFError) as e:  # JSON/Unicode decode errors: ValueErrors
            raise TaskError(f"tasks.code_file: {code_file} is not a readable HumanEval-format JSONL "
                            f"({type(e).__name__}: {e})") from e
        for t in code_tasks:
            tasks[t.task_id], split[t.task_id] = t, "train"
    for t in load_humaneval(first=humaneval_train) if humaneval_train else []:
        tasks[t.task_id], split[t.task_id] = t, "train"
    for t in load_humaneval(last=humaneval_eval) if humaneval_eval else []:
        tasks[t.task_id], split[t.task_id] = t, "eval"
    return tasks, split, errors


def load_run_tasks(t: TaskSetConfig) -> tuple[dict[str, Task], dict[str, str], list[str]]:
    """Every task a run's ``tasks`` config names: ``(tasks by id, split by id, load errors)`` (see ``load_tasks``).

    ``tasks.sandbox_network = "none"`` takes the network from every task's sandbox.
    """
    tasks, split, errors = load_tasks(resolve_path(t.terminal_dir), t.terminal_eval_ids, t.humaneval_train,
                                      t.humaneval_eval, resolve_path(t.code_file),
                                      [resolve_path(p) for p in t.task_sets if p])
    if t.sandbox_network == "none":
        tasks = {i: replace(task, limits=replace(task.limits, network=False)) for i, task in tasks.items()}
    return tasks, split, errors


REFERENCE_LESS = ("usable", "unusable")
"""``tasks.reference_less`` values: a task without a reference solution is validated without one, or unusable."""

# Do-nothing verdicts that are a real test result: the tests ran and at least one failed.
_TESTS_RAN = ("tests_failed", "tests_skipped")


def validation_key(task: Task, image_digest: str, reference_less: str = "unusable") -> str:
    """Hash of everything a validation verdict depends on (image, tests, solution, verifier).

    A task without a reference solution gets another key per ``reference_less`` mode (its verdict
    depends on it); a task with one keeps the key it always had (the mode does not touch it).

    Raises:
        ValueError: ``reference_less`` is not one of :data:`REFERENCE_LESS`.
    """
    if reference_less not in REFERENCE_LESS:
        raise ValueError(f"tasks.reference_less: {reference_less!r} is not one of {REFERENCE_LESS}")
    verifier, *rest = task.verification_parts()
    mode = ["reference_less=usable"] if task.solution is None and reference_less == "usable" else []
    return hashlib.sha256("\0".join([verifier, image_digest, *rest, *mode]).encode()).hexdigest()


def validate_task(backend: DockerBackend, task: Task, image: str, reference_less: str = "unusable") -> tuple[bool, str]:
    """Run the reference solution (must verify as success) and a do-nothing agent (must not).

    Each runs in a fresh sandbox, scored by the task's own ``reference`` run (terminal tasks: the
    solution script runs as the agent would, then the task's verifier; code tasks: the solution
    program and the prompt with a ``pass`` body are verified).

    A task without a reference solution: with ``reference_less = "usable"`` only the do-nothing
    agent runs, and the task passes when the tests ran and failed it (reason ``tests_failed`` or
    ``tests_skipped``, no unreachable host in its log: a failure that a host could have caused
    says nothing about the tests); with ``"unusable"`` it fails at once.

    Returns:
        (ok, message): ``ok`` False names what failed (``reference solution scored 0.0 (tests_failed)``,
        ``a do-nothing agent passes``, ``no reference solution``, ``reference-less: the tests gave no
        result``), with the verifier's log tail.

    Raises:
        SandboxInfraError: the sandbox failed (validation could not run; not the task's fault).
        ValueError: ``reference_less`` is not one of :data:`REFERENCE_LESS`.
    """
    if reference_less not in REFERENCE_LESS:
        raise ValueError(f"tasks.reference_less: {reference_less!r} is not one of {REFERENCE_LESS}")
    if task.solution is None and reference_less == "unusable":
        return False, ("no reference solution (solution.sh, solution/solve.sh or canonical_solution), and "
                       "tasks.reference_less = \"unusable\"")

    def run(with_solution: bool) -> Verdict:
        box = backend.start(image, {"agentrl.validate": task.task_id.replace("/", "_")}, **task.limits.kwargs())
        try:
            verdict = task.reference(box, with_solution)
            egress = record_lines(box.egress_record())  # what went out, denials and mirrors named
            return replace(verdict, log=verdict.log + "".join(f"\n{line}" for line in egress)) if egress else verdict
        finally:
            box.close()

    if task.solution is None:
        return _validate_reference_less(run(False))
    solved = run(True)
    if solved.outcome != Outcome.SUCCESS:
        hosts = unreachable_hosts(solved.log)
        needs = f"; unreachable host(s) {', '.join(hosts)}" if hosts else ""
        drift = "".join(f"\nsolution dependency drift: {d}" for d in drifted_dependencies(solved.log))
        return False, f"reference solution scored {solved.reward} ({solved.reason}){needs}: {solved.log[-500:]}{drift}"
    idle = run(False)
    if idle.outcome == Outcome.SUCCESS:
        return False, "a do-nothing agent passes (the tests check nothing the agent must do)"
    egress = [line for line in solved.log.splitlines() if line.startswith(("[agent] egress", "[verifier] egress"))]
    return True, "\n".join([f"reference solution passes; do-nothing scores {idle.reward} ({idle.reason})", *egress])


def _validate_reference_less(idle: Verdict) -> tuple[bool, str]:
    """The verdict on a task without a reference solution from its do-nothing run (see :func:`validate_task`)."""
    if idle.outcome == Outcome.SUCCESS:
        return False, "reference-less: a do-nothing agent passes (the tests check nothing the agent must do)"
    hosts = unreachable_hosts(idle.log)
    if hosts:
        return False, (f"reference-less: do-nothing scored {idle.reward} ({idle.reason}) with unreachable host(s) "
                       f"{', '.join(hosts)}, so the tests' result says nothing: {idle.log[-500:]}")
    if idle.reason not in _TESTS_RAN:
        return False, (f"reference-less: the tests gave no result for a do-nothing agent "
                       f"({idle.reason}): {idle.log[-500:]}")
    return True, (f"no reference solution: usable unverified (tasks.reference_less = \"usable\"); the tests ran "
                  f"and do-nothing scores {idle.reward} ({idle.reason})")


def build_catalog(backend: DockerBackend, tasks: dict[str, Task], split: dict[str, str],
                  max_parallel_builds: int = 2, validate: bool = True,
                  base_images: dict[str, str] | None = None, fallback_base: str | None = None,
                  cache_get: Callable[[str], dict | None] | None = None,
                  cache_put: Callable[[str, dict], None] | None = None,
                  build_network: bool = True, registry_mirrors: dict[str, str] | None = None,
                  reference_less: str = "usable",
                  progress: Callable[[str], None] | None = None) -> tuple[list[EnvEntry], dict[str, str]]:
    """Build every terminal task's image (bounded concurrency), then validate every task.

    Code tasks use the base image. A build failure or a failed validation marks the task unusable
    with the reason; the others go on.

    Args:
        backend: Docker backend.
        tasks: tasks by id.
        split: ``train``/``eval`` by task id.
        max_parallel_builds: image builds (and validations) at once.
        validate: run the validation gate (False: every built task is usable, marked ``skipped``).
        base_images: ``FROM`` pattern -> local image (see ``map_base_images``).
        fallback_base: image for a ``FROM`` that is neither local, nor mapped, nor has a local equivalent,
            nor can be pulled (None: the build fails, cause ``registry_image``); an explicit choice only.
        cache_get: validation cache lookup by :func:`validation_key` (None: no cache).
        cache_put: validation cache store.
        build_network: image builds have network access (``DockerBackend.build_image``).
        registry_mirrors: registry -> mirror to pull registry base images from first
            (``infra.sandbox.registry.mirror_references``).
        reference_less: a task without a reference solution is validated without one and usable,
            marked ``unverified_reference`` (``"usable"``), or unusable (``"unusable"``); see
            :func:`validate_task`.
        progress: called with one line per task as its build and then its validation finishes
            (``[12/30] tb/foo: built in 8.2 s``, ``[12/30] tb/foo: validated (passed) in 14.0 s``), from
            the worker threads; None: silent.

    Returns:
        (one entry per task, each unusable one with its cause class and fix; build and validation logs
        by task id).

    Raises:
        ValueError: ``reference_less`` is not one of :data:`REFERENCE_LESS`.
    """
    if reference_less not in REFERENCE_LESS:
        raise ValueError(f"tasks.reference_less: {reference_less!r} is not one of {REFERENCE_LESS}")
    base_digest = backend.image_digest(BASE_IMAGE)
    logs: dict[str, str] = {}
    service_digests: dict[str, str] = {}  # a multi-service task's other images: part of its validation key

    totals = {"built": len(tasks), "validated": 0}  # validated: the entries still usable after their build
    counted = {"built": 0, "validated": 0}
    lock = threading.Lock()

    def report(stage: str, task_id: str, what: str, t0: float) -> None:
        if progress is None:
            return
        with lock:
            counted[stage] += 1
            n = counted[stage]
        progress(f"[{n}/{totals[stage]}] {task_id}: {what} in {time.monotonic() - t0:.1f} s")

    def build(task: Task) -> EnvEntry:
        t0 = time.monotonic()
        entry = build_one(task)
        what = ("built" if entry.built else "image up to date") if entry.image else "build failed"
        report("built", task.task_id, "no image to build (base image)" if entry.image == BASE_IMAGE else what, t0)
        return entry

    def build_one(task: Task) -> EnvEntry:
        image_build = task.image_build()
        if image_build is None:
            return EnvEntry(task.task_id, split[task.task_id], BASE_IMAGE, base_digest, False, True,
                            task_format=task.task_format)
        context, dockerfile = image_build
        name = task.task_id.removeprefix("tb/")
        try:
            tag, built, log = backend.build_image(name, context, dockerfile, base_images, fallback_base,
                                                  network=build_network, registry_mirrors=registry_mirrors)
        except (docker.errors.BuildError, docker.errors.APIError, OSError) as e:
            build_log = getattr(e, "build_log", []) or []
            logs[task.task_id] = strip_ansi("".join(str(c.get("stream", "")) for c in build_log))
            return EnvEntry(task.task_id, split[task.task_id], "", "", False, False, f"image build failed: {e}",
                            task_format=task.task_format)
        logs[task.task_id] = log
        if (services := task.limits.services) is not None:  # a multi-service task: the other services too
            try:
                service_tags, service_log = backend.build_services(tag, services, base_images, fallback_base,
                                                                   network=build_network,
                                                                   registry_mirrors=registry_mirrors)
            except (docker.errors.BuildError, docker.errors.APIError, OSError) as e:
                build_log = getattr(e, "build_log", []) or []
                logs[task.task_id] += strip_ansi("".join(str(c.get("stream", "")) for c in build_log))
                return EnvEntry(task.task_id, split[task.task_id], "", "", built, False,
                                f"image build failed: {e}", task_format=task.task_format)
            logs[task.task_id] += "\n" + service_log
            service_digests[task.task_id] = ",".join(backend.image_digest(t) for t in service_tags.values())
            if task.setup_command:
                return EnvEntry(task.task_id, split[task.task_id], "", "", built, False,
                                "set-up snapshot failed: setup_command is not supported in a multi-service task",
                                task_format=task.task_format)
        if task.setup_command:  # attempts start from a snapshot taken after the set-up ran once
            from infra.sandbox.pool import WarmPool

            pool = WarmPool(backend)
            try:
                tag = pool.snapshot(tag, task.setup_command, timeout_s=task.agent_timeout_s)
            except SandboxInfraError as e:
                return EnvEntry(task.task_id, split[task.task_id], "", "", built, False,
                                f"set-up snapshot failed: {e}", task_format=task.task_format)
            finally:
                pool.close()
            logs[task.task_id] += f"\nset-up snapshot: {tag}\n"
        return EnvEntry(task.task_id, split[task.task_id], tag, backend.image_digest(tag), built, True,
                        task_format=task.task_format)

    def check(entry: EnvEntry) -> EnvEntry:
        t0 = time.monotonic()
        checked = check_one(entry)
        if entry.usable:
            report("validated", entry.task_id, f"validated ({checked.validation})", t0)
        return checked

    def check_one(entry: EnvEntry) -> EnvEntry:
        if not entry.usable:
            return entry
        if not validate:
            return replace(entry, validation="skipped")
        task = tasks[entry.task_id]
        key = validation_key(task, entry.image_digest + service_digests.get(entry.task_id, ""), reference_less)
        cached = cache_get(key) if cache_get else None
        if cached is None:
            try:
                ok, message = validate_task(backend, task, entry.image, reference_less)
            except SandboxInfraError as e:  # not the task's fault: unusable this run, not cached
                return replace(entry, usable=False, reason=f"validation could not run: {e}",
                               validation="infra_failure")
            cached = {"ok": ok, "message": message, "task_id": task.task_id}
            if cache_put:
                cache_put(key, cached)
        logs[entry.task_id] = logs.get(entry.task_id, "") + f"\nvalidation: {cached['message']}\n"
        if cached["ok"]:
            return replace(entry, validation="passed" if task.solution is not None else "unverified_reference")
        return replace(entry, usable=False, reason=f"validation failed: {cached['message']}", validation="failed")

    with ThreadPoolExecutor(max_workers=max_parallel_builds) as pool:
        entries = list(pool.map(build, tasks.values()))
    totals["validated"] = sum(e.usable for e in entries)
    with ThreadPoolExecutor(max_workers=max(2, max_parallel_builds)) as pool:
        entries = list(pool.map(check, entries))
    entries = [e if e.usable else replace(e, **dict(zip(("cause", "fix"), classify(
        e.reason, logs.get(e.task_id, ""), e.validation, build_network), strict=True))) for e in entries]
    return entries, logs


@dataclass(frozen=True)
class Catalog:
    """The run's environments (``envs.json``): one entry per task, and the task folders that failed to load."""

    entries: tuple[EnvEntry, ...]
    load_errors: tuple[str, ...] = ()

    def to_json(self) -> dict:
        """The catalog as stored: ``{"tasks": [entry fields], "load_errors": [messages]}``."""
        return {"tasks": [asdict(e) for e in self.entries], "load_errors": list(self.load_errors)}

    @classmethod
    def from_json(cls, data: dict, source: str = "envs.json") -> Catalog:
        """Parse a stored catalog.

        Raises:
            ValueError: an entry misses a field or has an unknown one; the message names ``source``.
        """
        try:
            return cls(tuple(EnvEntry(**e) for e in data["tasks"]), tuple(data.get("load_errors", ())))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{source}: not a catalog of this version ({e}); rebuild it with build_envs") from e

    def usable(self, split: str | None = None) -> list[EnvEntry]:
        """Usable entries, of one split (``train``/``eval``) or all."""
        return [e for e in self.entries if e.usable and (split is None or e.split == split)]

    def images(self, split: str | None = None) -> dict[str, tuple[str, str]]:
        """Usable task id -> (image tag, image digest)."""
        return {e.task_id: (e.image, e.image_digest) for e in self.usable(split)}
