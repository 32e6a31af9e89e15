"""Scheduling logic of the asynchronous collector (pure logic: a scripted runner, no engine, no sandbox)."""

from __future__ import annotations

import threading
import time

import pytest

from infra.rollout.scheduler import AsyncCollector, Attempt, EpisodeJob, Group, ReadyBank


class ScriptedRunner:
    """Each task is a dict: ``seconds`` per member (a list: by sample index), optional ``fail`` (sample,
    attempt) pairs, ``stuck`` members.

    A turn stamps ``collector.policy_version`` on its tokens, like an engine stamping its weights' version.
    """

    def __init__(self):
        self.collector: AsyncCollector | None = None
        self.started: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def run(self, job: EpisodeJob) -> dict:
        with self.lock:
            self.started.append((job.group_id, job.sample_index, job.attempt))
        spec = job.task
        versions = []
        turns = spec.get("turns", 1)
        for _ in range(turns):
            if (job.sample_index, job.attempt) in spec.get("stuck", ()):
                job.cancel.wait(30)
                return self.failed_row(job, "cancelled")
            seconds = spec["seconds"][job.sample_index] if isinstance(spec["seconds"], list) else spec["seconds"]
            if job.cancel.wait(seconds / turns):
                return self.failed_row(job, "cancelled")
            versions.append(self.collector.policy_version)
        if (job.sample_index, job.attempt) in spec.get("fail", ()):
            return self.failed_row(job, "container_vanished")
        return {"group_id": job.group_id, "sample_index": job.sample_index, "attempt": job.attempt,
                "outcome": "success", "reason": "tests_passed", "reward": spec.get("reward", 1.0),
                "policy_versions": versions,
                "min_policy_version": min(versions), "max_policy_version": max(versions)}

    def failed_row(self, job: EpisodeJob, reason: str) -> dict:
        return {"group_id": job.group_id, "sample_index": job.sample_index, "attempt": job.attempt,
                "outcome": "infra_failure", "reason": reason, "policy_versions": [],
                "min_policy_version": -1, "max_policy_version": -1}


def _collector(**kw) -> tuple[AsyncCollector, ScriptedRunner]:
    runner = ScriptedRunner()
    args = {"group_size": 2, "max_groups_in_flight": 4, "max_concurrent_episodes": 16, "episode_deadline_s": 10.0}
    c = AsyncCollector(runner, **{**args, **kw})
    runner.collector = c
    return c, runner


def test_group_launched_first_finishing_last_does_not_block_the_batch():
    c, _ = _collector()
    try:
        c.submit([("slow", {"seconds": 2.0}), ("a", {"seconds": 0.05}), ("b", {"seconds": 0.1})])
        batch = c.next_batch(2, timeout_s=10)
        assert [g.group_id for g in batch.groups] == ["a", "b"]
        assert batch.metrics["time_to_batch_s"] < 1.5  # did not wait for the slow group
        assert c.in_flight == 1  # the slow one carries on and serves the next batch
        nxt = c.next_batch(1, timeout_s=10)
        assert [g.group_id for g in nxt.groups] == ["slow"] and len(nxt.train_rows()) == 2
    finally:
        c.close()


def test_launch_order_baseline_waits_for_the_first_group():
    c, _ = _collector(in_launch_order=True, prefetch=False, max_groups_in_flight=2)
    try:
        c.submit([("slow", {"seconds": 0.6}), ("a", {"seconds": 0.05})])
        batch = c.next_batch(2, timeout_s=10)
        assert [g.group_id for g in batch.groups] == ["slow", "a"]
        assert batch.metrics["time_to_batch_s"] >= 0.55
        c.submit([("b", {"seconds": 0.05})])
        time.sleep(0.2)
        assert c.in_flight == 0 and c.pending == 1  # no prefetch: nothing launches between batches
    finally:
        c.close()


def test_surplus_groups_carry_over_to_the_next_batch():
    c, _ = _collector(max_groups_in_flight=6)
    try:
        c.submit([(f"g{i}", {"seconds": 0.05}) for i in range(6)])
        first = c.next_batch(2, timeout_s=10)
        time.sleep(0.3)  # the other four finish while the trainer would train
        second = c.next_batch(4, timeout_s=10)
        assert second.metrics["groups_carried_in"] == 4
        assert {g.group_id for g in first.groups} | {g.group_id for g in second.groups} == {f"g{i}" for i in range(6)}
    finally:
        c.close()


