r"""How much of a real task corpus is usable here: load, build and validate every task, count by cause.

Each task goes through what ``build_envs`` does (``infra.environments.build_catalog``): load its
folder, build its image (network builds, registry base images mapped to local equivalents), run
its reference solution (must pass) and a do-nothing agent (must not). Unusable tasks are counted by
cause class (``infra.task_faults``); ``unreachable_host`` is counted apart, as the issue asks: such a
task would work where that host is reachable. ``usable share of the rest`` = usable / (all -
unreachable_host). Images are removed after each task (``--keep-images`` keeps them) so a corpus of
large images fits the engine's disk.

``--reference-less usable`` (the default, as ``tasks.reference_less``) validates a task without a
reference solution by its do-nothing run alone (usable, marked ``unverified_reference`` and counted
apart); ``unusable`` makes it ``no_solution``.

Sandboxes and builds go through the egress proxy (``infra.egress``, as ``tasks.egress.enabled``; a
denied or failed host is in the task's log and named by its cause); ``--mirror uv`` declares the uv
mirror (uv's installer from PyPI's wheel); ``--exclude-newer 2025-07-01`` declares the ``exclude-newer``
mirror (PyPI as it was then, for tasks whose unpinned dependencies have moved on); ``--no-egress`` reaches
the outside directly.

Corpora are folders of task folders; ``checkout`` copies a sub-folder of a fetched git mirror
(``git archive``) so nothing third-party is committed here (``--remove-solutions`` drops each
task's reference solution in the copy: the honest stand-in for a task set that ships none)::

    python -m benchmarks.task_corpus checkout <mirror>/AakashKotha+Terminal-Bench-DS-Tasks/repo . \\
        <corpus>/tb --strip-prefix "laude-institute terminal-bench main tasks-"
    python -m benchmarks.task_corpus run <corpus>/tb <corpus>/harbor --out corpus.json
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import random
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from envs.taskset import load_taskset
from infra.egress.mirrors import parse_cutoff
from infra.egress.policy import Mirror
from infra.egress.proxy import EGRESS_GATEWAY, EgressProxy, EgressSettings
from infra.environments import BASE_IMAGE, EnvEntry, build_catalog
from infra.sandbox.docker_backend import DockerBackend
from infra.task_faults import classify

SOLUTION_FILES = ("solution.sh", "solution.yaml", "solution")
"""A task folder's reference solution: Terminal-Bench's ``solution.sh``/``solution.yaml``, Harbor's ``solution/``."""


def checkout(repo: Path, subdir: str, dest: Path, strip_prefix: str = "", sample: int = 0, seed: int = 0,
             include: list[str] | None = None, name_pattern: str = "", remove_solutions: bool = False) -> int:
    r"""Copy the task folders under ``subdir`` of git ``repo`` (HEAD) to ``dest``; returns how many.

    ``strip_prefix`` is removed from folder names (and only folders with it are taken); ``include``
    (globs on the folder name) keeps only the folders matching one; ``name_pattern`` (a regex with groups)
    renames each folder to its groups joined by ``-`` (``"^([0-9]+)\. tasks-(.*)$"``: ``001. tasks-foo`` ->
    ``001-foo``); ``sample``
    > 0 takes that many folders at random (``seed``), sorted by name; ``remove_solutions`` deletes each
    copy's :data:`SOLUTION_FILES`.

    Raises:
        ValueError: ``name_pattern`` does not match a folder name, or two folders get one name.
    """
    names = subprocess.run(["git", "-C", str(repo), "ls-tree", "--name-only", "HEAD", f"{subdir.rstrip('/')}/"],
                           check=True, capture_output=True, text=True).stdout.splitlines()
    names = sorted(n for n in names if not Path(n).name.startswith(".") and not n.endswith(".md")
                   and Path(n).name.startswith(strip_prefix)
                   and (not include or any(fnmatch.fnmatch(Path(n).name, g) for g in include)))

    def target_name(name: str) -> str:
        short = Path(name).name.removeprefix(strip_prefix)
        if not name_pattern:
            return short
        if (m := re.match(name_pattern, short)) is None:
            raise ValueError(f"--name-pattern {name_pattern!r} does not match the folder name {short!r}")
        return "-".join(m.groups())

    targets = [target_name(n) for n in names]
    if len(set(targets)) != len(targets):
        dup = sorted({t for t in targets if targets.count(t) > 1})
        raise ValueError(f"--name-pattern {name_pattern!r}: several folders become {dup}; include fewer")
    if sample:
        names = sorted(random.Random(seed).sample(names, min(sample, len(names))))
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        with tempfile.TemporaryFile() as tmp:
            subprocess.run(["git", "-C", str(repo), "archive", "HEAD", name], check=True, stdout=tmp)
            tmp.seek(0)
            target = dest / target_name(name)
            shutil.rmtree(target, ignore_errors=True)
            with tarfile.open(fileobj=tmp) as tar:
                members = [m for m in tar.getmembers() if m.name.startswith(f"{name}/")]
                for member in members:
                    member.name = member.name.removeprefix(f"{name}/")
                tar.extractall(target, members=members, filter="data")
        if remove_solutions:
            for solution in SOLUTION_FILES:
                path = target / solution
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
    return len(names)


