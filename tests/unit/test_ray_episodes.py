"""RayEpisodeRunner's logic on a local Ray instance, its actor body a stand-in (no engine, no Docker)."""

import os
import threading
import time

import pytest

from infra.rollout.ray_episodes import WORKER_LOST, RayEpisodeRunner
from infra.rollout.scheduler import AsyncCollector, EpisodeJob


class _Local:
    """The flow-side collector: only binds and builds failed rows."""

    def __init__(self):
        self.bound, self.closed = None, False

    def bind(self, run_id, step, images):
        self.bound = (run_id, step)

    def failed_row(self, job, reason):
        return {"outcome": "infra_failure", "reason": reason, "min_policy_version": -1, "max_policy_version": -1,
                "sample_index": job.sample_index}

    def close(self):
        self.closed = True


def _stand_in_worker():
    """An actor body with EpisodeWorker's methods; ``task`` says what the episode does. Made here, so that Ray
    ships it by value (the workers need not import the tests)."""

    class StandIn:
        def __init__(self, config, servers, policy_version, shipped, tokenizer):
            self.cancels, self.lock, self.reserved, self.bound = {}, threading.Lock(), [], None

        def describe(self):
            return {"pid": os.getpid()}

        def bind(self, run_id, step, images):
            self.bound = (run_id, step)

        def reserve_sandboxes(self, tasks):
            self.reserved += tasks

        def engine_counters(self):
            return 10 * len(self.cancels), 0.5 * len(self.cancels)  # as if each episode sampled 10 tokens

        def state(self):
            return {"bound": self.bound, "reserved": self.reserved}

        def run(self, key, group_id, task, sample_index, attempt, seed, launch_index):
            if task == "die":
                os._exit(1)  # the node's actor is lost mid-episode
            event = threading.Event()
            with self.lock:
                self.cancels[key] = event
            if task == "slow":
                event.wait(120)
            cancelled = event.is_set()
            return {"outcome": "infra_failure" if cancelled else "pass", "reason": "cancelled" if cancelled else "",
                    "min_policy_version": 0, "max_policy_version": 0, "pid": os.getpid(), "seed": seed,
                    "sample_index": sample_index, "reward": 1.0}

        def cancel(self, key):
            with self.lock:
                event = self.cancels.get(key)
            if event:
                event.set()
            return event is not None

        def close(self):
            pass

    return StandIn


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=128 * 1024**2,
             log_to_driver=False)
    yield ray
    ray.shutdown()


def test_episodes_run_on_the_actor_cancel_reaches_it_and_a_lost_actor_fails_them_as_infra(ray_local):
    local = _Local()
    runner = RayEpisodeRunner(None, [], None, 0, None, local, worker_cls=_stand_in_worker())
    try:
        runner.bind("run", 3, {})
        runner.reserve_sandboxes(["a", "b"])
        assert local.bound == ("run", 3)
        assert ray_local.get(runner.actors[0].state.remote()) == {"bound": ("run", 3), "reserved": ["a", "b"]}

        # the scheduler drives it as any runner: every group complete, every episode in the actor's process
        sched = AsyncCollector(runner, group_size=2, max_groups_in_flight=2, max_concurrent_episodes=4,
                               max_policy_lag=10, prefetch=False, seed=1)
        try:
            sched.submit([("g0", "fast"), ("g1", "fast")])
            batch = sched.run_all()
        finally:
            sched.close()
        assert len(batch.rows) == 4 and {r["outcome"] for r in batch.rows} == {"pass"}
        assert {r["pid"] for r in batch.rows} == {runner.workers[0]["pid"]} != {os.getpid()}

        slow = EpisodeJob("g2", "slow", 0, 0, seed=7, launch_index=2)
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("row", runner.run(slow)))
        t.start()
        time.sleep(1.0)
        start = time.monotonic()
        slow.cancel.set()  # the scheduler gives up on it: the actor's episode sees it between turns
        t.join(30)
        assert out["row"]["reason"] == "cancelled" and time.monotonic() - start < 10

        assert runner.engine_counters() == [(50, 2.5)]  # 4 + 1 episodes on the one actor

        lost = runner.run(EpisodeJob("g3", "die", 1, 0, seed=8, launch_index=3))
        assert (lost["outcome"], lost["reason"], lost["sample_index"]) == ("infra_failure", WORKER_LOST, 1)
        assert runner.counters["workers_lost"] == 1
        assert runner.engine_counters() == [(50, 2.5)]  # a lost actor's last figures stand
        again = runner.run(EpisodeJob("g3", "fast", 1, 1, seed=9, launch_index=3))  # no actor left
        assert again["reason"] == WORKER_LOST
    finally:
        runner.close(timeout_s=5)
    assert local.closed


def test_a_cancel_that_overtakes_its_episode_cancels_it_as_it_starts():
    """A threaded actor keeps no call order: EpisodeWorker.cancel may run before EpisodeWorker.run registers."""
    from infra.rollout.ray_episodes import EpisodeWorker

    class Collector:
        def run(self, job):
            return {"cancelled": job.cancel.is_set()}

    worker = object.__new__(EpisodeWorker)  # its body's bookkeeping only: no engine, no Docker
    worker.collector, worker._cancels, worker._cancelled_early, worker._lock = Collector(), {}, set(), threading.Lock()
    assert worker.cancel("g/0/0/1") is False  # not running yet: remembered
    assert worker.run("g/0/0/1", "g", "task", 0, 0, 1, 0) == {"cancelled": True}
    assert worker.run("g/0/0/1", "g", "task", 0, 0, 1, 0) == {"cancelled": False}  # remembered once
    assert not worker._cancels and not worker._cancelled_early