def test_lag_bound_drops_stale_groups_and_histograms_the_rest():
    bank = ReadyBank(max_policy_lag=1)
    for gid, version in [("v0", 0), ("v1", 1), ("v2", 2)]:
        g = Group(gid, None, 0, 1, 0.0)
        g.final[0] = Attempt({"min_policy_version": version}, 0.0, 0.0)
        bank.put(g)
    taken = bank.take(3, current_version=2)
    assert [g.group_id for g in taken] == ["v1", "v2"]
    assert [g.group_id for g in bank.dropped_stale] == ["v0"] and bank.dropped_stale[0].dropped == "stale"
    with pytest.raises(ValueError, match="not complete"):
        bank.put(Group("x", None, 0, 2, 0.0))


def test_mean_token_lag_bound_keeps_long_episodes_whose_tokens_are_mostly_recent():
    """Partial rollouts: an episode begun 3 versions ago whose tokens are mostly recent trains under a mean
    bound of 1 (its oldest token is past ``max_policy_lag = 1``, which alone would drop it); one whose
    tokens are mostly old does not. Rows count tokens as the store's (``policy_versions`` where
    ``loss_mask``) or as the simulator's (``tokens_by_version``)."""
    def group(gid: str, oldest: int, row: dict) -> Group:
        g = Group(gid, None, 0, 1, 0.0)
        g.final[0] = Attempt({"min_policy_version": oldest, **row}, 0.0, 0.0)
        return g

    long_recent = group("long", 0, {"tokens_by_version": {0: 100, 2: 300, 3: 600}})  # mean lag 0.6, oldest 3
    long_old = group("old", 1, {"tokens_by_version": {1: 900, 3: 100}})  # mean lag 1.8, oldest 2
    fresh = group("fresh", 3, {"tokens_by_version": {3: 10}})
    stored = group("stored", 2, {"policy_versions": [-1, 2, 2, 3], "loss_mask": [0, 1, 1, 1]})  # prompt: not sampled
    assert long_recent.mean_token_lag(3) == pytest.approx(0.6) and long_old.mean_token_lag(3) == pytest.approx(1.8)
    assert stored.mean_token_lag(3) == pytest.approx(2 / 3)
    bank = ReadyBank(max_policy_lag=3, max_mean_token_lag=1.0)
    for g in (long_recent, long_old, fresh, stored):
        bank.put(g)
    assert [g.group_id for g in bank.take(4, current_version=3)] == ["long", "fresh", "stored"]
    assert [g.group_id for g in bank.dropped_stale] == ["old"]
    only_oldest = ReadyBank(max_policy_lag=1)  # the old rule: the oldest token decides
    for g in (long_recent, fresh):
        only_oldest.put(g)
    assert [g.group_id for g in only_oldest.take(2, current_version=3)] == ["fresh"]
    with pytest.raises(ValueError, match="max_mean_token_lag"):
        ReadyBank(1, -0.5)


def test_split_parts_a_group_into_its_finished_samples_and_the_running_remainder():
    """Hand-built: 2 of 4 finished (sample 1 after a failed attempt); the part holds them and their attempts,
    the remainder the other two samples and their earlier failure, and completes on their rows alone."""
    g = Group("g", None, 3, 4, 0.0)
    fail = Attempt({"sample_index": 1, "outcome": "infra_failure"}, 1.0, 1.0)
    ok = {i: Attempt({"sample_index": i, "outcome": "success", "min_policy_version": 0}, 2.0, 2.0) for i in (0, 1)}
    fail3 = Attempt({"sample_index": 3, "outcome": "infra_failure"}, 1.5, 1.5)
    g.attempts = [fail, ok[0], fail3, ok[1]]
    g.final = dict(ok)
    part = g.split(now_s=5.0)
    assert (part.group_id, part.group_size, part.complete, part.part, part.completed_s) == ("g", 2, True, 0, 5.0)
    assert part.attempts == [fail, ok[0], ok[1]] and [r["sample_index"] for r in part.final_rows()] == [0, 1]
    assert (g.group_size, g.complete, g.part, g.attempts, g.final) == (2, False, 1, [fail3], {})
    for i in (2, 3):
        g.final[i] = Attempt({"sample_index": i, "outcome": "success", "min_policy_version": 1}, 9.0, 9.0)
    assert g.complete and [r["sample_index"] for r in g.final_rows()] == [2, 3]
    with pytest.raises(ValueError, match="some, not all"):
        g.split(now_s=10.0)


