"""Dynamic sampling in the asynchronous collector (DAPO, Yu et al. 2025): zero-variance groups skipped, bounded.

Every group's siblings are held until the test releases the whole group, after setting the manual clock,
so the completion order and every completion time are known. Times in comments (``t = 2``) count from
the clock's start ``T0``. A group's task is its rewards, one per sample: ``[1, 1]`` (accuracy 1) and
``[0, 0]`` (accuracy 0) have zero variance, ``[0, 1]`` has signal.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from infra.config import AsyncScheduler, RolloutConfig, RunConfig
from infra.rollout.scheduler import UNTRAINED_OUTCOMES, AsyncCollector, Attempt, EpisodeJob, Group
from infra.run import Run
from tests.fakes import ManualClock

T0 = ManualClock()()
WAIT_S = 5.0  # wall-clock guard against a hang; never reached when the tests pass
ZERO, ONE, MIXED = [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]


class GroupGatedRunner:
    """Every sibling of group ``g`` runs until ``release(g)``; its row's ``reward`` is ``task[sample_index]``.

    A task of ``None`` gives rows without a ``reward``. A row's min/max policy version is the collector's at
    the attempt's launch/finish (as if it sampled its first token at launch and its last at the finish).
    """

    def __init__(self):
        self.collector: AsyncCollector | None = None
        self._lock = threading.Lock()
        self._gates: dict[str, threading.Event] = {}

    def _gate(self, group_id: str) -> threading.Event:
        with self._lock:
            return self._gates.setdefault(group_id, threading.Event())

    def release(self, group_id: str) -> None:
        self._gate(group_id).set()

    def run(self, job: EpisodeJob) -> dict:
        gate, v0 = self._gate(job.group_id), self.collector.policy_version
        while not gate.wait(0.005):
            if job.cancel.is_set():
                return self.failed_row(job, "cancelled")
        v = self.collector.policy_version
        row = {"group_id": job.group_id, "sample_index": job.sample_index, "attempt": job.attempt,
               "outcome": "success", "reason": "tests_passed", "min_policy_version": v0, "max_policy_version": v}
        if job.task is not None:
            row["reward"] = job.task[job.sample_index]
        return row

    def failed_row(self, job: EpisodeJob, reason: str) -> dict:
        return {"group_id": job.group_id, "sample_index": job.sample_index, "attempt": job.attempt,
                "outcome": "infra_failure", "reason": reason, "min_policy_version": -1, "max_policy_version": -1}


def wait_until(condition) -> None:
    """Poll ``condition`` on wall time, up to ``WAIT_S``."""
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("condition never held")


class Bench:
    """A collector on a manual clock and a gated runner; groups released one by one at set times."""

    def __init__(self, **kw):
        self.clock, self.runner = ManualClock(), GroupGatedRunner()
        args = {"group_size": 2, "max_groups_in_flight": 8, "max_concurrent_episodes": 32, "episode_deadline_s": 1e6}
        self.c = AsyncCollector(self.runner, clock=self.clock, **{**args, **kw})
        self.runner.collector = self.c

    def finish(self, group_id: str, at: float) -> None:
        """Complete ``group_id`` at ``t = at`` and wait until it is banked (every group launched, none pending)."""
        assert self.c.pending == 0
        in_flight = self.c.in_flight
        self.clock.advance(T0 + at - self.clock())
        self.runner.release(group_id)
        wait_until(lambda: self.c.in_flight == in_flight - 1)

    def next_batch(self, n: int, **kw) -> Future:
        """``c.next_batch(n)`` on a thread; returns once the call has read its start time (its first progress)."""
        future: Future = Future()
        asked = threading.Event()

        def call():
            try:
                future.set_result(self.c.next_batch(n, on_progress=lambda ready, want: asked.set(), **kw))
            except BaseException as e:  # noqa: BLE001 - handed to the test through the future
                future.set_exception(e)
            asked.set()

        threading.Thread(target=call, daemon=True).start()
        assert asked.wait(WAIT_S)
        return future


@pytest.fixture
def bench():
    made: list[Bench] = []

    def make(**kw) -> Bench:
        made.append(Bench(**kw))
        return made[-1]

    yield make
    for b in made:
        b.c.close()


def ids(groups: list[Group]) -> list[str]:
    return [g.group_id for g in groups]


def test_off_zero_variance_groups_are_trained_in_completion_order(bench):
    b = bench()  # dynamic_sampling off (the default)
    b.c.submit([("one", ONE), ("zero", ZERO), ("mixed", MIXED)])
    for t, g in enumerate(["one", "zero", "mixed"], start=1):
        b.finish(g, float(t))
    batch = b.next_batch(2).result(WAIT_S)
    assert ids(batch.groups) == ["one", "zero"] and batch.dropped == []  # the group with signal waits its turn
    assert "groups_skipped_zero_variance" not in batch.metrics  # the metrics are as before too


def test_on_zero_variance_groups_are_skipped_until_the_batch_has_signal(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=4)
    b.c.submit([("one", ONE), ("mixed", MIXED), ("zero", ZERO), ("mixed2", MIXED)])
    waiting = b.next_batch(2)  # asked at t = 0
    b.finish("one", 1.0)
    b.finish("mixed", 2.0)  # without the filter the batch (one, mixed) would be full at t = 2
    b.finish("zero", 3.0)
    threading.Event().wait(0.2)  # the scheduler has seen every completion: one group with signal is not enough
    assert not waiting.done()
    b.finish("mixed2", 5.0)
    batch = waiting.result(WAIT_S)
    assert ids(batch.groups) == ["mixed", "mixed2"]
    assert [(g.group_id, g.dropped) for g in batch.dropped] == [("one", "zero_variance"), ("zero", "zero_variance")]
    assert {r["group_id"] for r in batch.rows} == {"mixed", "mixed2"}  # the trajectory file: trained rows only
    assert [r["reward"] for g in batch.dropped for r in g.rows] == ONE + ZERO  # skipped rows kept, as dropped
    m = batch.metrics
    assert (m["groups_skipped_zero_variance"], m["groups_filled_zero_variance"]) == (2, 0)
    assert m["zero_variance_wait_s"] == 5.0 - 2.0  # returned at t = 5, the unfiltered batch was full at t = 2
    assert m["time_to_batch_s"] == 5.0 and b.c.counters["skipped_zero_variance"] == 2


def test_no_wait_is_charged_when_the_filter_did_not_delay_the_batch(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=4)
    b.c.submit([("mixed", MIXED), ("zero", ZERO), ("mixed2", MIXED)])
    for t, g in enumerate(["mixed", "zero", "mixed2"], start=1):
        b.finish(g, float(t))  # all banked before the call (t = 3): as complete at the call
    batch = b.next_batch(2).result(WAIT_S)
    assert ids(batch.groups) == ["mixed", "mixed2"] and ids(batch.dropped) == ["zero"]
    assert batch.metrics["zero_variance_wait_s"] == 0.0


def test_the_bound_reached_fills_the_batch_instead_of_waiting(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=1)
    b.c.submit([("one", ONE), ("zero", ZERO), ("mixed", MIXED), ("never", MIXED)])
    waiting = b.next_batch(2)
    b.finish("one", 1.0)
    b.finish("zero", 2.0)  # two zero-variance groups: one may be skipped, the other counts
    threading.Event().wait(0.2)
    assert not waiting.done()
    b.finish("mixed", 3.0)  # "never" stays in flight: the batch must not wait for it
    batch = waiting.result(WAIT_S)
    assert ids(batch.groups) == ["zero", "mixed"]  # completion order; the first zero-variance one was skipped
    assert [(g.group_id, g.dropped) for g in batch.dropped] == [("one", "zero_variance")]
    m = batch.metrics
    assert (m["groups_skipped_zero_variance"], m["groups_filled_zero_variance"]) == (1, 1)
    assert m["zero_variance_wait_s"] == 3.0 - 2.0 and b.c.in_flight == 1


def test_when_nothing_more_can_come_zero_variance_groups_fill_the_batch(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=10)
    b.c.submit([("zero", ZERO), ("mixed", MIXED)])
    waiting = b.next_batch(2)
    b.finish("zero", 1.0)
    b.finish("mixed", 2.0)  # nothing pending or in flight now, far below the bound
    batch = waiting.result(WAIT_S)
    assert ids(batch.groups) == ["zero", "mixed"] and batch.dropped == []
    m = batch.metrics
    assert (m["groups_skipped_zero_variance"], m["groups_filled_zero_variance"], m["short_batches"]) == (0, 1, 0)
    assert m["zero_variance_wait_s"] == 0.0  # the unfiltered batch was also full at t = 2


def test_surplus_groups_carry_over_and_skips_beyond_the_bound_wait_for_the_next_batch(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=1)
    order = [("zero", ZERO), ("mixed", MIXED), ("one", ONE), ("mixed2", MIXED), ("mixed3", MIXED)]
    b.c.submit(order)
    for t, (g, _) in enumerate(order, start=1):
        b.finish(g, float(t))
    first = b.next_batch(2).result(WAIT_S)
    assert ids(first.groups) == ["mixed", "mixed2"] and ids(first.dropped) == ["zero"]  # one skip allowed
    assert first.metrics["groups_in_bank"] == 2  # "one" and "mixed3" stay banked
    second = b.next_batch(1).result(WAIT_S)
    assert ids(second.groups) == ["mixed3"] and ids(second.dropped) == ["one"]
    assert second.metrics["groups_carried_in"] == 1 and second.metrics["groups_skipped_zero_variance"] == 1


def test_stale_groups_are_dropped_as_stale_not_skipped_or_trained(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=4, max_policy_lag=0)
    b.c.submit([("old_mixed", MIXED), ("old_one", ONE), ("straddling", MIXED)])
    b.finish("old_mixed", 1.0)
    b.finish("old_one", 2.0)  # both sampled by version 0
    b.c.update_weights(lambda: None, 1)  # lag 1 > 0: both stale now
    b.c.submit([("new_one", ONE), ("new_mixed", MIXED)])  # launched on version 1
    waiting = b.next_batch(1)
    b.finish("straddling", 3.0)  # launched on version 0, finished on 1: stale as it is banked, mid-call
    b.finish("new_one", 4.0)
    b.finish("new_mixed", 5.0)
    batch = waiting.result(WAIT_S)
    assert ids(batch.groups) == ["new_mixed"]
    assert sorted((g.group_id, g.dropped) for g in batch.dropped) == [
        ("new_one", "zero_variance"), ("old_mixed", "stale"), ("old_one", "stale"), ("straddling", "stale")]
    assert (batch.metrics["dropped_stale"], batch.metrics["groups_skipped_zero_variance"]) == (3, 1)


def test_a_row_without_a_reward_is_named_and_its_group_stays_banked(bench):
    b = bench(dynamic_sampling=True)
    b.c.submit([("g", None)])
    b.finish("g", 1.0)
    with pytest.raises(ValueError, match=r"group g: dynamic sampling needs each final row's 'reward'; sample\(s\) "
                                         r"\[0, 1\] have none"):
        b.next_batch(1).result(WAIT_S)
    assert len(b.c.bank) == 1


def test_signal_counts_only_rows_the_trainer_trains():
    from infra.train.trainer import EXCLUDED_OUTCOMES

    assert UNTRAINED_OUTCOMES == EXCLUDED_OUTCOMES  # the copy (the scheduler does not import torch) must match

    def group(*rows: tuple[str, float]) -> Group:
        g = Group("g", None, 0, len(rows), 0.0)
        for i, (outcome, reward) in enumerate(rows):
            g.final[i] = Attempt({"sample_index": i, "outcome": outcome, "reward": reward}, 0.0, 0.0)
        return g

    assert group(("success", 1.0), ("failure", 0.0)).reward_varies
    assert not group(("success", 1.0), ("unknown", 0.0)).reward_varies  # one trained row: advantage 0
    assert not group(("success", 0.5), ("failure", 0.5)).reward_varies


def test_bad_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="max_extra_groups must be >= 0, got -1"):
        AsyncCollector(GroupGatedRunner(), group_size=2, max_groups_in_flight=2, max_concurrent_episodes=2,
                       max_extra_groups=-1)
    with pytest.raises(ValueError, match=r"max_extra_groups\n  Input should be greater than or equal to 0"):
        AsyncScheduler(max_extra_groups=-1)
    with pytest.raises(ValueError, match="dynamic_sampling needs overprovision > 1"):
        AsyncScheduler(dynamic_sampling=True)
    assert (AsyncScheduler().dynamic_sampling, AsyncScheduler().max_extra_groups) == (False, 4)


def test_the_runs_collector_gets_the_settings():
    scheduler = AsyncScheduler(dynamic_sampling=True, overprovision=2.0, max_extra_groups=3)
    run = Run(RunConfig(rollout=RolloutConfig(scheduler=scheduler)), fs=None)
    run.episode_runner = GroupGatedRunner  # a fake: no engine, no sandboxes
    try:
        assert (run.collector.dynamic_sampling, run.collector.max_extra_groups) == (True, 3)
    finally:
        run.close()
