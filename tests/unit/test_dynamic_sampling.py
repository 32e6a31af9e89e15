"""Dynamic sampling in the asynchronous collector (DAPO, Yu et al. 2025): zero-variance groups skipped, bounded.

Every group's siblings are held until the test releases the whole group, after setting the manual clock,
so the completion order and every completion time are known. Times in comments (``t = 2``) count from
the clock's start ``T0``. A group's task is its rewards, one per sample: ``[1, 1]`` (accuracy 1) and
``[0, 0]`` (accuracy 0) have zero variance, ``[0, 1]`` has signal.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from types import SimpleNamespace

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

    def finish(self, group_id: str, at: float, until: Callable[[], bool] | None = None) -> None:
        """Complete ``group_id`` at ``t = at`` and wait until ``until()`` holds.

        Default: until it is banked, counted as one group fewer in flight (every group launched, none
        pending, nothing submitted meanwhile: a refill needs its own condition).
        """
        if until is None:
            assert self.c.pending == 0
            in_flight = self.c.in_flight
            until = lambda: self.c.in_flight == in_flight - 1  # noqa: E731
        self.clock.advance(T0 + at - self.clock())
        self.runner.release(group_id)
        wait_until(until)

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
    assert AsyncScheduler(dynamic_sampling=True).overprovision == 1.0  # refills replace skipped groups
    assert (AsyncScheduler().dynamic_sampling, AsyncScheduler().max_extra_groups) == (False, 4)


def test_the_runs_collector_gets_the_settings():
    scheduler = AsyncScheduler(dynamic_sampling=True, max_extra_groups=3)  # overprovision 1
    config = RunConfig(rollout=RolloutConfig(scheduler=scheduler))
    run = Run(config, fs=None)
    run.episode_runner = GroupGatedRunner  # a fake: no engine, no sandboxes
    try:
        assert (run.collector.dynamic_sampling, run.collector.max_extra_groups) == (True, 3)
        assert run.collector.K == config.rollout.tasks_per_step  # no extra group in flight
    finally:
        run.close()


# -- refills: a fresh group for each skipped one (DAPO's over-sampling) -------------------------------


class Refills:
    """A ``refill`` for :meth:`AsyncCollector.next_batch`: hands out ``script`` in order (an item may be
    None; past its end: None) and records, by id, the zero-variance group each call was made for."""

    def __init__(self, *script: tuple[str, list[float]] | None):
        self.script = list(script)
        self.asked: list[str] = []

    def __call__(self, skipped: Group) -> tuple[str, list[float]] | None:
        self.asked.append(skipped.group_id)
        return self.script.pop(0) if self.script else None


def test_each_skip_gets_one_refill_up_to_the_bound(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=3)  # K = 8: the in-flight bound never holds a refill back
    refill = Refills(("r0", ZERO), ("r1", ONE), ("r2", ZERO), ("never", MIXED))
    b.c.submit([("a", ZERO), ("b", ONE)])
    waiting = b.next_batch(2, refill=refill)
    b.finish("a", 1.0, until=lambda: refill.asked == ["a"] and b.c.in_flight == 2)  # r0 runs in a's place
    b.finish("b", 2.0, until=lambda: refill.asked == ["a", "b"] and b.c.in_flight == 2)  # r1 in b's
    b.finish("r0", 3.0, until=lambda: refill.asked == ["a", "b", "r0"] and b.c.in_flight == 2)  # r2 in r0's
    b.finish("r1", 4.0, until=lambda: len(b.c.bank) == 4)  # a fourth zero-variance group: the bound (3) is reached
    threading.Event().wait(0.2)  # the scheduler has seen it: no fourth refill
    assert refill.asked == ["a", "b", "r0"] and b.c.in_flight == 1 and not waiting.done()
    b.finish("r2", 5.0)
    batch = waiting.result(WAIT_S)
    # 5 zero-variance groups, 3 may be skipped: a, b, r0 (first completed) are, r1 and r2 fill the batch
    assert ids(batch.groups) == ["r1", "r2"] and ids(batch.dropped) == ["a", "b", "r0"]
    m = batch.metrics
    assert (m["groups_refilled"], m["groups_skipped_zero_variance"], m["groups_filled_zero_variance"]) == (3, 3, 2)
    assert b.c.counters["refilled"] == 3 and b.c.in_flight == 0 and refill.asked == ["a", "b", "r0"]


def test_with_overprovision_1_refills_bring_the_batch_to_b_groups_with_signal(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=4, max_groups_in_flight=3)  # B = 3: overprovision 1
    refill = Refills(("r0", MIXED), ("r1", MIXED))
    b.c.submit([("a", ZERO), ("m", MIXED), ("o", ONE)])
    waiting = b.next_batch(3, refill=refill)
    b.finish("a", 1.0, until=lambda: refill.asked == ["a"] and b.c.in_flight == 3)
    b.finish("m", 2.0)  # signal: no refill
    b.finish("o", 3.0, until=lambda: refill.asked == ["a", "o"] and b.c.in_flight == 2)
    b.finish("r0", 4.0)
    threading.Event().wait(0.2)
    assert not waiting.done()  # two groups with signal of three
    b.finish("r1", 5.0)
    batch = waiting.result(WAIT_S)
    assert ids(batch.groups) == ["m", "r0", "r1"] and all(g.reward_varies for g in batch.groups)
    assert [(g.group_id, g.dropped) for g in batch.dropped] == [("a", "zero_variance"), ("o", "zero_variance")]
    m = batch.metrics
    assert (m["groups_refilled"], m["groups_skipped_zero_variance"], m["groups_filled_zero_variance"]) == (2, 2, 0)
    assert m["zero_variance_wait_s"] == 5.0 - 3.0  # unfiltered, a, m, o made a batch at t = 3; returned at t = 5
    assert b.c.in_flight == 0 and refill.asked == ["a", "o"]  # one call per skipped group, no more


def test_refill_returning_none_at_once_leaves_the_batch_as_without_refills(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=4, max_groups_in_flight=2)
    refill = Refills()  # nothing to refill with
    b.c.submit([("a", ZERO), ("o", ONE)])
    waiting = b.next_batch(2, refill=refill)
    b.finish("a", 1.0, until=lambda: refill.asked == ["a"] and len(b.c.bank) == 1)
    b.finish("o", 2.0, until=waiting.done)  # nothing in flight: zero-variance groups fill the batch
    batch = waiting.result(WAIT_S)
    assert ids(batch.groups) == ["a", "o"] and batch.dropped == [] and refill.asked == ["a"]  # not asked again
    m = batch.metrics
    assert (m["groups_refilled"], m["groups_skipped_zero_variance"], m["groups_filled_zero_variance"]) == (0, 0, 2)
    assert m["short_batches"] == 0


def test_refill_running_dry_later_ends_with_zero_variance_fill_not_a_wedge(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=4, max_groups_in_flight=2)
    refill = Refills(("r0", ZERO))  # then None
    b.c.submit([("a", ZERO), ("o", ONE)])
    waiting = b.next_batch(2, refill=refill)
    b.finish("a", 1.0, until=lambda: refill.asked == ["a"] and b.c.in_flight == 2)
    b.finish("o", 2.0, until=lambda: refill.asked == ["a", "o"] and len(b.c.bank) == 2)  # None: r0 runs alone
    b.finish("r0", 3.0, until=waiting.done)
    batch = waiting.result(WAIT_S)
    # 3 zero-variance groups, 2 needed to fill: the first completed one (a) is skipped
    assert ids(batch.groups) == ["o", "r0"] and ids(batch.dropped) == ["a"] and refill.asked == ["a", "o"]
    m = batch.metrics
    assert (m["groups_refilled"], m["groups_skipped_zero_variance"], m["groups_filled_zero_variance"]) == (1, 1, 2)


def test_a_refill_still_in_flight_carries_over_to_the_next_batch(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=4, max_groups_in_flight=2)
    refill = Refills(("r0", MIXED))
    b.c.submit([("a", ZERO), ("m", MIXED)])
    first = b.next_batch(1, refill=refill)
    b.finish("a", 1.0, until=lambda: refill.asked == ["a"] and b.c.in_flight == 2)
    b.finish("m", 2.0, until=first.done)
    batch = first.result(WAIT_S)
    assert ids(batch.groups) == ["m"] and ids(batch.dropped) == ["a"] and batch.metrics["groups_refilled"] == 1
    assert b.c.in_flight == 1  # r0 runs on
    second = b.next_batch(1, refill=Refills())
    b.finish("r0", 3.0, until=second.done)
    batch = second.result(WAIT_S)
    assert ids(batch.groups) == ["r0"] and batch.metrics["groups_refilled"] == 0 and refill.asked == ["a"]


def test_a_refill_waits_for_room_under_the_in_flight_bound(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=4, max_groups_in_flight=2)
    refill = Refills(("r0", MIXED), ("never", MIXED))
    b.c.submit([("a", ZERO), ("b", ZERO), ("m", MIXED)])  # K = 2: m waits, pending
    waiting = b.next_batch(2, refill=refill)
    b.finish("a", 1.0, until=lambda: b.c.pending == 0 and len(b.c.bank) == 1)  # m runs in a's place: no room
    threading.Event().wait(0.2)
    assert refill.asked == []
    # b banked: b and m... m in flight (1), banked a, b less 2 skip candidates (0): room for one
    b.finish("b", 2.0, until=lambda: refill.asked == ["a"] and b.c.in_flight == 2)
    b.finish("m", 3.0, until=lambda: len(b.c.bank) == 3)  # r0 running + m banked with signal = K: none for b
    threading.Event().wait(0.2)
    assert refill.asked == ["a"] and not waiting.done()
    b.finish("r0", 4.0, until=waiting.done)
    batch = waiting.result(WAIT_S)
    assert ids(batch.groups) == ["m", "r0"] and ids(batch.dropped) == ["a", "b"]
    assert (batch.metrics["groups_refilled"], batch.metrics["groups_skipped_zero_variance"]) == (1, 2)
    assert refill.asked == ["a"]


def test_refills_stay_within_the_bound_when_a_group_refilled_for_goes_stale(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=1, max_policy_lag=0)
    refill = Refills(("r0", ZERO), ("never", MIXED))
    b.c.submit([("old", ZERO)])
    waiting = b.next_batch(1, refill=refill)
    b.finish("old", 1.0, until=lambda: refill.asked == ["old"] and b.c.in_flight == 1)  # r0 runs on version 0
    b.c.update_weights(lambda: None, 1)  # lag 1 > 0: old is stale, r0 will be
    b.c.submit([("new", ZERO)])
    b.finish("r0", 2.0, until=lambda: len(b.c.bank) == 1)
    b.finish("new", 3.0, until=waiting.done)  # a fresh skip candidate, but the one refill allowed was spent
    batch = waiting.result(WAIT_S)
    assert ids(batch.groups) == ["new"] and refill.asked == ["old"]  # nothing more could come: new fills
    assert sorted((g.group_id, g.dropped) for g in batch.dropped) == [("old", "stale"), ("r0", "stale")]
    assert batch.metrics["groups_refilled"] == 1


def test_off_refill_is_never_called(bench):
    b = bench(max_groups_in_flight=2, max_extra_groups=4)  # dynamic_sampling off; the bound would allow refills
    refill = Refills(("r0", MIXED))
    b.c.submit([("zero", ZERO), ("one", ONE)])
    waiting = b.next_batch(2, refill=refill)
    b.finish("zero", 1.0)  # one group fewer in flight: nothing replaced it
    b.finish("one", 2.0)
    batch = waiting.result(WAIT_S)
    assert ids(batch.groups) == ["zero", "one"] and refill.asked == [] and b.c.in_flight == 0
    assert "groups_refilled" not in batch.metrics and b.c.counters["refilled"] == 0


def test_a_refill_id_already_in_flight_is_refused(bench):
    b = bench(dynamic_sampling=True, max_extra_groups=4, max_groups_in_flight=3)
    b.c.submit([("a", ZERO), ("m", MIXED)])
    waiting = b.next_batch(2, refill=Refills(("m", MIXED)))
    b.finish("a", 1.0, until=waiting.done)
    with pytest.raises(ValueError, match="refill returned group id 'm', already pending or in flight"):
        waiting.result(WAIT_S)
    assert b.c.in_flight == 1 and len(b.c.bank) == 1  # nothing lost


# -- the step's refills (tasks/rollouts.py) ---------------------------------------------------------


@dataclass(frozen=True)
class RewardTask:
    """A task for :class:`GroupGatedRunner` (rewards by sample index) with the ``task_id`` the step's refill reads."""

    task_id: str
    rewards: tuple[float, ...]

    def __getitem__(self, sample_index: int) -> float:
        return self.rewards[sample_index]


