"""The run report: a markdown page rebuilt after every step from the stored step summaries.

Top to bottom: a banner (:func:`banner`: what in the latest step, and in any earlier one, needs a look,
or that the latest step is all clear), the plots, and the narrow per-step table (:func:`narrow_table`,
the figures people scan; every stored figure is in the ``steps-all`` table artifact and the summaries).

Plots (matplotlib, Agg backend, dpi 80) are embedded as base64 PNG data URIs, which the Prefect UI
renders in a markdown artifact and any markdown viewer shows from the copy on S3 (``{run}/report.md``):
reward curve (and eval pass@k), policy-lag histogram of the last step, time-to-batch breakdown per step
(stage seconds), the mean episode's wall time by part per step (sandbox acquire, engine queue, prefill,
decode, tools, verification, overhead: ``episode_time_s``), trainer/rollout mismatch (mean |Δ logprob|,
KL k1 and k3), importance ratio (p05–p95 band, TIS capped and masked fractions) and episodes (mean
sampled tokens, turns). Every per-step plot has integer step ticks; a figure a summary lacks (older runs:
no tokens or turns) leaves a gap.
"""

from __future__ import annotations

import base64
import io
import math

from infra.layout import artifact_key
from infra.summary import EPISODE_PARTS, learning_verdict

STAGES = ("difficulty_s", "rollout_s", "train_s", "publish_s", "eval_s")

#: Columns of :func:`narrow_table`, in order.
NARROW_COLUMNS = ("step", "learned", "rows with signal", "reward mean", "success", "infra failures",
                  "time to batch (s)", "policy lag max", "logprob mismatch", "KL k3", "update norm",
                  "eval pass@1", "Δ pass@1", "checkpoint version")

#: Earlier steps listed in the banner (the most recent ones first); the rest are counted.
BANNER_EARLIER_MAX = 10


def attention(s: dict) -> list[str]:
    """What in one stored summary (:meth:`infra.summary.StepSummary.to_json`) needs a look; empty: all clear.

    One markdown line per finding, in this order: the step could not learn (``optimizer_step`` false
    or ``rows_with_signal`` 0, in :func:`~infra.summary.learning_verdict`'s words); infra failures
    among the batch's rows (``outcomes['infra_failure']`` or ``infra_reasons``); rows whose verifier
    was tampered with (``verifier_tampered``); a refused checkpoint (``checkpoint_refused``); groups
    the async collector dropped stale or after infra failures (``groups_dropped`` less
    ``groups_skipped_zero_variance``: dynamic sampling skipping zero-variance groups is its design,
    named only beside other drops); rows dropped for divergence (``rows_dropped_divergence``); rows
    whose egress a policy denied (``egress``).
    """
    out = []
    if not s["optimizer_step"]:
        out.append(learning_verdict(s))
    elif not s["rows_with_signal"]:
        out.append(f"no row carried signal, yet the optimizer stepped: {learning_verdict(s)}")
    reasons = s.get("infra_reasons") or {}
    failed = s["outcomes"].get("infra_failure", 0)
    if failed or reasons:
        why = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) or "no reason recorded"
        out.append(f"infra failures: {failed} of {s['rows']} rows ({why}), never trained on; "
                   f"{s.get('retried', 0)} rows are retry attempts")
    if s.get("verifier_tampered"):
        out.append(f"verifier tampered with: {s['verifier_tampered']} of {s['rows']} rows (reason `verifier_tampered`: "
                   "the agent changed the verifier's toolchain, tests or reward; scored 0, see the episodes)")
    egress = s.get("egress") or {}
    if denied := egress.get("agent_denied_rows", 0) + egress.get("verifier_denied_rows", 0):
        out.append(f"egress denied: {denied:.0f} of {s['rows']} rows asked for a host their policy does not allow "
                   "(agent or tests; see the episodes' egress lines, tasks.egress.allow / agent_allow)")
    if s.get("checkpoint_refused"):
        out.append(f"checkpoint refused: {s['checkpoint_refused']}; `{s['checkpoint']}` was not loaded, the "
                   f"engine still serves version {s['policy_version']} (eval skipped)")
    dropped, zero_variance = s.get("groups_dropped", 0), s.get("groups_skipped_zero_variance", 0)
    if dropped > zero_variance:
        m = s.get("metrics") or {}
        if "rollout/dropped_stale" in m and "rollout/dropped_infra" in m:  # counted since the previous batch
            parts = [(m["rollout/dropped_stale"], "stale (policy lag past `max_policy_lag`)"),
                     (m["rollout/dropped_infra"], "after infra failures (retries spent, or `infra_policy` drop)")]
        else:  # a summary without the scheduler's counters
            parts = [(dropped - zero_variance, "stale or after infra failures")]
        parts.append((zero_variance, "zero-variance (skipped by dynamic sampling)"))
        named = ", ".join(f"{n:.0f} {why}" for n, why in parts if n)
        out.append(f"{dropped:.0f} groups dropped since the previous batch, never trained on: {named}; "
                   f"their rows are in `dropped/step-{s['step']:06d}.parquet`")
    if s.get("rows_dropped_divergence"):
        out.append(f"{s['rows_dropped_divergence']:.0f} rows dropped for divergence (per-row KL estimate past "
                   f"`train.divergence_threshold`), {s.get('rows_downweighted_divergence', 0):.0f} downweighted")
    return out


