"""Typed results of the stages and the step summary built from them.

Each stage returns one record (:class:`Selection`, :class:`RolloutStats`, :class:`TrainStats`,
:class:`PublishResult`, :class:`EvalResult`); :class:`StepSummary` joins one step's records and
renders them: the stored JSON and table row (flat keys, as stored since the first version, so older
summaries stay readable), namespaced metrics (``rollout/…``, ``train/…``, ``publish/…``, ``eval/…``,
``time/…``) and the step line. A new metric is a field of the record that produces it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

#: Scheduler batch metrics carried into the summary (async collector only), rounded to 3 decimals.
SCHEDULING_KEYS = ("episode_s_p50", "episode_s_p90", "episode_s_max", "straggler_tail_s", "engine_idle_s",
                   "generation_tokens_per_s", "prefix_cache_hit_rate", "groups_carried_in", "groups_dropped",
                   "groups_skipped_zero_variance", "groups_filled_zero_variance", "groups_refilled",
                   "zero_variance_wait_s", "sample_lag_mean", "sample_lag_max", "batch_samples", "groups_split",
                   "samples_carried", "remainder_parts", "remainders_cancelled", "dropped_stale_samples",
                   "dropped_stale_reward_mean")


#: Where an episode's wall time goes (:func:`episode_time_split`), in order; they sum to ``episode_s``.
EPISODE_PARTS = ("sandbox_acquire_s", "engine_queue_s", "prefill_s", "decode_s", "generation_other_s", "tool_s",
                 "verify_s", "overhead_s")


def egress_totals(rows: list[dict]) -> dict[str, float]:
    """The step's egress by phase (``agent``, ``verifier``), from the rows' ``egress_*`` columns.

    Keys: ``<phase>_requests``, ``<phase>_bytes``, ``<phase>_denied_rows`` (rows with a request the policy denied).
    """
    out: dict[str, float] = {}
    for phase in ("agent", "verifier"):
        out[f"{phase}_requests"] = float(sum(r.get(f"egress_{phase}_requests") or 0 for r in rows))
        out[f"{phase}_bytes"] = float(sum(r.get(f"egress_{phase}_bytes") or 0 for r in rows))
        out[f"{phase}_denied_rows"] = float(sum(bool(r.get(f"egress_{phase}_denied")) for r in rows))
    return out


def episode_time_split(rows: list[dict]) -> dict[str, float]:
    """Mean seconds per finished episode in each of :data:`EPISODE_PARTS`, and ``episode_s``; {} when none finished.

    From the trajectory columns: ``generation_other_s`` = ``generation_s`` - engine queue - prefill - decode
    (our side of a generate call: tokenization, the gateway); ``overhead_s`` = ``episode_s`` - acquire -
    generation - tools - verification (the harness and the runner). Rows that are ``infra_failure`` or carry
    no ``episode_s`` (written before it existed) are left out.
    """
    rows = [r for r in rows if r["outcome"] != "infra_failure" and (r.get("episode_s") or 0.0) > 0]
    if not rows:
        return {}
    total = dict.fromkeys((*EPISODE_PARTS, "episode_s"), 0.0)
    for r in rows:
        engine = r["engine_queue_s"] + r["prefill_s"] + r["decode_s"]
        parts = {"sandbox_acquire_s": r["sandbox_acquire_s"], "engine_queue_s": r["engine_queue_s"],
                 "prefill_s": r["prefill_s"], "decode_s": r["decode_s"],
                 "generation_other_s": max(0.0, r["generation_s"] - engine), "tool_s": r["tool_s"],
                 "verify_s": r["verify_s"], "episode_s": r["episode_s"],
                 "overhead_s": max(0.0, r["episode_s"] - r["sandbox_acquire_s"] - r["generation_s"] - r["tool_s"]
                                   - r["verify_s"])}
        for k, v in parts.items():
            total[k] += v
    return {k: v / len(rows) for k, v in total.items()}


@dataclass(frozen=True)
class Selection:
    """The step's training tasks (``infra.difficulty.select_tasks``) and the stage's seconds."""

    chosen: list[str]
    skipped: dict[str, str]
    revisited: list[str]
    pass_rates: dict[str, float]
    stage_s: float = 0.0


@dataclass(frozen=True)
class RolloutStats:
    """One step's stored rollouts: where, how many, how they ended, how long the batch took.

    ``scheduling``: the async collector's batch metrics (see ``AsyncCollector.next_batch``) plus
    ``generation_tokens_per_s``, ``engine_idle_s``, ``prefix_cache_hit_rate``, ``groups_dropped``,
    ``groups_submitted``, ``lag_hist_<k>`` (groups at lag k); empty for the sync collector.
    ``reused``: served from an earlier attempt of this step; ``stage_s``: this attempt's seconds.
    ``completion_tokens_mean`` (sampled tokens) and ``turns_mean``: per episode, over the rows that are not
    ``infra_failure`` (0.0 when none).
    """

    uri: str
    rows: int
    time_to_batch_s: float
    reward_mean: float
    outcomes: dict[str, int]
    infra_reasons: dict[str, int]
    retried: int
    sandbox_warm: int
    sandbox_acquire_p50_s: float
    bytes: int
    min_policy_version: int
    max_policy_version: int
    collected_at: float
    scheduling: dict[str, float] = field(default_factory=dict)
    reused: bool = False
    stage_s: float = 0.0
    completion_tokens_mean: float = 0.0
    turns_mean: float = 0.0
    verifier_tampered: int = 0
    """Rows whose verification found the agent had tampered with the verifier (``envs.tamper``): model
    failures with reward 0."""
    episode_time_s: dict[str, float] = field(default_factory=dict)
    """The mean episode's wall time by part (:func:`episode_time_split`)."""
    egress: dict[str, float] = field(default_factory=dict)
    """What the step's sandboxes sent out through the egress proxy (:func:`egress_totals`)."""
    policy_version_tokens: dict[int, int] = field(default_factory=dict)
    """Sampled tokens per policy version (the file's lineage: each version is an input of it)."""
    side_calls: int = 0
    """Gateway calls answered but not trained on, over the rows (their ``side_calls``)."""

    @property
    def policy_lag_hist(self) -> dict[int, int]:
        """Groups of the batch by policy lag in versions (async collector)."""
        return {int(k.rsplit("_", 1)[1]): int(v) for k, v in self.scheduling.items() if k.startswith("lag_hist_")}