class StepRunner(GroupGatedRunner):
    """What ``_collect_async`` calls on the run's runner as well: ``bind`` and ``reserve_sandboxes`` (recorded)."""

    def __init__(self):
        super().__init__()
        self.reserved: list[list[str]] = []
        self.launched: list[str] = []  # group ids, in launch order

    def bind(self, run_id: str, step: int, images: dict) -> None:
        pass

    def reserve_sandboxes(self, tasks: list[RewardTask]) -> None:
        self.reserved.append([t.task_id for t in tasks])

    def run(self, job: EpisodeJob) -> dict:
        if job.sample_index == 0:
            self.launched.append(job.group_id)
        return super().run(job)


def collect_step(tasks: dict[str, RewardTask], completion_order: list[str], max_extra_groups: int):
    """``_collect_async`` for step 0 of the chosen ``tasks`` (overprovision 1), groups completing in order.

    Returns (rows, dropped rows, metrics, the runner).
    """
    from tasks.rollouts import _collect_async

    runner = StepRunner()
    c = AsyncCollector(runner, group_size=2, max_groups_in_flight=len(tasks), max_concurrent_episodes=32,
                       clock=ManualClock(), dynamic_sampling=True, max_extra_groups=max_extra_groups)
    runner.collector = c
    engine = SimpleNamespace(generated_tokens=0, busy_s=0.0, prefix_cache=lambda: {"queries": 0, "hits": 0})
    run = SimpleNamespace(collector=c, engine=engine, tasks=tasks, config=SimpleNamespace(run_id="run"))
    future: Future = Future()

    def call():
        try:
            future.set_result(_collect_async(run, {}, list(tasks), 0, lambda done, total: None))
        except BaseException as e:  # noqa: BLE001 - handed to the test through the future
            future.set_exception(e)

    threading.Thread(target=call, daemon=True).start()
    try:
        for k, group_id in enumerate(completion_order, start=1):
            wait_until(lambda g=group_id: g in runner.launched)
            runner.release(group_id)
            if k < len(completion_order):
                wait_until(lambda k=k: len(c.bank) == k)  # banked (nothing is taken before the batch is full)
        rows, dropped, metrics = future.result(WAIT_S)
    finally:
        c.close()
    return rows, dropped, metrics, runner


