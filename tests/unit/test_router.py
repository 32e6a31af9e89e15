"""Routing logic (pure) and the scheduler on the simulated fleet (no engine, no sandbox)."""

from __future__ import annotations

import time

import pytest

from infra.rollout.router import NoLiveReplica, Router
from infra.rollout.scheduler import AsyncCollector
from infra.rollout.sim import FleetModel, SimReplica, SimRunner, SimSandboxes, fit_fleet_model


def test_affinity_is_sticky_and_new_trajectories_go_to_the_least_loaded():
    r = Router(["a", "b"])
    with r.route("t1") as first:
        assert first == "a"
        assert r.pick("t2") == "b"  # "a" has a request in flight
    assert r.pick("t1") == "a" and r.pick("t2") == "b"  # sticky
    assert r.sticky_hits == 2
    r.finish("t1")
    assert r.pick("t3") == "a"  # "a" has no trajectory left, "b" has one


def test_round_robin_ignores_history():
    r = Router(["a", "b", "c"], "round_robin")
    assert [r.pick("t1") for _ in range(4)] == ["a", "b", "c", "a"]


def test_failover_moves_trajectories_off_a_dead_replica():
    r = Router(["a", "b"])
    assert r.pick("t1") == "a" and r.pick("t2") == "b"
    assert r.mark_dead("a") == ["t1"]
    assert r.pick("t1") == "b" and r.live == ["b"]
    r.mark_dead("b")
    with pytest.raises(NoLiveReplica):
        r.pick("t1")
    r.revive("a")
    assert r.pick("t9") == "a"


def test_bad_router_settings():
    with pytest.raises(ValueError, match="distinct"):
        Router(["a", "a"])
    with pytest.raises(ValueError, match="routing policy"):
        Router(["a"], "random")


def test_busy_seconds_count_time_with_requests_in_flight():
    r = Router(["a", "b"])
    with r.route("t"):
        time.sleep(0.05)
    busy = r.busy_seconds()
    assert busy["a"] >= 0.04 and busy["b"] == 0.0


def test_simulated_fleet_batches_complete_within_the_lag_bound():
    model = FleetModel(tool_s_median=0.2, command_timeout_s=5.0, cold_start_s_median=0.5)
    scale = 0.002
    names = ["r0", "r1", "r2"]
    router = Router(names)
    sims = {n: SimReplica(model, scale) for n in names}
    runner = SimRunner(model, router, sims, SimSandboxes(model, 8, True, scale), scale)
    c = AsyncCollector(runner, group_size=4, max_groups_in_flight=6, max_concurrent_episodes=32, max_policy_lag=1,
                       clock=lambda: time.monotonic() / scale)
    try:
        c.submit([(f"g{i}", None) for i in range(24)])
        for step in range(3):
            batch = c.next_batch(4)
            assert len(batch.train_rows()) == 16
            assert all(step - g.min_policy_version <= 1 for g in batch.groups)

            def apply(v=step + 1):
                runner.policy_version = v

            c.update_weights(apply, step + 1)
        assert sum(s.cached_tokens for s in sims.values()) > 0  # affinity turned later turns into cache hits
    finally:
        c.close()


def test_fit_reads_a_real_runs_rows():
    rows = [{"outcome": "success", "num_turns": 2, "tool_s": 1.0, "prompt_tokens": 300, "completion_tokens": 40,
             "verify_s": 0.5}, {"outcome": "infra_failure", "num_turns": 0}]
    m = fit_fleet_model(rows, [0.6, 0.7, 1.4], [0.01], decode_s_per_token=0.02, max_turns=4, command_timeout_s=30)
    assert m.tokens_per_turn == 20 and m.prompt_tokens == 300 and m.tool_s_median == 0.5
    assert m.cold_start_s_median == 0.7 and m.turns_p == 0.5
    with pytest.raises(ValueError, match="no non-infra rows"):
        fit_fleet_model(rows[1:], [], [], 0.02, 4, 30)
