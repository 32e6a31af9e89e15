"""The GRPO training step on a DeepSpeed engine (ZeRO, gloo on CPU, NCCL on GPU).

One step reads trajectory rows, keeps the eligible ones (not ``infra_failure``, not ``unknown``),
computes group advantages, and runs micro-batches with a global token denominator, then one
optimizer step. Token logprobs are those of the distribution the rollout engine sampled from
(temperature, top-k, top-p: ``infra.train.grpo.sampling_logprobs``). Logits are computed only at
positions in the loss (sampled tokens): the ``(B, T, V)`` logits of prompts and observations would
dominate memory. Gradient accumulation
is caller-owned (``managed_gradient_accumulation=false``): each micro-batch's loss is already
divided by the step's token count, so DeepSpeed must not rescale it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from infra.net import free_port
from infra.train.grpo import (
    divergence_row_weights,
    group_advantages,
    row_divergence,
    sampling_logprobs,
    sampling_truncation_on,
    tis_policy_loss,
)

EXCLUDED_OUTCOMES = ("infra_failure", "unknown")


def _skip_shm_comm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory all-reduce op for a one-rank group.

    The op reduces across ranks on one host; with one rank there is nothing to reduce, and building it is
    a C++ compile on a machine without the torch-extensions cache. ``TorchBackend`` builds it only when
    ``deepspeed.ops.__compatible_ops__`` marks it compatible (``deepspeed/comm/torch.py: build_shm_op``);
    that dict is cached in the module so that edits persist, and gloo's all-reduce is the fallback.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


_PER_TOKEN = ("token_ids", "loss_mask", "rollout_logprobs", "policy_versions")


def split_segments(rows: list[dict], adv: np.ndarray) -> tuple[list[dict], np.ndarray, list[int]]:
    """Each row's segments as rows of their own, with the row's advantage (rows of one segment as they are).

    A segment (``segment_starts``, see ``infra.store.Trajectory``) is one token sequence the engine
    received and sampled on, so the trainer scores it with nothing before it in context, as the engine
    did. The episode's advantage applies to every segment (as step-wise training does: SkyRL, rLLM).
    A row with no tokens to predict (it ended before its first engine call) keeps its place in the
    group's advantages but yields no sequence.

    Returns:
        (segment rows, advantages, origin): ``adv`` float64 of shape (S,), ``origin[j]`` the index in ``rows``
        of segment row ``j``.
    """
    out, out_adv, origin = [], [], []
    for k, (r, a) in enumerate(zip(rows, adv, strict=True)):
        starts = list(r.get("segment_starts") or [0])
        n = len(r["token_ids"])
        for lo, hi in zip(starts, [*starts[1:], n], strict=True):
            if hi - lo < 2:  # nothing to predict (an episode that ended before its first call): no sequence
                continue
            out.append(r if len(starts) == 1 else {**r, **{c: r[c][lo:hi] for c in _PER_TOKEN}, "segment_starts": [0]})
            out_adv.append(a)
            origin.append(k)
    return out, np.asarray(out_adv, dtype=np.float64), origin


def eligible_rows(rows: list[dict]) -> list[dict]:
    """Rows that enter the gradient: infra failures and unverifiable episodes are left out."""
    return [r for r in rows if r["outcome"] not in EXCLUDED_OUTCOMES]


class GRPOTrainer:
    """A policy model wrapped in a DeepSpeed engine, trained one GRPO step at a time."""

    def __init__(self, model_dir: str, lr: float, zero_stage: int, grad_clip: float, micro_batch_rows: int,
                 tis_cap: float, temperature: float, top_p: float, top_k: int, scale_by_std: bool,
                 mask_truncated: bool,
                 max_seq_len: int, tis_level: str = "token", mask_ratio_low: float | None = None,
                 mask_ratio_high: float | None = None, forward_dtype: str = "float32", baseline: str = "mean",
                 divergence_threshold: float | None = None, divergence_estimator: str = "k3",
                 divergence_action: str = "drop"):
        """Load the HF model in float32 and build the engine (AdamW, fp32 master weights).

        ``temperature``, ``top_p`` and ``top_k`` are the rollout's sampling parameters (``top_p`` 1 and
        ``top_k`` 0 off): the trainer's logprobs are those of the same truncated, renormalised
        distribution, so the importance ratio is 1 at unchanged weights.

        ``forward_dtype="bfloat16"`` runs forward and backward in bf16 (DeepSpeed ``bf16``), matching a
        bf16 rollout engine, while the optimizer keeps fp32 master weights. Initializes
        torch.distributed (gloo on CPU) for a single process when it is not initialized yet.
        With ``divergence_threshold``, each row's KL estimate (``divergence_estimator``, trainer side)
        sets its weight (``divergence_action``, see ``divergence_row_weights``); the decision per row
        of the last step is in ``last_row_decisions``.

        Raises:
            ValueError: an unknown divergence estimator or action, ``top_k < 0`` or ``top_p`` outside ``(0, 1]``,
                or ZeRO stage 0 with a bf16 forward.
        """
        if divergence_estimator not in ("k1", "k3") or divergence_action not in ("drop", "downweight"):
            raise ValueError(f"divergence estimator {divergence_estimator!r} / action {divergence_action!r} unknown")
        if zero_stage == 0 and forward_dtype == "bfloat16":
            # DeepSpeed then wraps AdamW in FP16_UnfusedOptimizer, whose fp32 master weights neither
            # safe_get_full_fp32_param (update_norm) nor zero_to_fp32 (export) can read (measured: export raises)
            raise ValueError("zero_stage 0 with forward_dtype 'bfloat16' is not supported (the fp32 master weights "
                             "cannot be read back for export or update_norm); use zero_stage >= 1")
        sampling_truncation_on(top_k, top_p, 1)  # validates them
        import deepspeed
        import torch
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        # A single process: DeepSpeed reads these even when vLLM already set up the (gloo) group.
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        if not torch.cuda.is_available() and os.environ["WORLD_SIZE"] == "1":
            _skip_shm_comm_op()
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.config.use_cache = False
        config = {
            "train_micro_batch_size_per_gpu": micro_batch_rows,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            "zero_optimization": {"stage": zero_stage},
            "gradient_clipping": grad_clip,
            "steps_per_print": 10**9,
            "bf16": {"enabled": forward_dtype == "bfloat16"},
        }
        self.forward_dtype = forward_dtype
        self.baseline = baseline
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
        self.engine, _, _, _ = deepspeed.initialize(model=self.model, optimizer=optimizer, config=config)
        self.micro_batch_rows = micro_batch_rows
        self.tis_cap, self.temperature, self.top_p, self.top_k = tis_cap, temperature, top_p, top_k
        self.tis_level, self.mask_ratio_low, self.mask_ratio_high = tis_level, mask_ratio_low, mask_ratio_high
        self.scale_by_std, self.mask_truncated = scale_by_std, mask_truncated
        self.max_seq_len = max_seq_len
        self.divergence = (divergence_threshold, divergence_estimator, divergence_action)
        self.last_row_decisions: list[dict] = []
        self.pad_id = self.model.config.pad_token_id or 0
        self.steps_done = 0

    def step(self, rows: list[dict]) -> dict[str, float]:
        """Run one GRPO step on ``rows`` (trajectory rows as stored).

        Returns:
            Metrics: ``rows_trained``, ``rows_with_signal`` (non-zero advantage), ``segments_trained``
            (token sequences scored: a row's segments, see :func:`split_segments`), ``optimizer_step``
            (0 when no row carries signal: the step is skipped rather than moving weights on
            optimizer momentum alone), ``loss_tokens``, ``loss``, ``grad_norm``, ``logprob_abs_diff``
            (mean |trainer - rollout| logprob), ``kl_k1``, ``kl_k3``, ``tis_capped_frac``, ``tis_masked_frac``
            (of loss tokens), ``unkept_frac`` (of loss tokens: outside the trainer's top-k/top-p set,
            weight 0, see ``tis_policy_loss``), ``ratio_p05/p50/p95`` (token ratios trainer/rollout),
            ``missing_logprobs``, ``rows_dropped_divergence``, ``rows_downweighted_divergence``,
            ``update_norm``, ``train_s``. ``update_norm`` is ``||theta_after - theta_before||_2`` over all
            trainable parameters, the fp32 master weights (DeepSpeed's ``safe_get_full_fp32_param``; the
            module's own parameters at ZeRO 0 in fp32), snapshotted around ``engine.step()``; 0.0 when
            the optimizer step is skipped.
        """
        import torch

        start = time.monotonic()
        episodes = eligible_rows(rows)
        adv = group_advantages(np.array([r["reward"] for r in episodes], dtype=np.float64),
                               [r["group_id"] for r in episodes], scale_by_std=self.scale_by_std,
                               baseline=self.baseline)
        rows, adv, origin = split_segments(episodes, adv)
        masks = []
        for r in rows:
            m = np.asarray(r["loss_mask"][: self.max_seq_len], dtype=np.float32)
            if self.mask_truncated and r["stop_reason"] == "length":
                m = np.zeros_like(m)
            masks.append(m[1:])  # position 0 is never predicted
        total_tokens = int(sum(m.sum() for m in masks))
        self.last_row_decisions = []
        sums = dict.fromkeys(("tokens", "abs_diff", "k1", "k3", "capped", "masked", "missing", "unkept"), 0.0)
        ratios = []
        loss_value = 0.0
        self.engine.train()
        # Rows with a zero advantage add exactly zero to the gradient; they keep their tokens in the
        # denominator and get a forward pass without autograd, for the mismatch metrics only.
        by_len = sorted(range(len(rows)), key=lambda i: len(rows[i]["token_ids"]))
        grad_rows = [i for i in by_len if adv[i] != 0.0]
        zero_rows = [i for i in by_len if adv[i] == 0.0]
        for group, with_grad in ((grad_rows, True), (zero_rows, False)):
            for lo in range(0, len(group), self.micro_batch_rows):
                idx = group[lo: lo + self.micro_batch_rows]
                with torch.set_grad_enabled(with_grad):
                    loss, m, r = self._micro_batch(rows, idx, masks, adv, total_tokens)
                ratios.append(r.detach())
                if with_grad:
                    self.engine.backward(loss, scale_wrt_gas=False)
                loss_value += float(loss.detach())
                for k in sums:
                    sums[k] += m[k]
        update_norm = 0.0
        if grad_rows:
            before = self._fp32_params()
            self.engine.step()
            self.steps_done += 1
            update_norm = self._update_norm(before)
        grad_norm = self.engine.get_global_grad_norm()
        tokens = max(sums["tokens"], 1.0)
        all_ratios = torch.cat(ratios).numpy() if ratios else np.zeros(0)
        q05, q50, q95 = np.quantile(all_ratios, [0.05, 0.5, 0.95]) if all_ratios.size else (1.0, 1.0, 1.0)
        return {
            "rows_trained": float(len(episodes)),
            "rows_with_signal": float(len({origin[i] for i in grad_rows})),
            "segments_trained": float(len(rows)),
            "optimizer_step": float(bool(grad_rows)),
            "loss_tokens": float(total_tokens),
            "loss": loss_value,
            "grad_norm": float(grad_norm) if grad_rows and grad_norm is not None else 0.0,
            "logprob_abs_diff": sums["abs_diff"] / tokens,
            "kl_k1": sums["k1"] / tokens,
            "kl_k3": sums["k3"] / tokens,
            "tis_capped_frac": sums["capped"] / max(total_tokens, 1),
            "tis_masked_frac": sums["masked"] / max(total_tokens, 1),
            "unkept_frac": sums["unkept"] / max(total_tokens, 1),
            "ratio_p05": float(q05), "ratio_p50": float(q50), "ratio_p95": float(q95),
            "missing_logprobs": sums["missing"],
            "rows_dropped_divergence": float(sum(d["decision"] == "drop" for d in self.last_row_decisions)),
            "rows_downweighted_divergence": float(sum(d["decision"] == "downweight" for d in self.last_row_decisions)),
            "update_norm": update_norm,
            "train_s": time.monotonic() - start,
        }

    def _fp32_params(self) -> list:
        """A float32 copy of every trainable parameter (the optimizer's master weights), in ``parameters()`` order."""
        import torch
        from deepspeed.utils import safe_get_full_fp32_param

        out = []
        for p in self.engine.module.parameters():
            if p.requires_grad:
                full = safe_get_full_fp32_param(p)  # None at ZeRO 0 in fp32: the module's parameter is the master
                if full is None and p.dtype != torch.float32:
                    raise RuntimeError(f"no fp32 master weight readable for a {p.dtype} parameter")
                out.append((p.detach() if full is None else full).float().clone())
        return out

    def _update_norm(self, before: list) -> float:
        """``||theta_now - before||_2`` (fp32 differences, summed in float64)."""
        import torch

        total = torch.zeros((), dtype=torch.float64)
        for b, a in zip(before, self._fp32_params(), strict=True):
            total += (a - b).double().square().sum()
        return float(total.sqrt())

    def _micro_batch(self, rows: list[dict], idx: list[int], masks: list[np.ndarray], adv: np.ndarray,
                     total_tokens: int):
        """Loss and metric sums of rows ``idx`` (padded to the longest; logits only at loss positions)."""
        import torch

        width = max(min(len(rows[i]["token_ids"]), self.max_seq_len) for i in idx)
        ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width - 1))
        rollout = torch.zeros((len(idx), width - 1))
        for b, i in enumerate(idx):
            toks = rows[i]["token_ids"][: self.max_seq_len]
            n = len(toks)
            ids[b, :n] = torch.tensor(toks)
            attn[b, :n] = 1
            mask[b, : n - 1] = torch.from_numpy(masks[i])
            lp = np.asarray(rows[i]["rollout_logprobs"][: self.max_seq_len], dtype=np.float32)
            rollout[b, : n - 1] = torch.from_numpy(lp[1:])
        row_ids = torch.arange(len(idx))[:, None].expand_as(mask)[mask.bool()]
        hidden = self.engine.module.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state
        sel = mask.bool()
        logits = self.engine.module.get_output_embeddings()(hidden[:, :-1][sel])  # (N, V)
        lp, kept = sampling_logprobs(logits, ids[:, 1:][sel], self.temperature, self.top_k, self.top_p)
        row_adv = torch.from_numpy(adv[idx])[:, None].expand_as(mask)[sel]
        # a token outside the kept set has no finite log ratio: left out of the KL estimates (counted in unkept)
        known_rollout = torch.where(kept, rollout[sel], torch.full_like(rollout[sel], float("nan")))
        row_weight = self._divergence_decisions(rows, idx, lp, known_rollout, row_ids)
        return tis_policy_loss(lp, rollout[sel], row_adv, mask[sel], total_tokens, self.tis_cap, level=self.tis_level,
                               row_ids=row_ids, mask_low=self.mask_ratio_low, mask_high=self.mask_ratio_high,
                               row_weight=row_weight, kept=kept)

    def _divergence_decisions(self, rows: list[dict], idx: list[int], lp, rollout, row_ids):
        """Per-row KL estimates of this micro-batch, recorded with the decision; the row weights (None: off)."""
        threshold, estimator, action = self.divergence
        k1, k3, known = row_divergence(lp, rollout, row_ids, len(idx))
        weight = None
        if threshold is not None:
            weight = divergence_row_weights(k3 if estimator == "k3" else k1, threshold, action)
        for b, i in enumerate(idx):
            w = 1.0 if weight is None else float(weight[b])
            self.last_row_decisions.append({
                "episode_id": rows[i].get("episode_id", ""), "group_id": rows[i]["group_id"],
                "kl_k1": float(k1[b]), "kl_k3": float(k3[b]), "known_tokens": int(known[b]), "weight": w,
                "decision": "keep" if w == 1.0 else ("drop" if w == 0.0 else "downweight")})
        return weight

    def close(self) -> None:
        """Free the engine and release DeepSpeed's cached process groups, so a later trainer in this process starts.

        DeepSpeed caches a clone of the world group; the in-process vLLM engine's shutdown destroys the
        world it belongs to, and a new trainer would then fail on the stale clone ("Group ... is not
        registered"). DeepSpeed's own world teardown releases them the same way (``deepspeed.comm``).
        """
        from deepspeed.utils import groups

        self.engine = self.model = None
        groups._release_process_group_references(None)

    def save_state(self, directory: Path, tag: str) -> None:
        """Save weights and optimizer state (DeepSpeed checkpoint) so a resumed run continues exactly."""
        self.engine.save_checkpoint(str(directory), tag=tag, client_state={"steps_done": self.steps_done})

    def load_state(self, directory: Path, tag: str) -> None:
        """Restore what :meth:`save_state` wrote (weights, optimizer moments, step counters).

        Raises:
            FileNotFoundError: no checkpoint with that tag in ``directory``.
        """
        if not (directory / tag).is_dir():
            raise FileNotFoundError(f"{directory / tag}: no trainer state saved under this tag")
        _, client_state = self.engine.load_checkpoint(str(directory), tag=tag)
        self.steps_done = int((client_state or {}).get("steps_done", 0))

    def fp32_state_dict(self) -> dict:
        """Full float32 weights, whatever the ZeRO stage and forward dtype.

        ZeRO <= 2 in fp32: the module's own parameters. Otherwise (bf16 forward, or ZeRO-3
        partitions) the fp32 master weights through DeepSpeed's converter
        (``get_fp32_state_dict_from_zero_checkpoint``), from a temporary checkpoint.
        """
        import tempfile

        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        if self.forward_dtype == "float32" and self.engine.zero_optimization_stage() <= 2:
            return {k: v.detach().clone() for k, v in self.engine.module.state_dict().items()}
        with tempfile.TemporaryDirectory() as tmp:
            self.engine.save_checkpoint(tmp, tag="export")
            return get_fp32_state_dict_from_zero_checkpoint(tmp, tag="export")

    def export(self, out_dir: Path) -> Path:
        """Write the current fp32 weights as an HF safetensors folder; tied embeddings stay tied.

        The folder loads with strict key matching (``from_pretrained`` reports no missing or
        unexpected keys).

        Raises:
            RuntimeError: the state dict does not match the model's keys (beyond a tied lm_head).
        """
        import torch
        from transformers import AutoModelForCausalLM

        state = self.fp32_state_dict()
        with torch.device("meta"):
            clean = AutoModelForCausalLM.from_config(self.model.config, dtype=torch.float32)
        result = clean.load_state_dict(state, strict=False, assign=True)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if set(result.missing_keys) - tied or result.unexpected_keys:
            raise RuntimeError(f"export: missing {result.missing_keys}, unexpected {result.unexpected_keys}")
        clean.tie_weights()
        out_dir.mkdir(parents=True, exist_ok=True)
        clean.save_pretrained(out_dir, safe_serialization=True)
        return out_dir
