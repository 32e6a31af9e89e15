"""Task selection from pass rates."""

from __future__ import annotations

from infra.difficulty import pass_stats, select_tasks


def _records(task, outcomes, step0=0):
    return [(task, step0 + i, 1.0 if o == "success" else 0.0, o) for i, o in enumerate(outcomes)]


def test_stats_ignore_infra_failures_and_use_recent_window():
    recs = _records("a", ["model_failure"] * 6 + ["success"] * 4 + ["infra_failure"] * 3)
    s = pass_stats(recs, window=4)["a"]
    assert (s.attempts, s.passes, s.recent_attempts, s.recent_passes) == (10, 4, 4, 4)


def test_saturated_and_hopeless_skipped_new_tasks_explored():
    recs = (_records("sat", ["success"] * 8) + _records("hope", ["model_failure"] * 20)
            + _records("mid", ["success", "model_failure"] * 4) + _records("rare", ["model_failure"]))
    stats = pass_stats(recs, window=8)
    sel = select_tasks(["sat", "hope", "mid", "rare", "new"], stats, count=10, window=8,
                       hopeless_min_attempts=16, explore_min_attempts=4, seed=0)
    assert sel.skipped == {"sat": "saturated", "hope": "hopeless"}
    # rarely tried and new tasks come first (exploration floor), then by p(1-p)
    assert set(sel.chosen[:2]) == {"rare", "new"} and sel.chosen[2] == "mid"


def test_count_and_seed_determinism():
    ids = [f"t{i}" for i in range(10)]
    a = select_tasks(ids, {}, 3, 8, 16, 4, seed=1)
    b = select_tasks(ids, {}, 3, 8, 16, 4, seed=1)
    assert a.chosen == b.chosen and len(a.chosen) == 3


def test_all_skipped_falls_back_rather_than_empty_step():
    stats = pass_stats(_records("sat", ["success"] * 8), window=8)
    sel = select_tasks(["sat"], stats, 2, 8, 16, 4, seed=0)
    assert sel.chosen == ["sat"]


def test_skipped_tasks_are_revisited_oldest_first_at_the_configured_share():
    # "old" was last attempted at step 7, "recent" at step 47: both skipped as saturated/hopeless
    recs = (_records("old", ["success"] * 8) + _records("recent", ["model_failure"] * 20, step0=28)
            + [r for i in range(12) for r in _records(f"mid{i}", ["success", "model_failure"] * 4)])
    stats = pass_stats(recs, window=8)
    ids = ["old", "recent"] + [f"mid{i}" for i in range(12)]
    args = dict(count=10, window=8, hopeless_min_attempts=16, explore_min_attempts=4)
    sel = select_tasks(ids, stats, seed=0, revisit_frac=0.1, **args)
    assert sel.revisited == ["old"] and sel.chosen[0] == "old" and len(sel.chosen) == 10
    assert sel.skipped == {"recent": "hopeless"}
    two = select_tasks(ids, stats, seed=0, revisit_frac=0.2, **args)
    assert two.revisited == ["old", "recent"] and two.skipped == {}
    # without revisiting, no skipped task is chosen
    none = select_tasks(ids, stats, seed=0, revisit_frac=0.0, **args)
    assert none.revisited == [] and not {"old", "recent"} & set(none.chosen)
    # a fractional share is kept in expectation over steps: 4 slots * 0.1 = 0.4 revisits per step
    n = sum(len(select_tasks(ids, stats, seed=s, revisit_frac=0.1, **{**args, "count": 4}).revisited)
            for s in range(2000))
    assert 0.36 < n / 2000 < 0.44


def test_revisit_frac_out_of_range_is_refused():
    import pytest

    with pytest.raises(ValueError, match="revisit_frac"):
        select_tasks(["a"], {}, 1, 8, 16, 4, seed=0, revisit_frac=1.5)


def test_pool_rows_say_why_each_task_was_skipped():
    from infra.difficulty import pass_stats, select_tasks
    from infra.summary import Selection
    from tasks.difficulty import pool_rows

    records = [("a", s, 1.0, "success") for s in range(8)] + [("b", s, 0.0, "model_failure") for s in range(8)]
    stats = pass_stats(records, 4)
    sel = select_tasks(["a", "b", "c"], stats, 2, 4, 100, 2, seed=0)
    rows = pool_rows(["a", "b", "c"], stats, Selection(sel.chosen, sel.skipped, sel.revisited, {}))
    assert rows[0] == {"task": "a", "attempts": 8, "pass rate": 1.0, "this step": f"skipped: {sel.skipped['a']}"}
    assert rows[2] == {"task": "c", "attempts": 0, "pass rate": "untried", "this step": "chosen"}
    assert rows[1]["this step"] == "chosen"  # 8 failures, below hopeless_min_attempts=100: still eligible