@dataclass(frozen=True)
class TrainStats:
    """One GRPO step: the trainer's metrics (``GRPOTrainer.step``), the policy lag, the state save, seconds."""

    metrics: dict[str, float]
    policy_lag_max: float
    trainer_state_s: float
    trainer_state_restored: str
    stage_s: float = 0.0


@dataclass(frozen=True)
class PublishResult:
    """A version's way to the engine (``pattern``: the ``publish.kind``).

    ``version``: served after it (the old one when ``refused``); ``latency_s``: trainer done → engine
    serves it; ``pause_s``: engine served nothing; ``transfer_s``: fetch/pull/copy; ``upload_wait_s``:
    waiting on the previous version's background upload; ``stage_s``: the whole stage.
    """

    checkpoint: str
    version: int
    pattern: str
    pause_s: float
    transfer_s: float
    refused: str = ""
    latency_s: float = 0.0
    upload_wait_s: float = 0.0
    stage_s: float = 0.0


@dataclass(frozen=True)
class EvalResult:
    """An evaluation: the stored report (``infra.evaluate.eval_report`` plus settings) and seconds; None: skipped."""

    report: dict | None
    stage_s: float = 0.0


@dataclass(frozen=True)
class StepSummary:
    """One step's records and their renderings."""

    step: int
    selection: Selection
    batch: RolloutStats
    trained: TrainStats
    published: PublishResult
    evaluated: EvalResult

    @classmethod
    def of(cls, step: int, selection: Selection, batch: RolloutStats, trained: TrainStats,
           published: PublishResult, evaluated: EvalResult) -> StepSummary:
        """Join one step's stage records."""
        return cls(step, selection, batch, trained, published, evaluated)

    def to_json(self) -> dict:
        """The stored summary (``summaries/step-N.json``).

        The flat keys as stored since the first version (the table row, report and step line read
        these), plus ``metrics`` (:meth:`metrics`).
        """
        b, t, p, report = self.batch, self.trained, self.published, self.evaluated.report
        m = t.metrics
        out = {
            "step": self.step, "time_to_batch_s": round(b.time_to_batch_s, 2), "reward_mean": round(b.reward_mean, 4),
            "completion_tokens_mean": round(b.completion_tokens_mean, 2), "turns_mean": round(b.turns_mean, 2),
            "outcomes": b.outcomes, "infra_reasons": b.infra_reasons, "retried": b.retried,
            "verifier_tampered": b.verifier_tampered, "egress": dict(getattr(b, "egress", {})),
            "side_calls": getattr(b, "side_calls", 0),
            "episode_time_s": {k: round(v, 3) for k, v in getattr(b, "episode_time_s", {}).items()},
            "sandbox_warm": b.sandbox_warm, "sandbox_acquire_p50_s": round(b.sandbox_acquire_p50_s, 3),
            "rows": b.rows, "rollouts_reused": b.reused, "policy_lag_max": t.policy_lag_max,
            **{k: m[k] for k in ("logprob_abs_diff", "kl_k1", "kl_k3", "ratio_p05", "ratio_p95", "tis_capped_frac",
                                 "tis_masked_frac", "rows_with_signal", "optimizer_step")},
            "rows_trained": m.get("rows_trained", b.rows), "segments_trained": m.get("segments_trained", b.rows),
            "update_norm": m.get("update_norm"),
            **{k: m[k] for k in ("logprob_abs_diff_lag0", "lag0_token_frac") if k in m},
            "trainer_state_s": round(t.trainer_state_s, 2), "trainer_state_restored": t.trainer_state_restored,
            "checkpoint": p.checkpoint, "policy_version": p.version, "publish_pattern": p.pattern,
            "publish_latency_s": round(p.latency_s, 3), "upload_wait_s": round(p.upload_wait_s, 3),
            "reload_pause_s": round(p.pause_s, 3), "publish_transfer_s": round(p.transfer_s, 3),
            "checkpoint_refused": p.refused,
            "eval_pass_at_1": report.get("pass_at_1") if report else None,
            "eval_pass_at_k": report["pass_at_k"] if report else {},
            "eval_delta": report.get("compared_to", {}).get("pass_at_k_delta", {}) if report else {},
            "difficulty_s": round(self.selection.stage_s, 2), "rollout_s": round(b.stage_s, 2),
            "train_s": round(t.stage_s, 2), "publish_s": round(p.stage_s, 2),
            "eval_s": round(self.evaluated.stage_s, 2),
            "rows_dropped_divergence": m["rows_dropped_divergence"],
            "rows_downweighted_divergence": m["rows_downweighted_divergence"],
        }
        out.update({k: round(b.scheduling[k], 3) for k in SCHEDULING_KEYS if k in b.scheduling})
        out["policy_lag_hist"] = b.policy_lag_hist
        out["metrics"] = self.metrics()
        return out

    def metrics(self) -> dict[str, float]:
        """Every numeric figure of the records, by namespace: a new field of a record appears here by itself.

        ``rollout/…``, ``train/…``, ``publish/…``, ``eval/…``; ``time/<stage>_s`` from each record's ``stage_s``.
        """
        out: dict[str, float] = {}
        for space, record in (("difficulty", self.selection), ("rollout", self.batch), ("train", self.trained),
                              ("publish", self.published), ("eval", self.evaluated)):
            for k, v in asdict(record).items():
                if k == "stage_s":
                    out[f"time/{space}_s"] = float(v)
                elif isinstance(v, bool | int | float) and k != "collected_at":
                    out[f"{space}/{k}"] = float(v)
                elif isinstance(v, dict) and k in ("scheduling", "outcomes", "metrics", "egress"):
                    prefix = {"outcomes": f"{space}/outcome/", "egress": f"{space}/egress_"}.get(k, f"{space}/")
                    out.update({f"{prefix}{kk}": float(vv) for kk, vv in v.items()})
        if self.evaluated.report:
            out.update({f"eval/pass_at_{k}": float(v) for k, v in self.evaluated.report["pass_at_k"].items()})
        return out

    def line(self) -> str:
        """The step line printed to the terminal."""
        return format_summary(self.to_json())