def test_the_steps_refills_pass_over_tasks_that_came_back_zero_variance():
    tasks = {"z": RewardTask("z", (0.0, 0.0)), "o": RewardTask("o", (1.0, 1.0)), "m": RewardTask("m", (0.0, 1.0))}
    # z skipped: next in turn after z is o (r0); o skipped: m (r1); r0 (o's) skipped: z, o passed over, m (r2)
    order = ["run/0/z", "run/0/o", "run/0/o/r0", "run/0/m", "run/0/m/r1", "run/0/m/r2"]
    rows, dropped, metrics, runner = collect_step(tasks, order, max_extra_groups=3)
    assert runner.launched == ["run/0/z", "run/0/o", "run/0/m", "run/0/o/r0", "run/0/m/r1", "run/0/m/r2"]
    assert sorted({r["group_id"] for r in rows}) == ["run/0/m", "run/0/m/r1", "run/0/m/r2"]
    assert sorted({r["group_id"] for r in dropped}) == ["run/0/o", "run/0/o/r0", "run/0/z"]
    assert (metrics["groups_refilled"], metrics["groups_submitted"]) == (3, 3)
    assert runner.reserved == [["z", "o", "m"]]  # the submitted groups; refills beyond it start cold


def test_the_steps_refills_cycle_over_every_task_when_all_came_back_zero_variance():
    tasks = {"z": RewardTask("z", (0.0, 0.0)), "o": RewardTask("o", (1.0, 1.0))}
    # z skipped: o (r0); o skipped: all zero-variance, so z (r1) in turn; r0 skipped: o (r2); bound 3 reached
    order = ["run/0/z", "run/0/o", "run/0/o/r0", "run/0/z/r1", "run/0/o/r2"]
    rows, dropped, metrics, runner = collect_step(tasks, order, max_extra_groups=3)
    assert runner.launched == order
    assert sorted({r["group_id"] for r in rows}) == ["run/0/o/r2", "run/0/z/r1"]  # 5 zero-variance, 3 skipped
    assert metrics["groups_refilled"] == 3 and metrics["groups_skipped_zero_variance"] == 3


def test_a_sandbox_without_a_reservation_starts_cold_not_refused():
    from infra.sandbox.pool import WarmPool
    from tests.fakes import InMemoryBackend

    backend = InMemoryBackend()
    pool = WarmPool(backend)
    try:
        pool.ensure("img", 1)  # the step's reservation
        assert pool.wait_ready(WAIT_S)
        box, warm = pool.acquire("other")  # a refill of a task whose image was not reserved
        assert (box.image, warm, backend.starts) == ("other", False, 2)
    finally:
        pool.close()
