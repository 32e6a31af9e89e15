"""GRPO math against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from infra.train.grpo import (
    OUTSIDE_KEPT_LOGPROB,
    divergence_row_weights,
    group_advantages,
    kept_tokens,
    row_divergence,
    sampling_logprobs,
    tis_policy_loss,
    token_logprobs,
)


def test_advantages_found_by_group_id_not_position():
    # [t1a, t2a, t1b, t2b], rewards [1, 1, 0, 1]: t1 mean 0.5 -> +0.5, -0.5; t2 mean 1 -> 0, 0
    adv = group_advantages(np.array([1.0, 1.0, 0.0, 1.0]), ["t1", "t2", "t1", "t2"])
    np.testing.assert_array_equal(adv, np.array([0.5, 0.0, -0.5, 0.0], dtype=np.float32))


def test_equal_rewards_give_exact_zero_also_with_std_scaling():
    for scale in (False, True):
        adv = group_advantages(np.full(8, 0.2, dtype=np.float32), ["g"] * 8, scale_by_std=scale)
        assert adv.dtype == np.float32
        assert np.all(adv == 0.0)


def test_std_scaling_does_not_cancel_catastrophically():
    rewards = np.array([0.0] + [0.95] * 7, dtype=np.float32)
    adv = group_advantages(rewards, ["g"] * 8, scale_by_std=True)
    # mean = 0.83125; centred first = -0.83125; population std = sqrt(7)/8 * 0.95 = 0.314190...
    # -> first = -0.83125 / 0.314190 = -2.6457 (= -sqrt(7)), bounded, not thousands
    assert adv[0] == pytest.approx(-math.sqrt(7), rel=1e-4)
    assert np.all(np.isfinite(adv))


def test_leave_one_out_baseline():
    rewards = np.array([0.0] + [0.95] * 7, dtype=np.float32)
    adv = group_advantages(rewards, ["g"] * 8, baseline="leave_one_out")
    # first row: 0 - mean(7 x 0.95) = -0.95; others: 0.95 - (6 x 0.95 + 0)/7 = 0.95/7
    assert adv[0] == pytest.approx(-0.95, abs=1e-6)
    np.testing.assert_allclose(adv[1:], 0.95 / 7, rtol=1e-5)
    scaled = group_advantages(rewards, ["g"] * 8, baseline="leave_one_out", scale_by_std=True)
    assert scaled[0] == pytest.approx(-0.95 / (math.sqrt(7) / 8 * 0.95), rel=1e-4)  # -3.02: bounded
    assert np.all(group_advantages(np.full(8, 0.2, dtype=np.float32), ["g"] * 8, True, baseline="leave_one_out") == 0)
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(rewards, ["g"] * 8, baseline="median")


def test_single_row_group_is_zero_not_nan():
    adv = group_advantages(np.array([1.0, 0.0, 1.0]), ["a", "b", "b"], scale_by_std=True)
    assert adv[0] == 0.0  # one row: no baseline, no signal (documented convention)
    assert not np.any(np.isnan(adv))


def test_advantage_input_errors():
    with pytest.raises(ValueError, match="does not match"):
        group_advantages(np.array([1.0]), ["a", "b"])
    with pytest.raises(ValueError, match="finite"):
        group_advantages(np.array([np.nan]), ["a"])


def test_tempered_logprob_matches_sampling_distribution():
    # logits [2, 1, 0] at T=0.5 -> log_softmax([4, 2, 0])[0] = -log(1 + e^-2 + e^-4) = -0.14293
    logits = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]])
    lp = token_logprobs(logits[:, :1], torch.tensor([[0]]), temperature=0.5)
    assert lp.shape == (1, 1)
    assert float(lp[0, 0]) == pytest.approx(-math.log(1 + math.exp(-2) + math.exp(-4)), abs=1e-6)
    assert float(lp[0, 0]) == pytest.approx(-0.1429, abs=1e-4)


def test_missing_rollout_logprob_is_neutral_and_counted():
    trainer = torch.tensor([[-0.5, -0.01, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-0.4, float("nan"), -1.2]])
    loss, m, _ = tis_policy_loss(trainer, rollout, torch.ones(1, 3), torch.ones(1, 3), 3, tis_cap=10.0)
    assert torch.isfinite(loss)
    loss.backward()
    # ratios exp(-0.1) = 0.905 and exp(0.2) = 1.221; the missing position has weight 1
    np.testing.assert_allclose(trainer.grad.numpy(), -np.array([[math.exp(-0.1), 1.0, math.exp(0.2)]]) / 3, rtol=1e-5)
    assert m["missing"] == 1.0 and m["tokens"] == 2.0
    assert m["abs_diff"] == pytest.approx(0.3, abs=1e-6)


def test_tis_cap_truncates_weight():
    trainer = torch.tensor([[0.0]], requires_grad=True)
    loss, m, _ = tis_policy_loss(trainer, torch.tensor([[-2.0]]), torch.ones(1, 1), torch.ones(1, 1), 1, tis_cap=2.0)
    loss.backward()
    assert float(trainer.grad) == pytest.approx(-2.0)  # ratio e^2 = 7.39 capped at 2
    assert m["capped"] == 1.0


def test_loss_and_grad_independent_of_micro_batching():
    torch.manual_seed(0)
    lp_all = torch.randn(4, 6)
    rollout = lp_all + 0.05 * torch.randn(4, 6)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(4, 6)
    mask = (torch.rand(4, 6) > 0.3).float()
    total = int(mask.sum())

    def run(splits):
        lp = lp_all.clone().requires_grad_(True)
        value = 0.0
        for lo, hi in splits:
            loss, _, _ = tis_policy_loss(lp[lo:hi], rollout[lo:hi], adv[lo:hi], mask[lo:hi], total, 2.0)
            loss.backward()
            value += float(loss.detach())
        return value, lp.grad.clone()

    v1, g1 = run([(0, 4)])
    v2, g2 = run([(0, 1), (1, 3), (3, 4)])
    assert v1 == pytest.approx(v2, abs=1e-6)
    torch.testing.assert_close(g1, g2)


def test_masked_truncated_tokens_leave_denominator():
    # 30 completion tokens, 5 of them in a truncated completion that is masked: sum(kept)/25
    lp = torch.zeros(2, 25 + 5, requires_grad=True)
    mask = torch.zeros(2, 30)
    mask[0, :25] = 1.0  # row 0 kept (25 tokens), row 1 (5 tokens) masked as truncated
    loss, _, _ = tis_policy_loss(lp, torch.zeros(2, 30), torch.ones(2, 30), mask, int(mask.sum()), 2.0)
    assert float(loss) == pytest.approx(-25 / 25)


def test_everything_masked_gives_zero_loss_finite_grad():
    lp = torch.randn(2, 4, requires_grad=True)
    loss, _, _ = tis_policy_loss(lp, torch.zeros(2, 4), torch.ones(2, 4), torch.zeros(2, 4), 0, 2.0)
    loss.backward()
    assert float(loss) == 0.0
    assert torch.all(torch.isfinite(lp.grad)) and torch.all(lp.grad == 0)


def test_sequence_level_weight_is_capped_product_of_token_ratios():
    lp = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    rollout = torch.tensor([-0.1, -0.2, -1.0])
    rows = torch.tensor([0, 0, 1])
    loss, m, _ = tis_policy_loss(lp, rollout, torch.ones(3), torch.ones(3), 3, tis_cap=2.0, level="sequence",
                                 row_ids=rows)
    loss.backward()
    # row 0: exp(0.1 + 0.2) = 1.3499 on both tokens; row 1: exp(1.0) = 2.718 capped at 2
    np.testing.assert_allclose(lp.grad.numpy(), -np.array([math.exp(0.3), math.exp(0.3), 2.0]) / 3, rtol=1e-5)
    assert m["capped"] == 1.0
    with pytest.raises(ValueError, match="row_ids"):
        tis_policy_loss(lp, rollout, torch.ones(3), torch.ones(3), 3, 2.0, level="sequence")


def test_ratios_outside_thresholds_are_masked_and_counted():
    lp = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    rollout = torch.tensor([-0.1, -3.0, 3.0])  # ratios 1.105, 20.1, 0.0498
    loss, m, ratios = tis_policy_loss(lp, rollout, torch.ones(3), torch.ones(3), 3, tis_cap=2.0,
                                      mask_low=0.5, mask_high=5.0)
    loss.backward()
    np.testing.assert_allclose(lp.grad.numpy(), -np.array([math.exp(0.1), 0.0, 0.0]) / 3, rtol=1e-5)
    assert (m["masked"], m["capped"]) == (2.0, 0.0)
    assert sorted(ratios.tolist()) == pytest.approx(sorted([math.exp(0.1), math.exp(3.0), math.exp(-3.0)]), rel=1e-5)


def test_row_divergence_k1_k3_by_hand_and_missing_positions_left_out():
    # Row 0: log ratios [ln 2, 0] -> k1 = -ln2/2, k3 = (2 - 1 - ln2 + 0)/2. Row 1: one known token
    # at ratio 1 and one unknown (NaN) -> 0, 0 with 1 known token.
    rollout = torch.tensor([-1.0, -2.0, -0.5, float("nan")])
    trainer = torch.tensor([-1.0 + math.log(2), -2.0, -0.5, -0.3])
    k1, k3, known = row_divergence(trainer, rollout, torch.tensor([0, 0, 1, 1]), 2)
    assert k1[0].item() == pytest.approx(-math.log(2) / 2)
    assert k3[0].item() == pytest.approx((1 - math.log(2)) / 2)
    assert k1[1].item() == 0.0 and k3[1].item() == 0.0 and known.tolist() == [2.0, 1.0]


def test_divergence_row_weights_drop_and_downweight():
    k = torch.tensor([0.05, 0.2, 0.4])
    assert divergence_row_weights(k, 0.1, "drop").tolist() == [1.0, 0.0, 0.0]
    assert divergence_row_weights(k, 0.1, "downweight").tolist() == pytest.approx([1.0, 0.5, 0.25])
    with pytest.raises(ValueError, match="threshold"):
        divergence_row_weights(k, 0.0, "drop")
    with pytest.raises(ValueError, match="action"):
        divergence_row_weights(k, 0.1, "ignore")


def test_row_weight_zero_removes_the_row_but_keeps_the_denominator():
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    rollout = lp.detach().clone()
    adv = torch.tensor([1.0, 1.0, -2.0])
    mask = torch.ones(3)
    rows = torch.tensor([0, 0, 1])
    loss, _, _ = tis_policy_loss(lp, rollout, adv, mask, 3, 2.0, row_ids=rows, row_weight=torch.tensor([0.0, 1.0]))
    assert loss.item() == pytest.approx(2.0 / 3)  # only row 1: -(1/3) * (-2)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, 2.0 / 3])


# Truncated sampling (vLLM 0.32: temperature, then top-k, then top-p, renormalised). The 5-token row
# [2, 1, 0.5, 0, -1] at T = 1 has probabilities [0.56302, 0.20712, 0.12563, 0.07620, 0.02803]; ascending
# cumulative sums 0.02803 (-1), 0.10423 (0), 0.22985 (0.5), 0.43698 (1), 1.0 (2).
FIVE = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def _lp(logits, target, temperature=1.0, top_k=0, top_p=1.0):
    lp, kept = sampling_logprobs(logits[None], torch.tensor([target]), temperature, top_k, top_p)
    return float(lp[0]), bool(kept[0])


def test_top_k_and_top_p_logprobs_by_hand():
    # top_k = 2 keeps {2, 1}: lp(0) = -log(1 + e^-1) = -0.313262, lp(1) = -log(1 + e) = -1.313262
    assert _lp(FIVE, 0, top_k=2) == (pytest.approx(-0.313262, abs=1e-6), True)
    assert _lp(FIVE, 1, top_k=2) == (pytest.approx(-1.313262, abs=1e-6), True)
    # top_p = 0.8 drops tokens whose ascending cumsum <= 0.2: -1 and 0; keeps {2, 1, 0.5}:
    # lp(0) = -log(1 + e^-1 + e^-1.5) = -0.464369, lp(1) = -log(e + 1 + e^-0.5) = -1.464369
    assert _lp(FIVE, 0, top_p=0.8) == (pytest.approx(-0.464369, abs=1e-6), True)
    assert _lp(FIVE, 1, top_p=0.8) == (pytest.approx(-1.464369, abs=1e-6), True)
    assert kept_tokens(FIVE, 0, 0.8).tolist() == [True, True, True, False, False]
    # the full-vocabulary logprob of token 0 is log(0.56302) = -0.574438: the bias the truncation removes
    assert float(token_logprobs(FIVE, torch.tensor(0), 1.0)) == pytest.approx(-0.574438, abs=1e-6)


def test_temperature_before_truncation():
    # T = 0.5: z = [4, 2, 1, 0, -2], probabilities [0.82924, 0.11223, 0.04129, 0.01519, 0.00206],
    # ascending cumsums 0.00206, 0.01724, 0.05853, 0.17076, 1.0: top_p = 0.8 keeps only token 0 (lp 0).
    # (Truncating the T = 1 distribution first would keep {0, 1, 2}.)
    assert _lp(FIVE, 0, temperature=0.5, top_p=0.8) == (0.0, True)
    assert kept_tokens(FIVE / 0.5, 0, 0.8).tolist() == [True, False, False, False, False]


def test_top_p_on_what_top_k_kept():
    # top_k = 3 keeps [2, 1, 0.5], renormalised [0.62853, 0.23122, 0.14024]; top_p = 0.8 then drops
    # 0.5 (cumsum 0.14024 <= 0.2): kept {2, 1}, lp(0) = -0.313262. Top-p on the full distribution
    # would have kept 0.5 (its cumsum there is 0.22985 > 0.2).
    assert kept_tokens(FIVE, 3, 0.8).tolist() == [True, True, False, False, False]
    assert _lp(FIVE, 0, top_k=3, top_p=0.8) == (pytest.approx(-0.313262, abs=1e-6), True)


def test_ties_are_handled_as_vllm_does():
    # top-k: every token >= the k-th largest is kept (vLLM apply_top_k_only: logits < kth masked), so
    # k = 2 on [2, 1, 1, 0, -1] keeps three: lp(0) = -log(1 + 2 e^-1) = -0.551445
    ties = torch.tensor([2.0, 1.0, 1.0, 0.0, -1.0])
    assert kept_tokens(ties, 2, 1.0).tolist() == [True, True, True, False, False]
    assert _lp(ties, 0, top_k=2) == (pytest.approx(-0.551445, abs=1e-6), True)
    # top-p: [1, 2, 2, 0.5, 2], probabilities 0.102445 (1), 0.278473 (each 2), 0.062136 (0.5); ascending
    # cumsums 0.062136, 0.164580, 0.443054, 0.721527, 1.0. top_p = 0.5 drops cumsum <= 0.5: 0.5, 1 and the
    # first of the tied 2s in sort order; the tie is split, two of three kept, each lp log(1/2).
    # vLLM's apply_top_k_top_p(tensor([[1., 2., 2., .5, 2.]]), None, tensor([.5])) -> [-inf, -inf, 2, -inf, 2].
    tied_p = torch.tensor([1.0, 2.0, 2.0, 0.5, 2.0])
    assert kept_tokens(tied_p, 0, 0.5).tolist() == [False, False, True, False, True]
    assert _lp(tied_p, 2, top_p=0.5) == (pytest.approx(math.log(0.5), abs=1e-6), True)


def test_full_vocabulary_path_unchanged_when_off():
    torch.manual_seed(0)
    logits, targets = torch.randn(7, 50), torch.randint(0, 50, (7,))
    for top_k in (0, 50, 1000):  # 0 and >= V are off, as in vLLM
        lp, kept = sampling_logprobs(logits, targets, 0.7, top_k, 1.0)
        assert torch.equal(lp, token_logprobs(logits, targets, 0.7)) and bool(kept.all())
    with pytest.raises(ValueError, match="top_k"):
        sampling_logprobs(logits, targets, 0.7, -1, 1.0)
    with pytest.raises(ValueError, match="top_p"):
        sampling_logprobs(logits, targets, 0.7, 0, 0.0)


def _reference_rollout_logprobs(logits, temperature, top_k, top_p):
    """What vLLM returns, written independently: float64 python over each row, descending order."""
    z = logits.float() / temperature
    out = torch.full_like(z, -float("inf"))
    for i, row in enumerate(z.double().tolist()):
        order = sorted(range(len(row)), key=lambda j: -row[j])
        if top_k:
            order = [j for j in order if row[j] >= row[order[top_k - 1]]]
        m = max(row[j] for j in order)
        w = [math.exp(row[j] - m) for j in order]
        total, above, kept = sum(w), 0.0, []
        for j, wj in zip(order, w, strict=True):  # keep while the mass strictly above is < p
            if above < top_p:
                kept.append(j)
            above += wj / total
        out[i, kept] = z[i, kept]
    return out.log_softmax(dim=-1)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (5, 1.0), (8, 0.7)])
def test_ratio_is_exactly_one_at_unchanged_weights(top_k, top_p):
    torch.manual_seed(1)
    logits = torch.randn(64, 40) * 2
    rollout_all = _reference_rollout_logprobs(logits, 0.8, top_k, top_p)
    targets = torch.multinomial(rollout_all.exp(), 1).squeeze(-1)  # sampled from the truncated distribution
    rollout = rollout_all.gather(-1, targets[:, None]).squeeze(-1)
    lp, kept = sampling_logprobs(logits, targets, 0.8, top_k, top_p)
    assert bool(kept.all())
    _, m, ratios = tis_policy_loss(lp, rollout, torch.ones(64), torch.ones(64), 64, 2.0, kept=kept)
    assert torch.equal(ratios, torch.ones(64)) and m["abs_diff"] == 0.0 and m["unkept"] == 0.0
    # the full-vocabulary logprob is lower by log(kept mass) at every token: ratios below 1
    assert bool((torch.exp(token_logprobs(logits, targets, 0.8) - rollout) < 0.999).all())


def test_token_outside_the_kept_set_gets_weight_zero_and_is_counted():
    # Token 1 of FIVE at T = 0.5, top_p = 0.8 is outside the kept set {0}: finite floor, no gradient
    logits = torch.stack([FIVE, FIVE]).requires_grad_(True)
    lp, kept = sampling_logprobs(logits, torch.tensor([0, 1]), 0.5, 0, 0.8)
    assert kept.tolist() == [True, False] and lp.tolist() == [0.0, OUTSIDE_KEPT_LOGPROB]
    # token level: rollout lps [-0.1, -2.0]; token 0 ratio e^0.1, token 1 weight 0 (not "masked" by
    # mask_low, not in the mismatch metrics); N = 2 stays
    loss, m, ratios = tis_policy_loss(lp, torch.tensor([-0.1, -2.0]), torch.ones(2), torch.ones(2), 2, 2.0,
                                      mask_low=0.5, kept=kept)
    loss.backward()
    assert float(loss) == pytest.approx(-math.exp(0.1) / 2, rel=1e-6)
    assert torch.isfinite(logits.grad).all() and bool((logits.grad[1] == 0).all())
    assert (m["unkept"], m["tokens"], m["masked"], m["missing"]) == (1.0, 1.0, 0.0, 0.0)
    assert m["k1"] == pytest.approx(-0.1, abs=1e-6) and ratios.tolist() == pytest.approx([math.exp(0.1)])
    # sequence level: the row holding it has likelihood ratio 0, its every token weight 0; row 1 untouched
    lp = torch.tensor([0.0, OUTSIDE_KEPT_LOGPROB, 0.0], requires_grad=True)
    loss, m, _ = tis_policy_loss(lp, torch.tensor([-0.1, -2.0, -0.2]), torch.ones(3), torch.ones(3), 3, 2.0,
                                 level="sequence", row_ids=torch.tensor([0, 0, 1]),
                                 kept=torch.tensor([True, False, True]))
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, -math.exp(0.2) / 3], rel=1e-6)
    assert m["unkept"] == 1.0 and m["capped"] == 0.0


def test_truncated_logprob_gradient_flows_through_kept_logits_only():
    # top_k = 2 on FIVE: lp(0) = z0 - logsumexp(z0, z1); d/dz = [1 - 0.731059, -0.268941, 0, 0, 0]
    logits = FIVE.clone().requires_grad_(True)
    lp, _ = sampling_logprobs(logits, torch.tensor(0), 1.0, 2, 1.0)
    lp.backward()
    assert logits.grad.tolist() == pytest.approx([0.268941, -0.268941, 0.0, 0.0, 0.0], abs=1e-6)
