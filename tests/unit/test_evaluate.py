"""pass@k (Chen et al. 2021), the report, comparison across versions, and the precision rule (pure logic)."""

from __future__ import annotations

import itertools
from math import comb

import pytest

from infra.evaluate import PrecisionMismatch, compare_reports, eval_precision, eval_report, pass_at_k


@pytest.mark.parametrize("n,c,k", [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (10, 3, 5), (10, 9, 2), (20, 0, 7)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    # definition: 1 - C(n-c, k) / C(n, k); and by enumeration: the share of k-subsets with a pass
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(3, 4, 1), (3, 1, 4), (3, 1, 0), (3, -1, 1)]:
        with pytest.raises(ValueError, match="need 0 <= c <= n"):
            pass_at_k(n, c, k)


def _rows(task, outcomes):
    return [{"task_id": task, "outcome": o} for o in outcomes]


def test_report_per_task_and_several_k():
    rows = (_rows("a", ["success", "model_failure", "model_failure", "success"])
            + _rows("b", ["model_failure"] * 3 + ["infra_failure"])
            + _rows("c", ["infra_failure"]))
    r = eval_report(rows, version=3, engine="vllm", dtype="float32", k=[1, 2])
    assert r["per_task"]["a"] == {"samples": 4, "passed": 2, "pass_at_k": {"1": 0.5, "2": pytest.approx(5 / 6)}}
    assert r["per_task"]["b"]["samples"] == 3 and r["per_task"]["b"]["pass_at_k"] == {"1": 0.0, "2": 0.0}
    assert r["per_task"]["c"] == {"samples": 0, "passed": 0, "pass_at_k": {"1": 0.0, "2": 0.0}}
    assert r["pass_at_1"] == pytest.approx(0.5 / 3) and r["pass_at_k"]["2"] == pytest.approx(5 / 18)
    assert (r["tasks"], r["samples"], r["infra_failures"], r["precision_mismatch"]) == (3, 7, 2, False)
    marked = eval_report(rows, version=3, engine="vllm", dtype="bfloat16", k=1, serving_dtype="float32")
    assert marked["precision_mismatch"] is True and marked["serving_dtype"] == "float32"


def test_compare_with_previous_version():
    old = eval_report(_rows("a", ["model_failure"]) + _rows("b", ["success"]) + _rows("c", ["success"]),
                      1, "vllm", "float32")
    new = eval_report(_rows("a", ["success"]) + _rows("b", ["model_failure"]) + _rows("d", ["success"]),
                      2, "vllm", "float32")
    cmp = compare_reports(new, old)
    assert cmp["version"] == 1 and cmp["pass_at_k_delta"]["1"] == pytest.approx(2 / 3 - 2 / 3)
    assert (cmp["improved"], cmp["regressed"], cmp["new_tasks"], cmp["missing_tasks"]) == (["a"], ["b"], ["d"], ["c"])
    with pytest.raises(ValueError, match="different precisions"):
        compare_reports(new, eval_report([], 1, "vllm", "bfloat16"))


def test_precision_other_than_serving_is_refused_unless_allowed():
    assert eval_precision("float32", "serving", False) == ("float32", False)
    assert eval_precision("bfloat16", "bfloat16", False) == ("bfloat16", False)
    with pytest.raises(PrecisionMismatch, match="eval.dtype=bfloat16 but model.serving_dtype=float32"):
        eval_precision("float32", "bfloat16", False)
    assert eval_precision("float32", "bfloat16", True) == ("bfloat16", True)


def test_per_task_rows_against_the_previous_version():
    from tasks.evaluate import per_task_rows

    report = {"version": 2, "per_task": {"tb/make-dir": {"samples": 4, "passed": 3, "pass_at_k": {"1": 0.75}},
                                         "humaneval/HumanEval/163": {"samples": 4, "passed": 0,
                                                                     "pass_at_k": {"1": 0.0}}}}
    previous = {"version": 1, "per_task": {"tb/make-dir": {"samples": 4, "passed": 1, "pass_at_k": {"1": 0.25}}}}
    assert per_task_rows(report, previous) == [
        {"task": "humaneval/HumanEval/163", "samples": 4, "passed": 0, "pass@1": 0.0, "v1 pass@1": "new",
         "change pass@1": ""},
        {"task": "tb/make-dir", "samples": 4, "passed": 3, "pass@1": 0.75, "v1 pass@1": 0.25,
         "change pass@1": "+0.500"}]
    assert per_task_rows(report)[1] == {"task": "tb/make-dir", "samples": 4, "passed": 3, "pass@1": 0.75}
