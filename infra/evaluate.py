"""Evaluation of a policy version on held-out tasks, with the serving engine and dtype.

pass@k uses the unbiased estimator of Chen et al. 2021 (HumanEval paper, eq. 1):
``pass@k = E_tasks[1 - C(n - c, k) / C(n, k)]`` for ``n`` samples of which ``c`` pass.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task (Chen et al. 2021), computed as a stable product.

    Raises:
        ValueError: not ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def eval_report(rows: list[dict], version: int, engine: str, dtype: str, k: int = 1) -> dict:
    """Summarize evaluation episodes into a report.

    Infra failures (after retries) are counted and left out of a task's samples; a task with no
    valid sample counts as not passed.

    Returns:
        ``{"version", "engine", "dtype", "k", "pass_at_k", "tasks", "infra_failures", "per_task"}``.
    """
    per_task: dict[str, list[bool]] = defaultdict(list)
    infra = 0
    for r in rows:
        if r["outcome"] == "infra_failure":
            infra += 1
            per_task.setdefault(r["task_id"], [])
            continue
        per_task[r["task_id"]].append(r["outcome"] == "success")
    scores = {t: (pass_at_k(len(s), sum(s), min(k, len(s))) if s else 0.0) for t, s in per_task.items()}
    return {
        "version": version, "engine": engine, "dtype": dtype, "k": k,
        f"pass_at_{k}": float(np.mean(list(scores.values()))) if scores else 0.0,
        "tasks": len(scores), "infra_failures": infra,
        "per_task": {t: {"samples": len(per_task[t]), "passed": sum(per_task[t]), "score": s}
                     for t, s in sorted(scores.items())},
    }
