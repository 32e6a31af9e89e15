"""The run report: a markdown page with plots, rebuilt after every step from the stored step summaries.

Plots (matplotlib, Agg backend) are embedded as base64 PNG data URIs, which the Prefect UI renders
in a markdown artifact and any markdown viewer shows from the copy on S3 (``{run}/report.md``):
reward curve (and eval pass@k), policy-lag histogram of the last step, time-to-batch breakdown
per step (stage seconds), and trainer/rollout mismatch over steps.
"""

from __future__ import annotations

import base64
import io

STAGES = ("difficulty_s", "rollout_s", "train_s", "publish_s", "eval_s")


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def render_report(run_id: str, summaries: list[dict]) -> str:
    """Markdown for ``summaries`` (one dict per step, as ``post_train`` returns, any order).

    Raises:
        ValueError: ``summaries`` is empty.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not summaries:
        raise ValueError(f"run {run_id}: no step summaries to report")
    rows = sorted(summaries, key=lambda s: s["step"])
    steps = [s["step"] for s in rows]
    last = rows[-1]

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(steps, [s["reward_mean"] for s in rows], marker="o", label="train reward mean")
    evals = [(s["step"], k, v) for s in rows for k, v in (s.get("eval_pass_at_k") or {}).items()]
    for k in sorted({k for _, k, _ in evals}, key=int):
        pts = [(st, v) for st, kk, v in evals if kk == k]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", linestyle="--", label=f"eval pass@{k}")
    ax.set(xlabel="step", ylabel="reward / pass rate", ylim=(-0.05, 1.05), title="Reward curve")
    ax.legend(fontsize=8)
    reward_png = _png(fig)

    lag = {int(k): v for k, v in (last.get("policy_lag_hist") or {}).items()}
    fig, ax = plt.subplots(figsize=(4, 3))
    if lag:
        ax.bar([str(k) for k in sorted(lag)], [lag[k] for k in sorted(lag)])
    else:
        ax.text(0.5, 0.5, "no lag histogram\n(sync collector)", ha="center", va="center")
    ax.set(xlabel="policy lag (versions)", ylabel="groups", title=f"Policy lag, step {last['step']}")
    lag_png = _png(fig)

    fig, ax = plt.subplots(figsize=(6, 3))
    bottom = [0.0] * len(rows)
    for stage in STAGES:
        vals = [float(s.get(stage, 0.0)) for s in rows]
        ax.bar(steps, vals, bottom=bottom, label=stage.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.plot(steps, [s["time_to_batch_s"] for s in rows], color="black", marker="o", label="time to trainable batch")
    ax.set(xlabel="step", ylabel="seconds", title="Where each step's time went")
    ax.legend(fontsize=7, ncol=2)
    time_png = _png(fig)

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.semilogy(steps, [max(s["logprob_abs_diff"], 1e-12) for s in rows], marker="o", label="mean |Δ logprob|")
    ax.semilogy(steps, [max(s["kl_k3"], 1e-12) for s in rows], marker="s", label="KL k3")
    ax.set(xlabel="step", title="Trainer / rollout mismatch")
    ax.legend(fontsize=8)
    mismatch_png = _png(fig)

    table = ["| step | time to batch (s) | reward | outcomes | lag max | mismatch | eval | checkpoint |",
             "|---:|---:|---:|---|---:|---:|---|---|"]
    for s in rows:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items()))
        ev = " ".join(f"pass@{k} {v:.3f}" for k, v in (s.get("eval_pass_at_k") or {}).items()) or "n/a"
        table.append(f"| {s['step']} | {s['time_to_batch_s']:.1f} | {s['reward_mean']:.3f} | {outcomes} | "
                     f"{s['policy_lag_max']:.0f} | {s['logprob_abs_diff']:.2e} | {ev} | `{s['checkpoint']}` |")
    return "\n".join([
        f"# post_train `{run_id}`: {len(rows)} step(s), last step {last['step']}", "",
        f"![reward curve]({reward_png})", "",
        f"![policy lag histogram]({lag_png}) ![time to batch breakdown]({time_png})", "",
        f"![mismatch]({mismatch_png})", "",
        *table, "",
    ])
