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


class PrecisionMismatch(ValueError):
    """An evaluation asked for a precision other than the serving one, without allowing it."""


def eval_precision(serving_dtype: str, requested: str, allow_mismatch: bool) -> tuple[str, bool]:
    """The dtype to evaluate in, and whether it differs from the serving dtype.

    ``requested`` is ``eval.dtype`` (``"serving"`` or a dtype).

    Raises:
        PrecisionMismatch: ``requested`` differs from ``serving_dtype`` and ``allow_mismatch`` is off.
    """
    dtype = serving_dtype if requested == "serving" else requested
    if dtype != serving_dtype and not allow_mismatch:
        raise PrecisionMismatch(
            f"eval.dtype={dtype} but model.serving_dtype={serving_dtype}: evaluation runs in the serving "
            f"precision; set eval.allow_precision_mismatch = true to evaluate in {dtype} anyway (the report is "
            f"then marked precision_mismatch and stored apart)")
    return dtype, dtype != serving_dtype


def eval_report(rows: list[dict], version: int, engine: str, dtype: str, k: int | list[int] = 1,
                serving_dtype: str | None = None) -> dict:
    """Summarize evaluation episodes into a report.

    Infra failures (after retries) are counted and left out of a task's samples; a task with no
    valid sample counts as not passed. A task with fewer valid samples than k is scored with
    ``k = n`` (its samples all count).

    Returns:
        ``{"version", "engine", "dtype", "serving_dtype", "precision_mismatch", "k", "pass_at_k"
        (str(k) -> mean over tasks), "pass_at_{k}" for each k, "tasks", "samples", "infra_failures",
        "per_task" (task -> samples, passed, pass_at_k)}``.
    """
    ks = [k] if isinstance(k, int) else list(k)
    per_task: dict[str, list[bool]] = defaultdict(list)
    infra = 0
    for r in rows:
        if r["outcome"] == "infra_failure":
            infra += 1
            per_task.setdefault(r["task_id"], [])
            continue
        per_task[r["task_id"]].append(r["outcome"] == "success")
    scores = {t: {str(kk): (pass_at_k(len(s), sum(s), min(kk, len(s))) if s else 0.0) for kk in ks}
              for t, s in per_task.items()}
    means = {str(kk): float(np.mean([v[str(kk)] for v in scores.values()])) if scores else 0.0 for kk in ks}
    serving_dtype = serving_dtype or dtype
    return {
        "version": version, "engine": engine, "dtype": dtype, "serving_dtype": serving_dtype,
        "precision_mismatch": dtype != serving_dtype, "k": ks, "pass_at_k": means,
        **{f"pass_at_{kk}": means[str(kk)] for kk in ks},
        "tasks": len(scores), "samples": sum(len(v) for v in per_task.values()), "infra_failures": infra,
        "per_task": {t: {"samples": len(per_task[t]), "passed": sum(per_task[t]), "pass_at_k": sc}
                     for t, sc in sorted(scores.items())},
    }


def compare_reports(current: dict, previous: dict) -> dict:
    """How ``current`` differs from ``previous`` (an earlier version's report in the same precision).

    Returns:
        ``{"version": previous version, "pass_at_k_delta": str(k) -> current - previous (ks both
        have), "improved"/"regressed": task ids whose pass@(smallest shared k) rose/fell,
        "new_tasks"/"missing_tasks": tasks only in one of the two}``.

    Raises:
        ValueError: the reports differ in precision (comparing across precisions is not a version change).
    """
    if current["dtype"] != previous["dtype"]:
        raise ValueError(f"cannot compare v{current['version']} ({current['dtype']}) with v{previous['version']} "
                         f"({previous['dtype']}): different precisions")
    shared = sorted(set(current["pass_at_k"]) & set(previous["pass_at_k"]), key=int)
    delta = {k: current["pass_at_k"][k] - previous["pass_at_k"][k] for k in shared}
    cur, prev = current["per_task"], previous["per_task"]
    improved, regressed = [], []
    if shared:
        k0 = shared[0]
        for t in sorted(set(cur) & set(prev)):
            a, b = cur[t]["pass_at_k"][k0], prev[t]["pass_at_k"][k0]
            if a > b:
                improved.append(t)
            elif a < b:
                regressed.append(t)
    return {"version": previous["version"], "pass_at_k_delta": delta, "improved": improved, "regressed": regressed,
            "new_tasks": sorted(set(cur) - set(prev)), "missing_tasks": sorted(set(prev) - set(cur))}
