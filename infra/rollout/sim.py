"""A simulated fleet (engine replicas, sandboxes) for scheduling at scales this machine cannot run.

The scheduler, router and ready bank are the production ones (:mod:`infra.rollout.scheduler`,
:mod:`infra.rollout.router`); only the engine and the sandboxes are replaced by latency models
fitted to a real run (:class:`FleetModel`, from ``benchmarks.batch_time``'s real scale). Time is
compressed by ``time_scale`` (1 simulated second sleeps ``time_scale`` real seconds); all figures
are reported in simulated seconds.

Engine model (continuous batching): a request of ``n`` new tokens on a replica running ``a``
requests takes ``prefill_s_per_token * uncached + n * decode_s_per_token * (1 + decode_slowdown *
(a - 1))``; a replica caches each trajectory's history, so a turn routed back to it prefills only
the new observation (affinity), while a turn landing elsewhere prefills the whole history.
Sandbox model: ``slots`` sandboxes at most; a cold start costs a draw from the fitted cold-start
distribution, a warm acquire the warm figure; with a warm pool a released slot is restarted in the
background (off the critical path). Workload: per (task, sample, attempt) the number of turns,
tokens per turn and tool seconds are drawn from a seeded generator, so two configurations see
the same episodes.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass

from infra.rollout.router import Router
from infra.rollout.scheduler import EpisodeJob


@dataclass(frozen=True)
class FleetModel:
    """Latency and workload model in simulated seconds (fit with :func:`fit_fleet_model`)."""

    prefill_s_per_token: float = 0.0004
    decode_s_per_token: float = 0.02
    decode_slowdown: float = 0.05
    prompt_tokens: int = 400
    observation_tokens: int = 60
    tokens_per_turn: int = 48
    max_turns: int = 4
    turns_p: float = 0.45
    """Geometric parameter of the number of turns (1 + Geometric, capped at ``max_turns``)."""
    tool_s_median: float = 0.3
    tool_s_sigma: float = 1.2
    """Lognormal tool (command) time: median and log-space sigma (heavy tail)."""
    tool_hang_p: float = 0.03
    command_timeout_s: float = 30.0
    """Chance a command hangs until the per-command timeout."""
    cold_start_s_median: float = 0.66
    cold_start_sigma: float = 0.3
    warm_acquire_s: float = 0.0074
    verify_s: float = 0.8

    def to_dict(self) -> dict:
        """Plain dict (JSON)."""
        return asdict(self)


def _lognormal_sigma(p50: float, p99: float) -> float:
    return max(0.05, math.log(max(p99, p50 * 1.01) / p50) / 2.326)


def fit_fleet_model(rows: list[dict], cold_acquire_s: list[float], warm_acquire_s: list[float],
                    decode_s_per_token: float, max_turns: int, command_timeout_s: float) -> FleetModel:
    """Fit a :class:`FleetModel` to a real run's trajectory rows and acquire measurements.

    Turns: geometric parameter from the mean turn count. Tools: median and log-space sigma of
    the per-turn tool seconds (``tool_s / num_turns``), hang probability from turns at the
    command timeout. Sandboxes: cold-start median and sigma from p50/p99. Tokens: mean sampled
    tokens per turn and mean prompt tokens.

    Raises:
        ValueError: no usable rows.
    """
    rows = [r for r in rows if r.get("outcome") != "infra_failure" and r.get("num_turns", 0) > 0]
    if not rows:
        raise ValueError("fit_fleet_model: no non-infra rows with turns")
    turns = [r["num_turns"] for r in rows]
    mean_turns = sum(turns) / len(turns)
    per_tool = sorted(r["tool_s"] / r["num_turns"] for r in rows if r["tool_s"] > 0) or [0.1]
    med = per_tool[len(per_tool) // 2]
    p90 = per_tool[min(len(per_tool) - 1, int(0.9 * len(per_tool)))]
    hang = sum(t >= 0.95 * command_timeout_s for t in per_tool) / len(per_tool)
    cold = sorted(cold_acquire_s) or [0.66]
    c50, c99 = cold[len(cold) // 2], cold[min(len(cold) - 1, int(0.99 * len(cold)))]
    warm = sorted(warm_acquire_s) or [0.0074]
    return FleetModel(
        decode_s_per_token=decode_s_per_token, decode_slowdown=0.0,  # measured per-token time includes batching
        prompt_tokens=int(sum(r["prompt_tokens"] for r in rows) / len(rows)),
        tokens_per_turn=max(1, int(sum(r["completion_tokens"] for r in rows) / sum(turns))),
        max_turns=max_turns, turns_p=min(0.95, max(0.05, 1.0 / max(mean_turns, 1.0))),
        tool_s_median=max(0.001, med), tool_s_sigma=max(0.05, math.log(max(p90, med * 1.01) / med) / 1.2816),
        tool_hang_p=hang, command_timeout_s=command_timeout_s,
        cold_start_s_median=c50, cold_start_sigma=_lognormal_sigma(c50, c99), warm_acquire_s=warm[len(warm) // 2],
        verify_s=sorted(r["verify_s"] for r in rows)[len(rows) // 2])


class SimReplica:
    """One engine replica: continuous batching and a per-trajectory prefix cache."""

    def __init__(self, model: FleetModel, time_scale: float):
        self.m, self.scale = model, time_scale
        self.active = 0
        self.cache: dict[str, int] = {}
        self.lock = threading.Lock()
        self.prefill_tokens = 0
        self.cached_tokens = 0

    def generate(self, trajectory_id: str, prompt_len: int, new_tokens: int) -> float:
        """Serve one request; returns its simulated seconds."""
        with self.lock:
            cached = min(self.cache.get(trajectory_id, 0), prompt_len)
            self.active += 1
            active = self.active
            self.prefill_tokens += prompt_len
            self.cached_tokens += cached
        seconds = ((prompt_len - cached) * self.m.prefill_s_per_token
                   + new_tokens * self.m.decode_s_per_token * (1 + self.m.decode_slowdown * (active - 1)))
        time.sleep(seconds * self.scale)
        with self.lock:
            self.active -= 1
            self.cache[trajectory_id] = prompt_len + new_tokens
        return seconds


class SimSandboxes:
    """At most ``slots`` sandboxes; cold starts or warm acquires (with a background-refilled pool)."""

    def __init__(self, model: FleetModel, slots: int, warm_pool: bool, time_scale: float, seed: int = 0):
        self.m, self.scale, self.warm_pool = model, time_scale, warm_pool
        self.free = threading.Semaphore(slots)
        self.warm = threading.Semaphore(slots if warm_pool else 0)  # pre-started before the run
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def _cold_s(self) -> float:
        with self.lock:
            return self.m.cold_start_s_median * math.exp(self.rng.gauss(0, self.m.cold_start_sigma))

    def acquire(self) -> tuple[float, bool]:
        """Wait for a slot and start or take a sandbox; returns (simulated acquire seconds, warm)."""
        self.free.acquire()
        if self.warm_pool and self.warm.acquire(blocking=False):
            seconds, warm = self.m.warm_acquire_s, True
        else:
            seconds, warm = self._cold_s(), False
        time.sleep(seconds * self.scale)
        return seconds, warm

    def release(self) -> None:
        """Give the slot back; a warm pool restarts a sandbox in it in the background."""
        if self.warm_pool:
            def refill():
                time.sleep(self._cold_s() * self.scale)
                self.warm.release()
                self.free.release()
            threading.Thread(target=refill, daemon=True).start()
        else:
            self.free.release()


class SimRunner:
    """:class:`~infra.rollout.scheduler.EpisodeRunner` over simulated replicas and sandboxes."""

    def __init__(self, model: FleetModel, router: Router, replicas: dict[str, SimReplica], sandboxes: SimSandboxes,
                 time_scale: float, seed: int = 0):
        self.m, self.router, self.replicas, self.sandboxes = model, router, replicas, sandboxes
        self.scale, self.seed = time_scale, seed
        self.policy_version = 0

    def _workload(self, job: EpisodeJob) -> tuple[int, list[float], list[int]]:
        rng = random.Random(f"{self.seed}/{job.group_id}/{job.sample_index}/{job.attempt}")
        turns = 1
        while turns < self.m.max_turns and rng.random() > self.m.turns_p:
            turns += 1
        tools = [self.m.command_timeout_s if rng.random() < self.m.tool_hang_p else
                 min(self.m.command_timeout_s, self.m.tool_s_median * math.exp(rng.gauss(0, self.m.tool_s_sigma)))
                 for _ in range(turns)]
        tokens = [max(1, int(rng.expovariate(1.0 / self.m.tokens_per_turn))) for _ in range(turns)]
        return turns, tools, tokens

    def run(self, job: EpisodeJob) -> dict:
        """Simulate one attempt; the row carries simulated seconds."""
        start = time.monotonic()
        turns, tools, tokens = self._workload(job)
        acquire_s, warm = self.sandboxes.acquire()
        generation_s = tool_s = 0.0
        versions: list[int] = []
        prompt = self.m.prompt_tokens
        try:
            for t in range(turns):
                if job.cancel.is_set():
                    return self.failed_row(job, "cancelled")
                trajectory = f"{job.group_id}/{job.sample_index}/{job.attempt}"
                with self.router.route(trajectory) as replica:
                    generation_s += self.replicas[replica].generate(trajectory, prompt, tokens[t])
                versions.append(self.policy_version)
                prompt += tokens[t] + self.m.observation_tokens
                time.sleep(tools[t] * self.scale)
                tool_s += tools[t]
            time.sleep(self.m.verify_s * self.scale)
            self.router.finish(f"{job.group_id}/{job.sample_index}/{job.attempt}")
        finally:
            self.sandboxes.release()
        return {"group_id": job.group_id, "sample_index": job.sample_index, "attempt": job.attempt,
                "outcome": "success", "reason": "simulated", "min_policy_version": min(versions),
                "max_policy_version": max(versions), "num_turns": turns, "completion_tokens": sum(tokens),
                "tokens_by_version": dict(sum((Counter({v: n}) for v, n in zip(versions, tokens, strict=True)),
                                              Counter())),
                "sandbox_acquire_s": acquire_s, "sandbox_warm": warm, "generation_s": generation_s,
                "tool_s": tool_s, "wall_s": (time.monotonic() - start) / self.scale}

    def failed_row(self, job: EpisodeJob, reason: str) -> dict:
        """An infra-failure row."""
        return {"group_id": job.group_id, "sample_index": job.sample_index, "attempt": job.attempt,
                "outcome": "infra_failure", "reason": reason, "min_policy_version": -1, "max_policy_version": -1}
