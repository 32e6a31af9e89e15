"""The GRPO training step on a DeepSpeed engine (ZeRO, gloo on CPU, NCCL on GPU).

One step reads trajectory rows, keeps the eligible ones (not ``infra_failure``, not ``unknown``),
computes group advantages, and runs micro-batches with a global token denominator, then one
optimizer step. Token logprobs are those of the distribution the rollout engine sampled from
(temperature, top-k, top-p: ``infra.train.grpo.sampling_logprobs``). Logits are computed only at
positions in the loss (sampled tokens): the ``(B, T, V)`` logits of prompts and observations would
dominate memory. Gradient accumulation
is caller-owned (``managed_gradient_accumulation=false``): each micro-batch's loss is already
divided by the step's token count, so DeepSpeed must not rescale it.

Data parallel (``WORLD_SIZE`` > 1, one process per rank, ``torch.distributed`` set up from the usual
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``): every rank gets the whole step's rows, computes
the same advantages and token count, and trains its share (:func:`shard_rows`). DeepSpeed averages
gradients over the data-parallel world, so each rank's backward loss is multiplied by the world size:
the step's gradient is then ``sum over all loss tokens / N`` as on one rank. Every rank runs the same
number of micro-batches (a short rank repeats one of its rows with weight 0), since ZeRO-2 reduces and
ZeRO-3 gathers inside each backward and forward.
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
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory all-reduce op.

    The op serves only ``inference_all_reduce`` among ranks of one host (training collectives go through
    ``torch.distributed``); ranks here may sit on different machines, and building it is a C++ compile on
    a machine without the torch-extensions cache. ``TorchBackend`` builds it only when
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


def shard_rows(indices: list[int], lengths: list[int], world_size: int) -> list[list[int]]:
    """Split row indices over ranks with balanced token counts (longest first, each to the lightest rank).

    Deterministic: every rank computes the same shards from the same rows (ties go to the lower rank).
    Each shard keeps the order of ``indices``.

    Returns:
        ``world_size`` lists of indices, their union ``indices``.
    """
    load, owner = [0] * world_size, {}
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += lengths[i]
    return [[i for i in indices if owner[i] == r] for r in range(world_size)]


def _read_folder(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by its relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _write_folder(folder: Path, files: dict[str, bytes], keep_existing: bool) -> None:
    """Write :func:`_read_folder`'s output under ``folder`` (a file already there stays, with ``keep_existing``)."""
    for rel, data in files.items():
        path = folder / rel
        if keep_existing and path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


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
                 divergence_action: str = "drop", world_size: int = 1, master: str | None = None,
                 ranks_timeout_s: float = 600.0, model_config: dict | None = None, command_group=None):
        """Load the HF model in float32 and build the engine (AdamW, fp32 master weights).

        With ``world_size`` > 1 this process is rank 0 of a data-parallel group whose other ranks run
        ``python -m infra.train.ranks`` (see there): it binds ``master`` (``host:port``, an address the
        other ranks reach), waits up to ``ranks_timeout_s`` for them, and sends them these arguments and
        the model's config (they start from its config, DeepSpeed broadcasts rank 0's weights).
        ``model_dir=None`` with ``model_config`` and their ``command_group`` is how those ranks build theirs.

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
                ZeRO stage 0 with a bf16 forward, or ``world_size`` > 1 in a process whose torch.distributed
                group is already set up with another size (an in-process vLLM engine's).
            RuntimeError: the other ranks did not join within ``ranks_timeout_s``.
        """
        hyper = {k: v for k, v in locals().items()
                 if k not in ("self", "model_dir", "world_size", "master", "ranks_timeout_s", "model_config",
                              "command_group")}
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

        from infra.train.ranks import RANK_ENV, join_ranks

        if not torch.cuda.is_available():
            _skip_shm_comm_op()
        # a group this trainer starts is its own: close() ends it and restores the environment it set
        self._owns_group = not dist.is_initialized()
        self._env_before = {k: os.environ.get(k) for k in RANK_ENV} if self._owns_group else {}
        self._commands = command_group
        if world_size > 1 and not dist.is_initialized():
            self._commands = join_ranks(0, world_size, master or "", ranks_timeout_s)
        elif world_size > 1 and dist.get_world_size() != world_size:
            raise ValueError(f"world_size {world_size}: this process's torch.distributed group already has "
                             f"{dist.get_world_size()} rank(s) (an in-process engine's, or a trainer's not closed); "
                             "use engine.kind servers or remote")
        else:
            # A single process: DeepSpeed reads these even when vLLM already set up the (gloo) group.
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
                os.environ.setdefault(key, value)
            if not dist.is_initialized():
                os.environ.setdefault("MASTER_PORT", str(free_port()))
            deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if model_dir is None:  # a rank > 0: the architecture from rank 0, the weights by DeepSpeed's broadcast
            from transformers import AutoConfig

            config = AutoConfig.for_model(**model_config)
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            self._lead("init", hyper, self.model.config.to_dict())
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

    def step(self, rows: list[dict], policy_version: int | None = None) -> dict[str, float]:
        """Run one GRPO step on ``rows`` (trajectory rows as stored).

        ``policy_version``: the version of the weights this trainer holds (the served one); tokens sampled
        by it have lag 0, and their mismatch is reported apart (None: no token counts as lag 0).

        Returns:
            Metrics: ``rows_trained``, ``rows_with_signal`` (non-zero advantage), ``segments_trained``
            (token sequences scored: a row's segments, see :func:`split_segments`), ``optimizer_step``
            (0 when no row carries signal: the step is skipped rather than moving weights on
            optimizer momentum alone), ``loss_tokens``, ``loss``, ``grad_norm``, ``logprob_abs_diff``
            (mean |trainer - rollout| logprob), ``logprob_abs_diff_lag0`` (the same over lag-0 tokens only:
            numerical mismatch, not policy lag; 0.0 when none) and ``lag0_token_frac``, ``kl_k1``, ``kl_k3``,
            ``tis_capped_frac``, ``tis_masked_frac`` (of loss tokens), ``unkept_frac`` (of loss tokens: outside
            the trainer's top-k/top-p set, weight 0, see ``tis_policy_loss``), ``ratio_p05/p50/p95`` (token
            ratios trainer/rollout),
            ``missing_logprobs``, ``rows_dropped_divergence``, ``rows_downweighted_divergence``,
            ``update_norm``, ``train_s``. ``update_norm`` is ``||theta_after - theta_before||_2`` over all
            trainable parameters, the fp32 master weights (DeepSpeed's ``safe_get_full_fp32_param``; the
            module's own parameters at ZeRO 0 in fp32), snapshotted around ``engine.step()``; 0.0 when
            the optimizer step is skipped.
        """
        import torch

        self._lead("step", rows, policy_version)
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
        sums = dict.fromkeys(("tokens", "abs_diff", "k1", "k3", "capped", "masked", "missing", "unkept",
                              "tokens_lag0", "abs_diff_lag0"), 0.0)
        ratios = []
        loss_value = 0.0
        self.engine.train()
        # Rows with a zero advantage add exactly zero to the gradient; they keep their tokens in the
        # denominator and get a forward pass without autograd, for the mismatch metrics only.
        by_len = sorted(range(len(rows)), key=lambda i: len(rows[i]["token_ids"]))
        grad_rows = [i for i in by_len if adv[i] != 0.0]
        zero_rows = [i for i in by_len if adv[i] == 0.0]
        lengths = [len(r["token_ids"]) for r in rows]
        decisions: list[tuple[int, dict]] = []
        for group, with_grad in ((grad_rows, True), (zero_rows, False)):
            shards = shard_rows(group, lengths, self.world_size)
            mine, mb = shards[self.rank], self.micro_batch_rows
            for n in range(max(-(-len(s) // mb) for s in shards)):  # the same count on every rank
                idx, weight = mine[n * mb: (n + 1) * mb], 1.0
                if not idx:  # this rank ran out of rows: one of them again (or any), with weight 0
                    idx, weight = (mine or group)[:1], 0.0
                with torch.set_grad_enabled(with_grad):
                    loss, m, r, d = self._micro_batch(rows, idx, masks, adv, total_tokens, policy_version)
                if with_grad:  # DeepSpeed averages over ranks: times the world size, the sum is the 1-rank gradient
                    self.engine.backward(loss * (weight * self.world_size), scale_wrt_gas=False)
                if weight:
                    ratios.append(r.detach())
                    loss_value += float(loss.detach())
                    decisions += d
                    for k in sums:
                        sums[k] += m[k]
        if self.world_size > 1:
            sums, loss_value, ratios, decisions = self._gather(sums, loss_value, ratios, decisions)
        self.last_row_decisions = [d for _, d in sorted(decisions, key=lambda x: x[0])]
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
            "logprob_abs_diff_lag0": sums["abs_diff_lag0"] / max(sums["tokens_lag0"], 1.0),
            "lag0_token_frac": sums["tokens_lag0"] / tokens,
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

    def _lead(self, command: str, *args) -> None:
        """On rank 0 of several: have the other ranks run ``command`` with ``args`` (``infra.train.ranks``)."""
        if self.world_size > 1 and self.rank == 0:
            from infra.train.ranks import send_command

            send_command(self._commands, command, *args)

    def _gather(self, sums: dict, loss_value: float, ratios: list, decisions: list):
        """The step's metric sums, loss, ratios and row decisions of all ranks, on every rank."""
        import torch
        import torch.distributed as dist

        keys = list(sums)
        total = torch.tensor([sums[k] for k in keys] + [loss_value], dtype=torch.float64)
        dist.all_reduce(total)
        gathered: list = [None] * self.world_size
        local = torch.cat(ratios).numpy() if ratios else np.zeros(0, dtype=np.float32)
        dist.all_gather_object(gathered, (local, decisions))
        all_ratios = [torch.from_numpy(r) for r, _ in gathered if len(r)]
        return (dict(zip(keys, total[:-1].tolist(), strict=True)), float(total[-1]), all_ratios,
                [d for _, ds in gathered for d in ds])

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
                     total_tokens: int, policy_version: int | None = None):
        """Loss, metric sums, token ratios and ``(row index, decision)`` pairs of rows ``idx``.

        Rows are padded to the longest; logits only at loss positions. Tokens sampled by ``policy_version``
        count as lag 0 (``tokens_lag0``, ``abs_diff_lag0``).
        """
        import torch

        width = max(min(len(rows[i]["token_ids"]), self.max_seq_len) for i in idx)
        ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width - 1))
        rollout = torch.zeros((len(idx), width - 1))
        lag0 = torch.zeros((len(idx), width - 1), dtype=torch.bool)
        for b, i in enumerate(idx):
            toks = rows[i]["token_ids"][: self.max_seq_len]
            n = len(toks)
            ids[b, :n] = torch.tensor(toks)
            attn[b, :n] = 1
            mask[b, : n - 1] = torch.from_numpy(masks[i])
            lp = np.asarray(rows[i]["rollout_logprobs"][: self.max_seq_len], dtype=np.float32)
            rollout[b, : n - 1] = torch.from_numpy(lp[1:])
            if policy_version is not None:
                versions = np.asarray(rows[i]["policy_versions"][: self.max_seq_len])
                lag0[b, : n - 1] = torch.from_numpy(versions[1:] == policy_version)
        row_ids = torch.arange(len(idx))[:, None].expand_as(mask)[mask.bool()]
        hidden = self.engine.module.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state
        sel = mask.bool()
        logits = self.engine.module.get_output_embeddings()(hidden[:, :-1][sel])  # (N, V)
        lp, kept = sampling_logprobs(logits, ids[:, 1:][sel], self.temperature, self.top_k, self.top_p)
        row_adv = torch.from_numpy(adv[idx])[:, None].expand_as(mask)[sel]
        # a token outside the kept set has no finite log ratio: left out of the KL estimates (counted in unkept)
        known_rollout = torch.where(kept, rollout[sel], torch.full_like(rollout[sel], float("nan")))
        row_weight, decisions = self._divergence_decisions(rows, idx, lp, known_rollout, row_ids)
        loss, sums, ratios = tis_policy_loss(lp, rollout[sel], row_adv, mask[sel], total_tokens, self.tis_cap,
                                             level=self.tis_level, row_ids=row_ids, mask_low=self.mask_ratio_low,
                                             mask_high=self.mask_ratio_high, row_weight=row_weight, kept=kept)
        at_lag0 = lag0[sel] & ~torch.isnan(rollout[sel]) & kept  # the tokens tis_policy_loss counts, at lag 0
        diff = (lp.detach() - torch.nan_to_num(rollout[sel])).abs()
        sums = {**sums, "tokens_lag0": float(at_lag0.sum()), "abs_diff_lag0": float(diff[at_lag0].sum())}
        return loss, sums, ratios, decisions

    def _divergence_decisions(self, rows: list[dict], idx: list[int], lp, rollout, row_ids):
        """The row weights (None: off) and each row's ``(index, record)``: KL estimates and the decision."""
        threshold, estimator, action = self.divergence
        k1, k3, known = row_divergence(lp, rollout, row_ids, len(idx))
        weight = None
        if threshold is not None:
            weight = divergence_row_weights(k3 if estimator == "k3" else k1, threshold, action)
        decisions = []
        for b, i in enumerate(idx):
            w = 1.0 if weight is None else float(weight[b])
            decisions.append((i, {
                "episode_id": rows[i].get("episode_id", ""), "group_id": rows[i]["group_id"],
                "kl_k1": float(k1[b]), "kl_k3": float(k3[b]), "known_tokens": int(known[b]), "weight": w,
                "decision": "keep" if w == 1.0 else ("drop" if w == 0.0 else "downweight")}))
        return weight, decisions

    def close(self) -> None:
        """Free the engine and release DeepSpeed's cached process groups, so a later trainer in this process starts.

        DeepSpeed caches a clone of the world group; the in-process vLLM engine's shutdown destroys the
        world it belongs to, and a new trainer would then fail on the stale clone ("Group ... is not
        registered"). DeepSpeed's own world teardown releases them the same way (``deepspeed.comm``).
        A group this trainer started (one rank or several) is destroyed, so a later trainer in this
        process may use another world size.
        """
        from deepspeed.utils import groups

        self._lead("close")
        self.engine = self.model = None
        groups._release_process_group_references(None)
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():  # a later trainer in this process starts its own group
            dist.destroy_process_group()
        for key, value in self._env_before.items():  # nor reads this one's rank, world size or port
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def save_state(self, directory: Path, tag: str) -> None:
        """Save weights and optimizer state (DeepSpeed checkpoint) so a resumed run continues exactly.

        With several ranks, rank 0's ``directory / tag`` ends up holding every rank's files: the others
        save to a temporary folder and send theirs to rank 0 over the group, so one folder (which the
        run may copy to S3) restores the whole group on any machines.
        """
        import tempfile

        import torch.distributed as dist

        self._lead("save_state", directory, tag)
        with tempfile.TemporaryDirectory(prefix="agentrl-state-") as tmp:
            target = Path(directory) if self.rank == 0 else Path(tmp)
            self.engine.save_checkpoint(str(target), tag=tag, client_state={"steps_done": self.steps_done})
            if self.world_size == 1:
                return
            mine = {} if self.rank == 0 else _read_folder(target / tag)
            gathered = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0, group=self._commands)
            if self.rank == 0:
                for files in gathered[1:]:
                    _write_folder(target / tag, files, keep_existing=True)

    def load_state(self, directory: Path, tag: str) -> None:
        """Restore what :meth:`save_state` wrote (weights, optimizer moments, step counters).

        With several ranks, rank 0 sends the folder's files to the others (they need not have any).

        Raises:
            FileNotFoundError: no checkpoint with that tag in ``directory``.
        """
        import tempfile

        if self.rank == 0 and not (Path(directory) / tag).is_dir():
            raise FileNotFoundError(f"{Path(directory) / tag}: no trainer state saved under this tag")
        if self.world_size > 1 and self.rank == 0:
            self._lead("load_state", _read_folder(Path(directory) / tag), tag)
        with tempfile.TemporaryDirectory(prefix="agentrl-state-") as tmp:
            if self.rank != 0:  # ``directory`` is the files rank 0 sent
                _write_folder(Path(tmp) / tag, directory, keep_existing=False)
                directory = tmp
            _, client_state = self.engine.load_checkpoint(str(directory), tag=tag)
        self.steps_done = int((client_state or {}).get("steps_done", 0))

    def fp32_state_dict(self) -> dict:
        """Full float32 weights, whatever the ZeRO stage and forward dtype; a collective on every rank.

        ZeRO <= 2 in fp32: the module's own parameters. Otherwise (bf16 forward, or ZeRO-3 partitions)
        each parameter's fp32 master weight gathered from its partitions (DeepSpeed's
        ``safe_get_full_fp32_param``), with the module's persistent buffers; nothing goes to disk.
        """
        import torch
        from deepspeed.utils import safe_get_full_fp32_param

        self._lead("fp32_state_dict")
        module = self.engine.module
        if self.forward_dtype == "float32" and self.engine.zero_optimization_stage() <= 2:
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
        state = {}
        for name, p in module.named_parameters():
            full = safe_get_full_fp32_param(p)
            if full is None and p.dtype != torch.float32:
                raise RuntimeError(f"{name}: no fp32 master weight readable for a {p.dtype} parameter")
            state[name] = (p.detach() if full is None else full).float().clone()
        param_names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        state.update({k: v.detach().clone() for k, v in module.state_dict().items() if k not in param_names})
        return state

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