def learning_verdict(s: dict) -> str:
    """Whether the step moved the weights, and why not, from a stored summary (first words of the step line).

    ``learned``: the optimizer stepped on rows with a non-zero advantage (GRPO: a group's rewards
    differ); ``update_norm`` is ||θ_after − θ_before|| (summaries from before it was recorded lack it).
    ``did not learn``: no row carried signal (every group's rewards were equal), so the step was skipped.
    """
    rows = s.get("rows_trained", s.get("rows", 0))
    signal = f"rows_with_signal={s['rows_with_signal']:.0f}/{rows:.0f}"
    if not s.get("optimizer_step"):
        return f"did not learn ({signal}: every group's rewards were equal, optimizer step skipped)"
    norm = f" update_norm={s['update_norm']:.2e}" if s.get("update_norm") is not None else ""
    return f"learned ({signal}{norm})"


def format_summary(s: dict) -> str:
    """One line per step for the terminal, from a stored summary (:meth:`StepSummary.to_json`)."""
    outcomes = " ".join(f"{k}={v}" for k, v in sorted(s["outcomes"].items()))
    infra = " ".join(f"{k}={v}" for k, v in sorted(s.get("infra_reasons", {}).items()))
    if infra:
        outcomes += f" infra_reasons({infra}) retried={s.get('retried', 0)}"
    if s.get("verifier_tampered"):
        outcomes += f" tampered={s['verifier_tampered']}"
    if (egress := s.get("egress") or {}).get("agent_requests") or egress.get("verifier_requests"):
        outcomes += (f" egress[agent={egress['agent_requests']:.0f} verifier={egress['verifier_requests']:.0f} "
                     f"denied_rows={egress['agent_denied_rows'] + egress['verifier_denied_rows']:.0f}]")
    if s.get("side_calls"):
        outcomes += f" side_calls={s['side_calls']}"
    pass1 = " ".join(f"pass@{k}={v:.3f}" for k, v in s.get("eval_pass_at_k", {}).items()) or "n/a"
    if s.get("eval_delta"):
        pass1 += " (vs previous: " + " ".join(f"{v:+.3f}" for v in s["eval_delta"].values()) + ")"
    return (f"step {s['step']}: {learning_verdict(s)} | time_to_batch={s['time_to_batch_s']:.1f}s "
            f"reward_mean={s['reward_mean']:.3f} "
            f"outcomes[{outcomes}] policy_lag_max={s['policy_lag_max']:.0f} "
            f"logprob_mismatch={s['logprob_abs_diff']:.2e} "
            + (f"(lag-0 tokens: {s['logprob_abs_diff_lag0']:.2e} over {s['lag0_token_frac']:.2f}) "
               if s.get("lag0_token_frac") else "")
            + f"kl_k3={s['kl_k3']:.1e} "
            f"ratio_p05/p95={s['ratio_p05']:.3f}/{s['ratio_p95']:.3f} capped={s['tis_capped_frac']:.3f} "
            f"masked={s['tis_masked_frac']:.3f} "
            f"checkpoint={s['checkpoint']} publish[{s.get('publish_pattern', 'storage')}] "
            f"latency={s.get('publish_latency_s', 0):.1f}s pause={s.get('reload_pause_s', 0):.2f}s "
            f"eval {pass1} "
            + (f"episode_s p50/p90/max={s['episode_s_p50']:.1f}/{s['episode_s_p90']:.1f}/{s['episode_s_max']:.1f} "
               f"straggler_tail={s['straggler_tail_s']:.1f}s engine_idle={s['engine_idle_s']:.1f}s "
               f"gen_tok/s={s['generation_tokens_per_s']:.0f} prefix_hit={s['prefix_cache_hit_rate']:.2f} "
               f"carried_in={s['groups_carried_in']:.0f} "
               f"lag_hist={s['policy_lag_hist']} " if "episode_s_p50" in s else "")
            + (f"sample_lag mean/max={s['sample_lag_mean']:.2f}/{s['sample_lag_max']:.0f} " if "sample_lag_mean" in s
               else "")
            + (f"partial split/carried/parts={s['groups_split']:.0f}/{s['samples_carried']:.0f}/"
               f"{s['remainder_parts']:.0f} " if "groups_split" in s else "")
            + (f"stale_cut={s['dropped_stale_samples']:.0f} reward {s['dropped_stale_reward_mean']:.3f} "
               if s.get("dropped_stale_reward_mean") is not None else "")
            + f"divergence drop/down={s.get('rows_dropped_divergence', 0):.0f}/"
            f"{s.get('rows_downweighted_divergence', 0):.0f} "
            f"(stages s: difficulty {s['difficulty_s']} rollout {s['rollout_s']} train {s['train_s']} "
            f"publish+load {s['publish_s']} eval {s['eval_s']})")
