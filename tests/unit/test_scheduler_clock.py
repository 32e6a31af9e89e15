"""AsyncCollector's deadlines and timings on a manual clock: decided by the collector's clock, not wall time.

Each attempt is held by a gate until the test releases it, after moving the clock, so every time the
scheduler records (launch, finish, episode_s, deadlines, timeouts) is known exactly. A released
attempt's result wakes the scheduler thread at once, which then judges deadlines at the current time.
Times in comments (``t = 10``) count from the clock's start ``T0``.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from infra.rollout.scheduler import AsyncCollector, EpisodeJob
from tests.fakes import ManualClock

T0 = ManualClock()()  # the manual clock's start: every expected time is relative to it
WAIT_S = 5.0  # wall-clock guard against a hang; never reached when the tests pass


class GatedRunner:
    """Every attempt ``(group_id, sample_index, attempt)`` runs until released (success) or cancelled."""

    def __init__(self, collector_version=lambda: 0):
        self._lock = threading.Lock()
        self._started: dict[tuple, threading.Event] = {}
        self._release: dict[tuple, threading.Event] = {}
        self.version = collector_version

    def _gate(self, key: tuple) -> tuple[threading.Event, threading.Event]:
        with self._lock:
            return (self._started.setdefault(key, threading.Event()),
                    self._release.setdefault(key, threading.Event()))

    def wait_started(self, *key) -> None:
        assert self._gate(key)[0].wait(WAIT_S), f"{key} never started"

    def started(self, *key) -> bool:
        return self._gate(key)[0].is_set()

    def release(self, *key) -> None:
        self._gate(key)[1].set()

    def run(self, job: EpisodeJob) -> dict:
        started, release = self._gate((job.group_id, job.sample_index, job.attempt))
        started.set()
        while not release.wait(0.005):
            if job.cancel.is_set():
                return self.failed_row(job, "cancelled")
        v = self.version()
        return {"group_id": job.group_id, "sample_index": job.sample_index, "attempt": job.attempt,
                "outcome": "success", "reason": "tests_passed", "min_policy_version": v, "max_policy_version": v}

    def failed_row(self, job: EpisodeJob, reason: str) -> dict:
        return {"group_id": job.group_id, "sample_index": job.sample_index, "attempt": job.attempt,
                "outcome": "infra_failure", "reason": reason, "min_policy_version": -1, "max_policy_version": -1}


@pytest.fixture
def make():
    made: list[AsyncCollector] = []

    def make(**kw) -> tuple[AsyncCollector, GatedRunner, ManualClock]:
        clock, runner = ManualClock(), GatedRunner()
        args = {"group_size": 1, "max_groups_in_flight": 4, "max_concurrent_episodes": 4, "episode_deadline_s": 10.0,
                "infra_policy": "retry", "max_infra_retries": 1}
        c = AsyncCollector(runner, clock=clock, **{**args, **kw})
        runner.version = lambda: c.policy_version
        made.append(c)
        return c, runner, clock

    yield make
    for c in made:
        c.close()


def in_thread(fn, *args, **kw) -> Future:
    """Call ``fn`` on a daemon thread (a hung call cannot hold the test process at exit)."""
    future: Future = Future()

    def call():
        try:
            future.set_result(fn(*args, **kw))
        except BaseException as e:  # noqa: BLE001 - handed to the test through the future
            future.set_exception(e)

    threading.Thread(target=call, daemon=True).start()
    return future


def next_batch(c: AsyncCollector, n: int):
    """``c.next_batch(n)`` with a wall-clock guard (the collector's own timeout is on the manual clock)."""
    return in_thread(c.next_batch, n).result(WAIT_S)


def test_wall_time_past_the_deadline_cancels_nothing(make):
    c, runner, _ = make(episode_deadline_s=0.01)
    c.submit([("g", None)])
    runner.wait_started("g", 0, 0)
    threading.Event().wait(0.2)  # 20 deadlines of wall time; the collector's clock has not moved
    runner.release("g", 0, 0)
    batch = next_batch(c, 1)
    assert [(a.row["outcome"], a.episode_s) for a in batch.attempts] == [("success", 0.0)]
    assert batch.metrics["deadline_cancels"] == 0 and batch.metrics["time_to_batch_s"] == 0.0


def test_an_attempt_is_cancelled_only_once_the_clock_is_past_its_deadline(make):
    c, runner, clock = make(episode_deadline_s=10.0)
    c.submit([("a", None), ("b", None)])
    runner.wait_started("a", 0, 0)
    runner.wait_started("b", 0, 0)  # both launched at t = 0
    clock.advance(10.0)  # exactly at b's deadline: not past it (elapsed 10 is not > 10)
    runner.release("a", 0, 0)  # a's result wakes the scheduler, which judges deadlines at t = 10
    first = next_batch(c, 1)  # a was banked in the same scheduler step that judged b at t = 10
    assert [g.group_id for g in first.groups] == ["a"] and c.counters["deadline_cancels"] == 0

    clock.advance(0.5)  # t = 10.5: b is 0.5 s past its deadline, cancelled and relaunched (attempt 1)
    runner.wait_started("b", 0, 1)
    clock.advance(2.0)
    runner.release("b", 0, 1)  # the retry finishes at t = 12.5, 2 s after its launch
    second = next_batch(c, 1)
    assert [(a.row["attempt"], a.row["outcome"], a.row["reason"], a.episode_s) for a in second.attempts] == [
        (0, "infra_failure", "episode_deadline", 10.5), (1, "success", "tests_passed", 2.0)]
    assert (c.counters["deadline_cancels"], c.counters["infra_retries"]) == (1, 1)


def wait_until(condition) -> None:
    """Poll ``condition`` on wall time (the scheduler thread acts on its own wake-ups), up to ``WAIT_S``."""
    deadline = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        deadline.wait(0.01)
    raise AssertionError("condition never held")


def test_an_infra_retry_waits_its_backoff_on_the_clock(make):
    c, runner, clock = make(episode_deadline_s=10.0, retry_backoff_s=2.0, max_infra_retries=2)
    c.submit([("g", None)])
    runner.wait_started("g", 0, 0)
    clock.advance(10.5)  # t = 10.5: past the deadline, attempt 0 is an infra failure; retry 1 is due at t = 12.5
    wait_until(lambda: c.counters["deadline_cancels"] == 1)
    threading.Event().wait(0.2)  # the scheduler wakes at least every 0.1 s: it would have started a due retry
    assert not runner.started("g", 0, 1)
    clock.advance(2.0)
    runner.wait_started("g", 0, 1)  # backoff 2 s * 2**0
    clock.advance(10.5)  # t = 23: attempt 1 past its deadline; retry 2 is due 2 s * 2**1 = 4 s later, at t = 27
    wait_until(lambda: c.counters["deadline_cancels"] == 2)
    clock.advance(3.5)  # t = 26.5
    threading.Event().wait(0.2)
    assert not runner.started("g", 0, 2)
    clock.advance(0.5)
    runner.wait_started("g", 0, 2)
    runner.release("g", 0, 2)
    batch = next_batch(c, 1)
    assert [a.row["attempt"] for a in batch.attempts] == [0, 1, 2] and c.counters["infra_retries"] == 2


def test_a_deadline_cancel_between_batches_is_counted_in_the_next_batch(make):
    c, runner, clock = make(episode_deadline_s=10.0)
    c.submit([("a", None), ("b", None)])
    runner.wait_started("a", 0, 0)
    runner.wait_started("b", 0, 0)
    runner.release("a", 0, 0)
    assert [g.group_id for g in next_batch(c, 1).groups] == ["a"]
    clock.advance(10.5)  # between batches: b is cancelled at its deadline and retried
    runner.wait_started("b", 0, 1)
    runner.release("b", 0, 1)
    second = next_batch(c, 1)
    assert [r["reason"] for r in second.rows] == ["episode_deadline", "tests_passed"]
    assert (second.metrics["deadline_cancels"], second.metrics["infra_retries"]) == (1, 1)


def test_the_deadline_runs_from_launch_not_from_queueing(make):
    c, runner, clock = make(max_concurrent_episodes=1, episode_deadline_s=10.0)
    c.submit([("a", None), ("b", None)])  # both queued at t = 0; one worker, so b waits for a
    runner.wait_started("a", 0, 0)
    clock.advance(8.0)
    runner.release("a", 0, 0)  # a finishes at t = 8; b launches then
    runner.wait_started("b", 0, 0)
    clock.advance(7.0)  # t = 15: 15 s since b was queued, but only 7 s since its launch
    runner.release("b", 0, 0)
    batch = next_batch(c, 2)
    got = {a.row["group_id"]: (a.queue_s, a.episode_s, a.finished_s) for a in batch.attempts}
    assert got == {"a": (0.0, 8.0, T0 + 8.0), "b": (8.0, 7.0, T0 + 15.0)}
    assert batch.metrics["deadline_cancels"] == 0 and batch.metrics["episode_s_max"] == 8.0


def test_next_batch_times_out_on_the_collectors_clock(make):
    c, runner, clock = make(group_size=2, episode_deadline_s=100.0)
    c.submit([("g", None)])
    runner.wait_started("g", 0, 0)
    runner.wait_started("g", 1, 0)
    waiting = in_thread(c.next_batch, 1, timeout_s=0.05)
    threading.Event().wait(0.2)  # four timeouts of wall time
    assert not waiting.done()
    clock.advance(0.06)  # now past the 0.05 s timeout on the collector's clock
    runner.release("g", 0, 0)  # one sibling finishing wakes next_batch; the group is still incomplete
    with pytest.raises(TimeoutError, match="0/1 groups after 0.05 s"):
        waiting.result(WAIT_S)
    runner.release("g", 1, 0)  # nothing was lost: the group completes into the bank
    batch = next_batch(c, 1)
    assert [g.group_id for g in batch.groups] == ["g"] and len(batch.rows) == 2


def test_update_weights_reports_the_wait_and_the_apply_on_the_clock(make):
    c, runner, clock = make(update_policy="finish")
    c.submit([("g", None)])
    runner.wait_started("g", 0, 0)

    def finish_later():
        clock.advance(3.0)  # the in-flight episode takes 3 more seconds on the old weights
        runner.release("g", 0, 0)

    threading.Timer(0.05, finish_later).start()
    waited = c.update_weights(lambda: clock.advance(2.5), 1)  # loading the weights takes 2.5 s
    assert waited == 3.0 + 2.5 and c.policy_version == 1
    [attempt] = next_batch(c, 1).attempts
    assert (attempt.row["min_policy_version"], attempt.finished_s) == (0, T0 + 3.0)  # finished on v0 before the apply
