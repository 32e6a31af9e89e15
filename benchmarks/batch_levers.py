"""What each scheduling lever contributes to the time to a trainable batch: one at a time, then all.

For each workload and sandbox count, the naive scheduler runs once and the optimized one once per lever
setting (:func:`benchmarks.batch_time.fleet`, the simulated fleet: the real scheduler, router and ready bank
against :mod:`infra.rollout.sim`). Levers (issue 28):

- ``base``: ready bank, over-provisioning 1.5x, carry-over while the oldest token is at most 1 version old;
- ``overprovision``: 2.0x groups in flight;
- ``mean lag``: a group trains while its tokens are on average at most ``--mean-lag`` versions old (the
  oldest at most 4), episodes continuing across weight updates;
- ``partial``: a group's ``--k`` finished samples train when complete groups fall short, the rest carried;
- ``all``: the three together.

Printed per row: steady time to batch (mean over steps 1..), reduction against the naive run of the same
invocation, the batch's token-weighted sample lag (mean over steady steps, and max), samples dropped stale
(started, never trained) and groups split. Figures are simulated seconds.

``python -m benchmarks.batch_levers`` (``make bench-batch``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.batch_time import RESULTS, fleet, load_workload

WORKLOADS = {"published": Path(__file__).resolve().parent / "workloads" / "published_swe.json",
             "fitted": RESULTS / "batch_fit.json"}


def levers(mean_lag: float, k: int) -> dict[str, dict]:
    """Lever name -> the optimized configuration's settings."""
    mean = {"max_policy_lag": 4, "max_mean_token_lag": mean_lag}
    return {"base": {},
            "overprovision 2.0x": {"overprovision": 2.0},
            f"mean lag <= {mean_lag:g}": mean,
            f"partial k={k}": {"partial_group_min_samples": k},
            "all": {"overprovision": 2.0, **mean, "partial_group_min_samples": k}}


def row(name: str, naive: dict, opt: dict) -> dict:
    """One table row's figures from a naive and an optimized :func:`fleet` result."""
    steady = opt["per_step"][1:] or opt["per_step"]
    return {"lever": name, "naive_s": naive["steady_mean_s"], "optimized_s": opt["steady_mean_s"],
            "reduction": 1 - opt["steady_mean_s"] / naive["steady_mean_s"],
            "sample_lag_mean": opt["steady_sample_lag_mean"],
            "sample_lag_max": max(m["sample_lag_max"] for m in steady),
            "samples_dropped": opt["samples_dropped"], "groups_split": opt["groups_split"]}


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["published", "fitted"])
    p.add_argument("--sandboxes", type=int, nargs="+", default=[64, 512])
    p.add_argument("--steps", type=int, default=7, help="steady steps (one more runs first)")
    p.add_argument("--mean-lag", type=float, default=1.5)
    p.add_argument("--k", type=int, default=4, help="partial groups' minimum finished samples (G = 8)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--time-scale", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "batch_levers.json"))
    a = p.parse_args(argv)
    table = []
    for workload in a.workloads:
        model = load_workload(WORKLOADS[workload])
        for slots in a.sandboxes:
            def run(configs, overprovision=1.5, model=model, slots=slots, **kw):
                return fleet(model, a.batch, 8, 8, slots, a.steps + 1, 60.0, overprovision, a.time_scale, a.seed,
                             **{"max_policy_lag": 1, **kw}, configs=configs)

            naive = run(("naive",))["naive"]
            for name, settings in levers(a.mean_lag, a.k).items():
                r = row(name, naive, run(("optimized",), **settings)["optimized"])
                table.append({"workload": workload, "sandboxes": slots, **r})
    print("\n| workload | sandboxes | lever | naive steady s | optimized steady s | reduction | sample lag mean "
          "(max) | samples dropped stale | groups split |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['workload']} | {r['sandboxes']} | {r['lever']} | {r['naive_s']:.1f} | {r['optimized_s']:.1f} | "
              f"{100 * r['reduction']:.1f}% | {r['sample_lag_mean']:.2f} ({r['sample_lag_max']}) | "
              f"{r['samples_dropped']} | {r['groups_split']} |")
    Path(a.out).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
