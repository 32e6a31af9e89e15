"""GRPO math: group-relative advantages, tempered token logprobs, the TIS-corrected token loss.

Notation: ``R`` rows (episodes), ``B`` rows in a micro-batch, ``T`` tokens, ``V`` vocabulary.
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

    Matches what the rollout engine sampled from (vLLM processed logprobs), so the importance
    ratio is 1 at unchanged weights. The caller aligns positions: the logits that predict
    ``targets[i]`` are ``logits[i]`` (for a sequence, logits at ``t`` predict token ``t + 1``).

    Args:
        logits: ``(..., V)`` float, any leading shape ``S``.
        targets: ``S`` int64.
        temperature: > 0.

    Returns:
        ``S`` float32.
    """
    scaled = logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


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
                    mask_high: float | None = None,
                    row_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
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

    Returns:
        (loss scalar; metric sums over this micro-batch: ``tokens`` (known), ``abs_diff``, ``k1``, ``k3``,
        ``capped``, ``masked``, ``missing``, divide by ``tokens`` for means; the token ratios at known
        positions, 1-D, for quantiles).

    Raises:
        ValueError: unknown ``level``, or sequence level without ``row_ids``.
    """
    mask = mask.float()
    known = mask * (~torch.isnan(rollout_logprobs)).float()
    rollout = torch.nan_to_num(rollout_logprobs, nan=0.0)
    log_ratio = (logprobs.detach() - rollout) * known  # log pi_trainer/pi_rollout, 0 where unknown
    ratio = torch.exp(log_ratio)
    if level == "token":
        weight_ratio = ratio
    elif level == "sequence":
        if row_ids is None:
            raise ValueError("sequence-level importance sampling needs row_ids")
        flat_ids = row_ids.reshape(-1)
        seq_log = torch.zeros(int(flat_ids.max()) + 1 if flat_ids.numel() else 0, dtype=log_ratio.dtype)
        seq_log.index_add_(0, flat_ids, log_ratio.reshape(-1))
        weight_ratio = torch.exp(seq_log.clamp(max=50.0))[flat_ids].reshape(log_ratio.shape)
    else:
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    weight = torch.clamp(weight_ratio, max=tis_cap)
    outside = torch.zeros_like(weight, dtype=torch.bool)
    if mask_low is not None:
        outside |= weight_ratio < mask_low
    if mask_high is not None:
        outside |= weight_ratio > mask_high
    weight = torch.where(outside, torch.zeros_like(weight), weight)
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
        "capped": float(((weight_ratio > tis_cap) & ~outside).float().mul(mask).sum()),
        "masked": float((outside.float() * mask).sum()),
        "missing": float((mask - known).sum()),
    }
    return loss, metrics, ratio[known.bool()]