def run(roots: list[Path], parallel: int, keep_images: bool, build_network: bool,
        reference_less: str = "usable", egress: EgressSettings | None = None) -> list[dict]:
    """Every task of ``roots`` through build and validation, one record per task (or load error).

    ``egress``: sandboxes and builds with the network go through the egress proxy with these settings
    (``infra.egress``, as a run with ``tasks.egress.enabled``); None: they reach the outside directly.
    """
    proxy = EgressProxy(EGRESS_GATEWAY, egress) if egress is not None else None
    try:
        return _run(DockerBackend(egress=proxy), roots, parallel, keep_images, build_network, reference_less)
    finally:
        if proxy is not None:
            proxy.close()


def _run(backend: DockerBackend, roots: list[Path], parallel: int, keep_images: bool, build_network: bool,
         reference_less: str) -> list[dict]:
    records: list[dict] = []
    for root in roots:
        tasks, errors = load_taskset(root)
        for err in errors:
            cause, fix = classify(f"task folder not loaded: {err}", err)
            records.append({"source": root.name, "task_id": err.split(":", 1)[0], "usable": False,
                            "cause": cause, "fix": fix, "reason": err, "seconds": 0.0})

        def one(task, root=root) -> dict:
            t0 = time.perf_counter()
            try:
                entries, logs = build_catalog(backend, {task.task_id: task}, {task.task_id: "train"},
                                              max_parallel_builds=1, build_network=build_network,
                                              reference_less=reference_less)
            except Exception as exc:  # noqa: BLE001 - the engine went away mid-task: recorded, the corpus goes on
                backend.wait_engine(120)
                print(f"{'infra':>26}  {task.task_id}  {type(exc).__name__}: {exc}", flush=True)
                return {"source": root.name, "task_id": task.task_id, "usable": False, "cause": "infra",
                        "fix": "the engine failed during this task; run it again", "reason": str(exc)[:500],
                        "seconds": round(time.perf_counter() - t0, 1)}
            e: EnvEntry = entries[0]
            if not keep_images and e.image and e.image != BASE_IMAGE:
                try:
                    backend.client.images.remove(e.image, force=True)
                except Exception:  # noqa: BLE001 - pruning is best effort
                    pass
            rec = {"source": root.name, **asdict(e), "seconds": round(time.perf_counter() - t0, 1),
                   "log_tail": logs.get(task.task_id, "")[-1500:]}
            state = ("usable (unverified reference)" if e.validation == "unverified_reference" else "usable")
            print(f"{state if e.usable else e.cause:>26}  {task.task_id}  ({rec['seconds']} s)"
                  + ("" if e.usable else f"  {e.fix}"), flush=True)
            return rec

        with ThreadPoolExecutor(max_workers=parallel) as pool:
            records += list(pool.map(one, tasks))
    return records


