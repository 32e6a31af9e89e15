"""GRPO math against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from infra.train.grpo import (
    divergence_row_weights,
    group_advantages,
    row_divergence,
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
