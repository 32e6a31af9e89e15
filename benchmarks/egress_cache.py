"""Verification of a real task through the egress proxy, cold cache against warm: seconds and upstream bytes.

The task's image is built once (through the proxy); then its reference solution runs and is verified
(``Task.reference``, what validation runs) in a fresh sandbox ``--runs`` times against one egress cache
that starts empty: the first run is cold, the rest warm. Printed per run: seconds, verdict, requests,
MB received, MB from outside (not the cache, not a mirror's local files), requests served from the
cache; then warm/cold ratios of the medians (the baseline is the cold run of the same invocation)::

    python -m benchmarks.egress_cache tests/fixtures/real_tasks/terminal-bench/csv-to-parquet --mirror uv --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from envs.taskset import load_taskset
from infra.egress.policy import EgressSummary, Mirror
from infra.egress.proxy import EGRESS_GATEWAY, EgressProxy, EgressSettings
from infra.environments import build_catalog
from infra.sandbox.docker_backend import DockerBackend


def main() -> None:
    """Build the task, then verify its reference solution ``--runs`` times from one cold cache."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", type=Path, help="one task folder (Terminal-Bench or Harbor)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--mirror", action="append", default=[], choices=("uv",))
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    tasks, errors = load_taskset(args.task)
    if errors or len(tasks) != 1:
        raise SystemExit(f"error: {args.task}: expected one task folder ({errors or len(tasks)})")
    (task,) = tasks
    with tempfile.TemporaryDirectory(prefix="agentrl-egress-cache-") as cache:
        proxy = EgressProxy(EGRESS_GATEWAY, EgressSettings(mirrors=tuple(Mirror(k) for k in args.mirror),
                                                           cache_dir=cache))
        backend = DockerBackend(egress=proxy)
        try:
            (entry,), _ = build_catalog(backend, {task.task_id: task}, {task.task_id: "train"}, validate=False)
            if not entry.usable:
                raise SystemExit(f"error: {task.task_id} did not build: {entry.reason}")
            runs = []
            for i in range(args.runs):
                box = backend.start(entry.image, {"agentrl.validate": "egress-bench"}, **task.limits.kwargs())
                t0 = time.perf_counter()
                try:
                    verdict = task.reference(box, True)
                    record = box.egress_record()
                finally:
                    box.close()
                seconds = time.perf_counter() - t0
                total = EgressSummary.of([])
                for phase in record.values():
                    s = EgressSummary(**phase)
                    total.requests += s.requests
                    total.bytes += s.bytes
                    total.upstream_bytes += s.upstream_bytes
                    total.cached += s.cached
                runs.append({"run": "cold" if i == 0 else "warm", "seconds": round(seconds, 1),
                             "verdict": f"{verdict.outcome} ({verdict.reason})", "requests": total.requests,
                             "mb": round(total.bytes / 1e6, 2), "upstream_mb": round(total.upstream_bytes / 1e6, 2),
                             "cached": total.cached})
                r = runs[-1]
                print(f"{r['run']:>4}  {r['seconds']:7.1f} s  {r['verdict']:<28} {r['requests']:4d} requests  "  # noqa: T201
                      f"{r['mb']:8.2f} MB  {r['upstream_mb']:8.2f} MB from outside  {r['cached']:3d} from cache",
                      flush=True)
        finally:
            proxy.close()
    warm = [r for r in runs if r["run"] == "warm"]
    if warm:
        cold = runs[0]
        ratio_s = statistics.median(r["seconds"] for r in warm) / cold["seconds"]
        ratio_b = statistics.median(r["upstream_mb"] for r in warm) / max(cold["upstream_mb"], 1e-9)
        print(f"warm/cold: time {ratio_s:.2f}, upstream bytes {ratio_b:.3f}")  # noqa: T201
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