def banner(rows: list[dict]) -> list[str]:
    """Markdown blockquote lines: what needs a look in the latest step and in earlier ones.

    The latest step's :func:`attention` findings (or an all-clear line), then the earlier steps with
    findings, most recent first, at most :data:`BANNER_EARLIER_MAX` (the rest counted).

    Args:
        rows: stored summaries sorted by step (at least one).
    """
    last = rows[-1]
    found = attention(last)
    if found:
        lines = [f"> ⚠️ **Step {last['step']} needs a look**", *(f"> - {f}" for f in found)]
    else:
        lines = [f"> ✅ **Step {last['step']}: all clear**: {learning_verdict(last)}; no infra failures, "
                 "dropped groups or refused checkpoint"]
    earlier = [(s["step"], f) for s in rows[:-1] if (f := attention(s))]
    if earlier:
        lines += [">", f"> ⚠️ **{len(earlier)} earlier step(s) need a look**"]
        lines += [f"> - step {step}: " + "; ".join(f) for step, f in reversed(earlier[-BANNER_EARLIER_MAX:])]
        if len(earlier) > BANNER_EARLIER_MAX:
            lines.append(f"> - and {len(earlier) - BANNER_EARLIER_MAX} earlier step(s): see the table")
    return lines


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def narrow_table(summaries: list[dict]) -> list[dict[str, str]]:
    """One row per stored summary, in the given order: :data:`NARROW_COLUMNS` to display strings.

    ``rows with signal``: of the rows trained; ``success``/``infra failures``: rows by outcome;
    ``Δ pass@1``: against the previous evaluation; ``checkpoint version``: the version the engine serves
    after the step. ``n/a`` where a summary lacks the figure (no eval, no ``update_norm`` before it was
    recorded).
    """
    out = []
    for s in summaries:
        pass1 = s.get("eval_pass_at_1")
        if pass1 is None:
            pass1 = {str(k): v for k, v in (s.get("eval_pass_at_k") or {}).items()}.get("1")
        delta = {str(k): v for k, v in (s.get("eval_delta") or {}).items()}.get("1")
        version = str(s["policy_version"]) + (", new one refused" if s.get("checkpoint_refused") else "")
        values = (str(s["step"]), "yes" if s["optimizer_step"] else "no",
                  f"{s['rows_with_signal']:.0f}/{s.get('rows_trained', s['rows']):.0f}", f"{s['reward_mean']:.3f}",
                  str(s["outcomes"].get("success", 0)), str(s["outcomes"].get("infra_failure", 0)),
                  f"{s['time_to_batch_s']:.1f}", f"{s['policy_lag_max']:.0f}", f"{s['logprob_abs_diff']:.2e}",
                  f"{s['kl_k3']:.1e}", _fmt(s.get("update_norm"), ".2e"), _fmt(pass1, ".3f"), _fmt(delta, "+.3f"),
                  version)
        out.append(dict(zip(NARROW_COLUMNS, values, strict=True)))
    return out


def _series(rows: list[dict], key: str) -> list[float]:
    """``key`` per step as floats; NaN (a gap in the plot) where a summary lacks it or holds None."""
    return [math.nan if s.get(key) is None else float(s[key]) for s in rows]