def test_partial_groups_train_finished_samples_and_carry_the_rest():
    """G=4, k=2: two groups each hold two slow samples. A batch of 1 group (4 samples) waits for b's second
    sample (a's 2 are not enough), then takes the finished samples of both (4 rows; the slow ones carried),
    and the next batch gets the carried samples as parts of their own (short: nothing else in flight)."""
    c, _ = _collector(group_size=4, partial_group_min_samples=2)
    try:
        c.submit([("a", {"seconds": [0.05, 0.05, 1.5, 1.5]}), ("b", {"seconds": [0.3, 0.3, 1.5, 1.5]})])
        batch = c.next_batch(1, timeout_s=10)
        assert [(g.group_id, g.part, len(g.final)) for g in batch.groups] == [("a", 0, 2), ("b", 0, 2)]
        assert {r["sample_index"] for r in batch.train_rows()} == {0, 1}
        m = batch.metrics
        assert (m["groups_split"], m["samples_carried"], m["remainder_parts"], m["batch_samples"]) == (2, 4, 0, 4)
        assert m["remainders_cancelled"] == 0
        assert c.in_flight == 2 and c.room() == 4 - 1  # the four carried samples weigh one group of 4
        deadline = time.monotonic() + 10
        while c.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.in_flight == 0 and c.room() == 4 - 1  # banked, the two parts still weigh one group
        rest = c.next_batch(1, timeout_s=10)
        assert sorted((g.group_id, g.part) for g in rest.groups) == [("a", 1), ("b", 1)]
        assert sorted(r["sample_index"] for r in rest.train_rows()) == [2, 2, 3, 3]
        m = rest.metrics
        assert (m["groups_split"], m["remainder_parts"], m["batch_samples"]) == (0, 2, 4)
    finally:
        c.close()


def test_a_split_that_would_leave_one_running_sample_cancels_it():
    """G=4, k=3: a part of one sample has no GRPO signal, so the last running sample is cancelled, not carried."""
    c, _ = _collector(group_size=4, partial_group_min_samples=3)
    try:
        c.submit([("a", {"seconds": [0.05, 0.05, 0.05, 5.0]}), ("b", {"seconds": [0.3, 0.3, 0.3, 5.0]})])
        batch = c.next_batch(1, timeout_s=10)  # 4 samples: a's 3 are not enough, b's 3 finish it
        assert [(g.group_id, g.part, len(g.final)) for g in batch.groups] == [("a", 0, 3), ("b", 0, 3)]
        m = batch.metrics
        assert (m["groups_split"], m["samples_carried"], m["remainders_cancelled"]) == (2, 0, 2)
        assert c.in_flight == 0 and c.room() == 4  # nothing held for it: not in flight, not banked
        time.sleep(0.3)  # its cancelled attempt returns (ScriptedRunner honours cancel) and is ignored
        assert c.in_flight == 0 and len(c.bank) == 0
    finally:
        c.close()


def test_partial_groups_prefer_complete_groups_and_never_split_below_k():
    """A complete banked group fills the batch before any split; a group with fewer than k finished is not split."""
    c, _ = _collector(group_size=4, partial_group_min_samples=3, max_groups_in_flight=2)
    try:
        c.submit([("slow", {"seconds": [0.05, 0.05, 2.0, 2.0]}), ("fast", {"seconds": 0.3})])
        batch = c.next_batch(1, timeout_s=10)
        assert [(g.group_id, len(g.final)) for g in batch.groups] == [("fast", 4)]
        assert batch.metrics["groups_split"] == 0
        assert c.in_flight == 1  # "slow" had 2 < 3 finished: whole, still running
    finally:
        c.close()
    with pytest.raises(ValueError, match="partial_group_min_samples"):
        _collector(group_size=4, partial_group_min_samples=4)
    with pytest.raises(ValueError, match="dynamic_sampling"):
        _collector(group_size=4, partial_group_min_samples=2, dynamic_sampling=True)