def summary(records: list[dict]) -> str:
    """Per source: all, usable (of them unverified reference), unreachable-host, usable share of the rest, causes."""
    lines = ["| source | tasks | usable | of them unverified reference | unreachable host | usable of the rest "
             "| unusable by cause |", "|---|---:|---:|---:|---:|---:|---|"]
    for source in sorted({r["source"] for r in records}):
        rs = [r for r in records if r["source"] == source]
        usable = sum(r["usable"] for r in rs)
        unreachable = sum(r.get("cause") == "unreachable_host" for r in rs)
        rest = len(rs) - unreachable
        causes = Counter(r["cause"] for r in rs if not r["usable"] and r["cause"] != "unreachable_host")
        share = f"{usable}/{rest} = {usable / rest:.0%}" if rest else "-"
        unverified = sum(r["usable"] and r.get("validation") == "unverified_reference" for r in rs)
        lines.append(f"| {source} | {len(rs)} | {usable} | {unverified} | {unreachable} | {share} | "
                     + ", ".join(f"{c} {n}" for c, n in causes.most_common()) + " |")
    return "\n".join(lines)


def main() -> None:
    """``checkout`` a corpus from a git mirror, or ``run`` corpora and print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("checkout", help="copy task folders out of a fetched git mirror")
    c.add_argument("repo", type=Path)
    c.add_argument("subdir")
    c.add_argument("dest", type=Path)
    c.add_argument("--strip-prefix", default="")
    c.add_argument("--sample", type=int, default=0)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--include", action="append", default=[], help="glob on folder names to keep (repeatable)")
    c.add_argument("--name-pattern", default="",
                   help="regex with groups: each folder's new name is its groups joined by '-'")
    c.add_argument("--remove-solutions", action="store_true", help="delete each copy's reference solution")
    r = sub.add_parser("run", help="build and validate every task of the given folders")
    r.add_argument("roots", type=Path, nargs="+")
    r.add_argument("--parallel", type=int, default=2)
    r.add_argument("--keep-images", action="store_true")
    r.add_argument("--offline", action="store_true", help="builds without network (tasks.build_network = false)")
    r.add_argument("--out", type=Path, help="write every record as JSON")
    r.add_argument("--no-egress", action="store_true", help="sandboxes and builds reach the outside directly")
    r.add_argument("--mirror", action="append", default=[], choices=("uv",),
                   help="a declared egress mirror (tasks.egress.mirrors); repeatable")
    r.add_argument("--exclude-newer", default="", metavar="DATE",
                   help="declare the exclude-newer mirror: PyPI without files uploaded at or after DATE (ISO 8601)")
    r.add_argument("--reference-less", choices=("usable", "unusable"), default="usable",
                   help="a task without a reference solution: validated without one (usable, marked "
                        "unverified_reference) or unusable (no_solution), as tasks.reference_less")
    args = p.parse_args()
    if args.cmd == "checkout":
        print(checkout(args.repo, args.subdir, args.dest, args.strip_prefix, args.sample, args.seed, args.include,
                       args.name_pattern, args.remove_solutions), "task folders")
        return
    t0 = time.perf_counter()
    mirrors = [Mirror(kind) for kind in args.mirror]
    if args.exclude_newer:
        parse_cutoff(args.exclude_newer)
        mirrors.append(Mirror("exclude-newer", source=args.exclude_newer))
    egress = None if args.no_egress else EgressSettings(mirrors=tuple(mirrors))
    records = run(args.roots, args.parallel, args.keep_images, not args.offline, args.reference_less, egress)
    if args.out:
        args.out.write_text(json.dumps(records, indent=1))
    print(summary(records))
    print(f"{len(records)} tasks in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
