"""Does GRPO learn? Mean training reward per step for several seeds, from the stored trajectories.

Runs ``post_train`` once per seed (each in its own process, run id ``{prefix}-s{seed}``) with a
config such as ``configs/learn-simple.toml``, then reads every step's Parquet file back from S3
and prints the reward curve per seed, the mean and spread across seeds, and the change from the
first to the last steps. Needs the services of ``make up`` (their env in ``.state/services.env``).

Per step it also prints, from the stored step summaries, the trainer/rollout logprob mismatch, the
rows with signal and the zero-variance groups the collector skipped; and, from the rows, how many
commands the successful episodes ran (a look-then-act task is meant to need two). ``--report-only``
prints the figures of runs already stored under ``--run-prefix`` without running anything.

Usage: ``python -m benchmarks.learning_curve --config configs/learn-simple.toml --seeds 0 1 --steps 10``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np


def reward_curve(bucket: str, prefix: str, run_id: str) -> list[float]:
    """Mean reward of each stored step of a run (infra failures left out), in step order."""
    from infra.layout import RunLayout
    from infra.storage import s3_filesystem
    from infra.store import read_history

    table = read_history(s3_filesystem(bucket), RunLayout(bucket, prefix, run_id), ["step", "reward", "outcome"])
    steps, rewards, outcomes = (table.column(c).to_pylist() for c in ("step", "reward", "outcome"))
    by_step: dict[int, list[float]] = {}
    for s, r, o in zip(steps, rewards, outcomes, strict=True):
        if o != "infra_failure":
            by_step.setdefault(s, []).append(r)
    return [float(np.mean(by_step[s])) for s in sorted(by_step)]


def task_matched_gain(bucket: str, prefix: str, run_id: str, steps: int) -> dict[str, float]:
    """Pass rate of each task in the first half of the steps against the second half.

    The tasks sampled differ from step to step (difficulty selection), so the raw curve mixes task
    difficulty into the trend; this compares each task only with itself, over tasks attempted in
    both halves, and averages. Returns ``{"tasks", "early", "late", "gain"}``.
    """
    from infra.layout import RunLayout
    from infra.storage import s3_filesystem
    from infra.store import read_history

    table = read_history(s3_filesystem(bucket), RunLayout(bucket, prefix, run_id),
                         ["task_id", "step", "reward", "outcome"])
    halves: dict[str, tuple[list[float], list[float]]] = {}
    for t, s, r, o in zip(*(table.column(c).to_pylist() for c in ("task_id", "step", "reward", "outcome")),
                          strict=True):
        if o != "infra_failure":
            halves.setdefault(t, ([], []))[0 if s < steps // 2 else 1].append(r)
    both = {t: (np.mean(a), np.mean(b)) for t, (a, b) in halves.items() if a and b}
    early = float(np.mean([a for a, _ in both.values()])) if both else float("nan")
    late = float(np.mean([b for _, b in both.values()])) if both else float("nan")
    return {"tasks": float(len(both)), "early": early, "late": late, "gain": late - early}


def step_figures(bucket: str, prefix: str, run_id: str) -> list[dict]:
    """Per-step figures from the stored summaries, in step order.

    Each: ``logprob_abs_diff``, ``rows_with_signal``, ``rows_trained``, ``groups_skipped_zero_variance``
    (0 when dynamic sampling is off), ``step_s`` (the stages' seconds summed).
    """
    import json

    from infra.layout import RunLayout
    from infra.storage import s3_filesystem

    fs = s3_filesystem(bucket)
    fs.invalidate_cache()
    out = []
    for path in sorted(fs.glob(RunLayout(bucket, prefix, run_id).summaries_glob)):
        s = json.loads(fs.cat_file(path))
        out.append({"step": s["step"], "logprob_abs_diff": s["logprob_abs_diff"],
                    "rows_with_signal": s["rows_with_signal"], "rows_trained": s.get("rows_trained", s["rows"]),
                    "groups_skipped_zero_variance": s.get("groups_skipped_zero_variance", 0.0),
                    "step_s": sum(s[k] for k in ("difficulty_s", "rollout_s", "train_s", "publish_s", "eval_s"))})
    return sorted(out, key=lambda f: f["step"])


def commands_on_success(bucket: str, prefix: str, run_id: str, steps: int) -> dict[str, float]:
    """Commands run by successful episodes, first half of the steps against the second.

    Returns ``{"early_successes", "late_successes", "early_commands_mean", "late_commands_mean",
    "late_one_command_frac"}`` (nan where a half has no success).
    """
    from infra.layout import RunLayout
    from infra.storage import s3_filesystem
    from infra.store import read_history

    table = read_history(s3_filesystem(bucket), RunLayout(bucket, prefix, run_id), ["step", "outcome", "commands"])
    halves: tuple[list[int], list[int]] = ([], [])
    for s, o, c in zip(*(table.column(k).to_pylist() for k in ("step", "outcome", "commands")), strict=True):
        if o == "success":
            halves[0 if s < steps // 2 else 1].append(len(c or []))
    early, late = halves
    nan = float("nan")
    return {"early_successes": float(len(early)), "late_successes": float(len(late)),
            "early_commands_mean": float(np.mean(early)) if early else nan,
            "late_commands_mean": float(np.mean(late)) if late else nan,
            "late_one_command_frac": float(np.mean([n <= 1 for n in late])) if late else nan}


def run_seed(config: str, run_id: str, seed: int, steps: int) -> float:
    """Run post_train for one seed in a fresh process; returns its wall-clock seconds.

    Raises:
        subprocess.CalledProcessError: the run failed.
    """
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "flows.post_train", "--config", config, "--run-id", run_id,
                    "--seed", str(seed), "--steps", str(steps)], check=True)
    return time.monotonic() - start


def summarize(curves: dict[int, list[float]], window: int) -> dict[str, float]:
    """Mean of the first and last ``window`` steps, averaged over seeds, with the spread over seeds."""
    first = np.array([np.mean(c[:window]) for c in curves.values()])
    last = np.array([np.mean(c[-window:]) for c in curves.values()])
    return {"first_mean": float(first.mean()), "last_mean": float(last.mean()),
            "gain_mean": float((last - first).mean()), "gain_min": float((last - first).min()),
            "gain_max": float((last - first).max())}


def main(argv: list[str] | None = None) -> int:
    """Run the seeds and print the curves."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/learn-simple.toml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=3, help="steps averaged at each end")
    parser.add_argument("--run-prefix", default=f"learn-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--report-only", action="store_true",
                        help="print the figures of the runs stored under --run-prefix; run nothing")
    args = parser.parse_args(argv)
    from infra.config import load_config

    cfg = load_config(args.config)
    curves, seconds, matched, figures, commands = {}, {}, {}, {}, {}
    bucket, prefix = cfg.storage.bucket, cfg.storage.prefix
    for seed in args.seeds:
        run_id = f"{args.run_prefix}-s{seed}"
        if not args.report_only:
            seconds[seed] = run_seed(args.config, run_id, seed, args.steps)
        curves[seed] = reward_curve(bucket, prefix, run_id)
        matched[seed] = task_matched_gain(bucket, prefix, run_id, args.steps)
        figures[seed] = step_figures(bucket, prefix, run_id)
        commands[seed] = commands_on_success(bucket, prefix, run_id, args.steps)
        if args.report_only:  # the stages' seconds (set-up before step 0 not included)
            seconds[seed] = sum(f["step_s"] for f in figures[seed])
    print(f"config {args.config}, {args.steps} steps, seeds {args.seeds}, run prefix {args.run_prefix}")
    print("| seed | " + " | ".join(f"step {i}" for i in range(args.steps)) + " | wall s |")
    print("|---|" + "---:|" * (args.steps + 1))
    for seed, curve in curves.items():
        print(f"| {seed} | " + " | ".join(f"{r:.3f}" for r in curve) + f" | {seconds[seed]:.0f} |")
    mean = np.mean([c for c in curves.values()], axis=0)
    print("| mean | " + " | ".join(f"{r:.3f}" for r in mean) + " | |")
    s = summarize(curves, args.window)
    print(f"mean reward, first {args.window} steps {s['first_mean']:.3f} -> last {args.window} steps "
          f"{s['last_mean']:.3f}: gain {s['gain_mean']:+.3f} (per-seed range {s['gain_min']:+.3f} .. "
          f"{s['gain_max']:+.3f})")
    for seed, m in matched.items():
        print(f"seed {seed}: task-matched pass rate, first half {m['early']:.3f} -> second half {m['late']:.3f} "
              f"({m['gain']:+.3f} over {m['tasks']:.0f} tasks attempted in both halves)")
    gains = [m["gain"] for m in matched.values()]
    print(f"task-matched gain over seeds: mean {np.mean(gains):+.3f}, range {min(gains):+.3f} .. {max(gains):+.3f}")
    print("| seed | " + " | ".join(f"step {i}" for i in range(args.steps)) + " |")
    print("|---|" + "---:|" * args.steps)
    for seed, figs in figures.items():
        print(f"| {seed} mismatch | " + " | ".join(f"{f['logprob_abs_diff']:.1e}" for f in figs) + " |")
        print(f"| {seed} signal rows | " + " | ".join(f"{f['rows_with_signal']:.0f}/{f['rows_trained']:.0f}"
                                                   for f in figs) + " |")
        print(f"| {seed} zero-var skipped | " + " | ".join(f"{f['groups_skipped_zero_variance']:.0f}"
                                                       for f in figs) + " |")
    for seed, c in commands.items():
        print(f"seed {seed}: successes {c['early_successes']:.0f} (first half) / {c['late_successes']:.0f} (second); "
              f"commands per success {c['early_commands_mean']:.2f} -> {c['late_commands_mean']:.2f}; "
              f"second-half successes with one command {c['late_one_command_frac']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