def test_a_batch_reports_its_tokens_mean_and_max_lag():
    c, _ = _collector(max_policy_lag=2, max_mean_token_lag=1.0)
    try:
        c.submit([("a", {"seconds": 0.05})])
        time.sleep(0.3)  # complete at version 0
        c.update_weights(lambda: None, 1)
        c.submit([("b", {"seconds": 0.05})])
        batch = c.next_batch(2, timeout_s=10)
        assert sorted(g.group_id for g in batch.groups) == ["a", "b"]
        assert batch.metrics["sample_lag_mean"] == pytest.approx(0.5) and batch.metrics["sample_lag_max"] == 1
    finally:
        c.close()


def test_collector_never_hands_out_groups_beyond_the_lag_bound():
    c, _ = _collector(max_policy_lag=1)
    try:
        c.submit([("old", {"seconds": 0.05, "reward": 0.25})])
        time.sleep(0.3)  # complete at version 0, banked
        c.update_weights(lambda: None, 1)
        c.update_weights(lambda: None, 2)  # "old" is now 2 versions behind
        c.submit([("new", {"seconds": 0.05})])
        batch = c.next_batch(1, timeout_s=10)
        assert [g.group_id for g in batch.groups] == ["new"]
        assert batch.metrics["dropped_stale"] == 1 and batch.metrics["lag_hist_0"] == 1
        assert batch.metrics["dropped_stale_samples"] == 2 and batch.metrics["dropped_stale_reward_mean"] == 0.25
        c.submit([("next", {"seconds": 0.05})])
        nothing_cut = c.next_batch(1, timeout_s=10).metrics
        assert nothing_cut["dropped_stale_samples"] == 0 and "dropped_stale_reward_mean" not in nothing_cut
    finally:
        c.close()


def test_stuck_sibling_is_cancelled_at_its_deadline_and_retried():
    c, runner = _collector(episode_deadline_s=0.3, infra_policy="retry", max_infra_retries=1)
    try:
        c.submit([("g", {"seconds": 0.05, "stuck": [(1, 0)]})])
        batch = c.next_batch(1, timeout_s=10)
        rows = batch.rows
        assert sorted((r["sample_index"], r["attempt"], r["outcome"]) for r in rows) == [
            (0, 0, "success"), (1, 0, "infra_failure"), (1, 1, "success")]
        assert [r["reason"] for r in rows if r["outcome"] == "infra_failure"] == ["episode_deadline"]
        assert batch.metrics["deadline_cancels"] == 1 and batch.metrics["infra_retries"] == 1
    finally:
        c.close()


def test_drop_policy_drops_the_group_and_another_fills_the_batch():
    c, _ = _collector(infra_policy="drop", max_groups_in_flight=2)
    try:
        c.submit([("bad", {"seconds": 0.05, "fail": [(0, 0)]}), ("ok", {"seconds": 0.1}), ("ok2", {"seconds": 0.1})])
        batch = c.next_batch(2, timeout_s=10)
        assert sorted(g.group_id for g in batch.groups) == ["ok", "ok2"]
        assert batch.metrics["dropped_infra"] == 1
    finally:
        c.close()


def test_retries_exhausted_drop_the_group():
    c, _ = _collector(infra_policy="retry", max_infra_retries=1)
    try:
        c.submit([("bad", {"seconds": 0.02, "fail": [(0, 0), (0, 1)]})])
        with pytest.raises(RuntimeError, match="impossible.*bad: infra_failure:container_vanished"):
            c.next_batch(1, timeout_s=10)
        assert c.counters["dropped_infra"] == 1 and c.counters["infra_retries"] == 1
        c.submit([("bad2", {"seconds": 0.02, "fail": [(0, 0), (0, 1)]}), ("ok", {"seconds": 0.02})])
        short = c.next_batch(2, timeout_s=10)  # one group can never come: the batch is short, not failed
        assert [g.group_id for g in short.groups] == ["ok"] and short.metrics["short_batches"] == 1
        assert [g.group_id for g in short.dropped] == ["bad", "bad2"]  # dropped groups are reported once, with rows
    finally:
        c.close()