def _per_step(ax, steps: list[int], title: str, ylabel: str = "", values: list[float] | None = None) -> None:
    """Label a per-step axis: every step of the run in range, integer step ticks; note when no ``values``."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)  # the run's steps, also where this figure has gaps
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # one step: one tick
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    if values is not None and all(math.isnan(v) for v in values):
        ax.set_yticks([])
        ax.text(0.5, 0.5, "not recorded\n(older summaries)", ha="center", va="center", transform=ax.transAxes)
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _plots(rows: list[dict]) -> dict[str, str]:
    """Alt text to PNG data URI, in report order (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, last, plots = [s["step"] for s in rows], rows[-1], {}

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(steps, _series(rows, "reward_mean"), marker="o", label="train reward mean")
    evals = [(s["step"], k, v) for s in rows for k, v in (s.get("eval_pass_at_k") or {}).items()]
    for k in sorted({k for _, k, _ in evals}, key=int):
        pts = [(st, v) for st, kk, v in evals if kk == k]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", linestyle="--", label=f"eval pass@{k}")
    ax.set(ylim=(-0.05, 1.05))
    _per_step(ax, steps, "Reward curve", "reward / pass rate")
    plots["reward curve"] = _png(fig)

    lag = {int(k): v for k, v in (last.get("policy_lag_hist") or {}).items()}
    fig, ax = plt.subplots(figsize=(4, 3))
    if lag:
        ax.bar([str(k) for k in sorted(lag)], [lag[k] for k in sorted(lag)])
    else:
        ax.text(0.5, 0.5, "no lag histogram\n(sync collector)", ha="center", va="center")
    ax.set(xlabel="policy lag (versions)", ylabel="groups", title=f"Policy lag, step {last['step']}")
    plots["policy lag histogram"] = _png(fig)

    fig, ax = plt.subplots(figsize=(6, 3))
    bottom = [0.0] * len(rows)
    for stage in STAGES:
        vals = [float(s.get(stage, 0.0)) for s in rows]
        ax.bar(steps, vals, bottom=bottom, label=stage.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.plot(steps, _series(rows, "time_to_batch_s"), color="black", marker="o", label="time to trainable batch")
    _per_step(ax, steps, "Where each step's time went", "seconds")
    plots["time to batch breakdown"] = _png(fig)

    fig, ax = plt.subplots(figsize=(6, 3))
    split = [s.get("episode_time_s") or {} for s in rows]
    bottom = [0.0] * len(rows)
    for part in EPISODE_PARTS:
        vals = [float(e.get(part, 0.0)) for e in split]
        ax.bar(steps, vals, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    _per_step(ax, steps, "Where an episode's time went (mean episode)", "seconds",
              values=[math.nan if not e else e["episode_s"] for e in split])
    plots["episode time breakdown"] = _png(fig)

    fig, (ax, kl) = plt.subplots(1, 2, figsize=(9, 3), layout="constrained")
    diff = [v if math.isnan(v) else max(v, 1e-12) for v in _series(rows, "logprob_abs_diff")]  # log scale
    ax.semilogy(steps, diff, marker="o", label="mean |Δ logprob|")
    _per_step(ax, steps, "Trainer / rollout mismatch")
    k1, k3 = _series(rows, "kl_k1"), _series(rows, "kl_k3")
    kl.plot(steps, k1, marker="o", label="KL k1")
    kl.plot(steps, k3, marker="s", label="KL k3")
    kl.set_yscale("symlog", linthresh=1e-6)  # k1 can be negative (unbiased, noisy); linear below 1e-6
    lo, hi = kl.get_ylim()
    kl.set_ylim(min(lo, -1e-6), max(hi, 1e-6))  # whole decades on the ticks, even for tiny values
    _per_step(kl, steps, "KL(π_rollout ‖ π_trainer)", values=k1 + k3)
    plots["mismatch and KL"] = _png(fig)

    fig, (ax, tis) = plt.subplots(1, 2, figsize=(9, 3), layout="constrained")
    p05, p95 = _series(rows, "ratio_p05"), _series(rows, "ratio_p95")
    ax.fill_between(steps, p05, p95, alpha=0.3, label="p05–p95")
    ax.plot(steps, p05, marker="v", linewidth=0.8)
    ax.plot(steps, p95, marker="^", linewidth=0.8)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    _per_step(ax, steps, "Importance ratio π_trainer / π_rollout (tokens)", values=p05 + p95)
    capped, masked = _series(rows, "tis_capped_frac"), _series(rows, "tis_masked_frac")
    tis.plot(steps, capped, marker="o", label="TIS capped")
    tis.plot(steps, masked, marker="s", label="masked")
    _per_step(tis, steps, "Loss tokens capped / masked", "fraction", values=capped + masked)
    plots["importance ratio"] = _png(fig)

    fig, (ax, turns) = plt.subplots(1, 2, figsize=(9, 3), layout="constrained")
    tokens, turn = _series(rows, "completion_tokens_mean"), _series(rows, "turns_mean")
    ax.plot(steps, tokens, marker="o")
    _per_step(ax, steps, "Response length", "sampled tokens / episode", values=tokens)
    turns.plot(steps, turn, marker="o")
    _per_step(turns, steps, "Turns", "turns / episode", values=turn)
    plots["episodes"] = _png(fig)
    return plots


def render_report(run_id: str, summaries: list[dict]) -> str:
    """Markdown for ``summaries`` (one stored summary per step, as ``post_train`` returns, any order).

    Raises:
        ValueError: ``summaries`` is empty.
    """
    if not summaries:
        raise ValueError(f"run {run_id}: no step summaries to report")
    rows = sorted(summaries, key=lambda s: s["step"])
    plots = _plots(rows)
    table = ["| " + " | ".join(NARROW_COLUMNS) + " |",
             "|" + "|".join("---" if c == "learned" else "---:" for c in NARROW_COLUMNS) + "|"]
    table += ["| " + " | ".join(r.values()) + " |" for r in narrow_table(rows)]
    return "\n".join([
        f"# post_train `{run_id}`: {len(rows)} step(s), last step {rows[-1]['step']}", "",
        *banner(rows), "",
        *(f"![{alt}]({uri})\n" for alt, uri in plots.items()), "",
        *table, "",
        f"Every stored figure per step: table artifact `{artifact_key(run_id, 'steps-all')}`, "
        "and `summaries/step-N.json`.", "",
    ])