@pytest.mark.parametrize("policy", ["pause", "finish", "abort"])
def test_update_policies_and_per_token_versions(policy):
    c, runner = _collector(update_policy=policy, max_policy_lag=1)
    try:
        c.submit([("g", {"seconds": 0.6, "turns": 3})])
        time.sleep(0.3)  # mid-trajectory: one turn done on version 0
        c.update_weights(lambda: time.sleep(0.05), 1)
        rows = c.next_batch(1, timeout_s=10).train_rows()
        versions = [r["policy_versions"] for r in rows]
        if policy == "pause":  # continued on the new weights: the versions say which turn was which
            assert all(v[0] == 0 and v[-1] == 1 for v in versions)
        elif policy == "finish":  # the update waited for them: all on version 0
            assert all(v == [0, 0, 0] for v in versions)
        else:  # aborted and relaunched from scratch on version 1
            assert all(v == [1, 1, 1] for v in versions)
            assert c.counters["aborted_for_update"] == 2
            assert sum(1 for s in runner.started if s[0] == "g") == 4
    finally:
        c.close()


def test_timeout_keeps_groups_banked():
    c, _ = _collector()
    try:
        c.submit([("fast", {"seconds": 0.02}), ("slow", {"seconds": 1.0})])
        with pytest.raises(TimeoutError):
            c.next_batch(2, timeout_s=0.3)
        batch = c.next_batch(2, timeout_s=10)
        assert sorted(g.group_id for g in batch.groups) == ["fast", "slow"]
    finally:
        c.close()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="update_policy"):
        AsyncCollector(ScriptedRunner(), group_size=2, max_groups_in_flight=2, max_concurrent_episodes=2,
                       update_policy="later")
    with pytest.raises(ValueError, match="max_policy_lag"):
        ReadyBank(-1)


def test_a_slow_progress_callback_does_not_turn_a_ready_group_into_a_failed_batch():
    c, _ = _collector(max_groups_in_flight=1)
    try:
        c.submit([("g", {"seconds": 0.05})])
        batch = c.next_batch(1, timeout_s=5, on_progress=lambda ready, n: time.sleep(0.3))  # an API round trip
        assert [g.group_id for g in batch.groups] == ["g"] and batch.metrics["short_batches"] == 0
    finally:
        c.close()


def test_results_that_arrive_during_a_reload_are_not_deadline_victims():
    c, _ = _collector(update_policy="pause", episode_deadline_s=0.3, infra_policy="drop")
    try:
        c.submit([("g", {"seconds": 0.1})])
        time.sleep(0.02)
        c.update_weights(lambda: time.sleep(0.5), 1)  # a slow reload while both siblings finish
        batch = c.next_batch(1, timeout_s=5)
        assert [(r["outcome"], r["attempt"]) for r in batch.rows] == [("success", 0), ("success", 0)]
        assert batch.metrics["deadline_cancels"] == 0
    finally:
        c.close()


@pytest.mark.parametrize("policy", ["abort", "finish", "pause"])
def test_a_failed_reload_leaves_the_collector_working(policy):
    c, _ = _collector(update_policy=policy, max_groups_in_flight=1)
    try:
        c.submit([("g", {"seconds": 0.4}), ("h", {"seconds": 0.05})])
        time.sleep(0.1)

        def boom():
            raise OSError("reload failed")

        with pytest.raises(OSError):
            c.update_weights(boom, 1)
        assert c.policy_version == 0  # not applied
        batch = c.next_batch(2, timeout_s=5)
        assert sorted(g.group_id for g in batch.groups) == ["g", "h"]
    finally:
        c.close()


def test_drop_counts_are_per_batch():
    c, _ = _collector(infra_policy="drop", max_groups_in_flight=2)
    try:
        c.submit([("bad", {"seconds": 0.02, "fail": [(0, 0)]}), ("ok", {"seconds": 0.05})])
        first = c.next_batch(1, timeout_s=5)
        c.submit([("ok2", {"seconds": 0.05})])
        second = c.next_batch(1, timeout_s=5)
        assert (first.metrics["dropped_infra"], second.metrics["dropped_infra"]) == (1, 0)
    finally:
        c.close()
