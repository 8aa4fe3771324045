"""Rollout-vs-training mismatch metrics on hand-computed tokens."""

import math

import pytest
import torch

from jetrl.rl.mismatch import mismatch_metrics


def test_hand_computed():
    p_roll = [0.5, 0.2, 0.9, 0.3]
    p_train = [0.5, 0.25, 0.9005, 0.1]
    rollout = torch.tensor([[math.log(p) for p in p_roll] + [float("nan")]])
    train = torch.tensor([[math.log(p) for p in p_train] + [0.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    m = mismatch_metrics(rollout, train, mask, tis_cap=1.2)
    log_r = [math.log(t / r) for r, t in zip(p_roll, p_train)]
    ratio = [t / r for r, t in zip(p_roll, p_train)]
    # inputs are fp32 log-probs: about 1e-7 relative on each, far below the differences measured here
    assert m["logp_abs_diff_mean"] == pytest.approx(sum(abs(x) for x in log_r) / 4, rel=1e-5)
    assert m["logp_abs_diff_max"] == pytest.approx(abs(math.log(1 / 3)), rel=1e-6)
    assert m["kl_k1"] == pytest.approx(sum(-x for x in log_r) / 4, rel=1e-5)
    assert m["kl_k3"] == pytest.approx(sum(r - 1 - x for r, x in zip(ratio, log_r)) / 4, rel=1e-5)
    assert m["prob_abs_diff_max"] == pytest.approx(0.2, rel=1e-5)
    assert m["prob_abs_diff_mean"] == pytest.approx((0 + 0.05 + 0.0005 + 0.2) / 4, rel=1e-4)
    assert m["frac_prob_diff_gt_thr"] == 0.5  # 0.05 and 0.2 exceed 1e-3; 0 and 5e-4 do not
    assert m["is_ratio_max"] == pytest.approx(1.25, rel=1e-6)
    assert m["is_ratio_min"] == pytest.approx(1 / 3, rel=1e-6)
    assert m["is_ratio_mean"] == pytest.approx(sum(ratio) / 4, rel=1e-6)
    assert m["tis_weight_mean"] == pytest.approx((1 + 1.2 + 0.9005 / 0.9 + 1 / 3) / 4, rel=1e-6)
    assert m["tis_frac_capped"] == 0.25
    assert m["num_tokens"] == 4


def test_identical_logprobs_give_zero(gen):
    lp = -torch.rand(3, 6, generator=gen) * 4
    m = mismatch_metrics(lp, lp.clone(), torch.ones(3, 6, dtype=torch.bool))
    assert m["logp_abs_diff_max"] == 0 and m["kl_k1"] == 0 and m["kl_k3"] == 0
    assert m["prob_abs_diff_max"] == 0 and m["frac_prob_diff_gt_thr"] == 0 and m["is_ratio_mean"] == 1


def test_empty_mask_and_nan():
    lp = torch.zeros(2, 3)
    m = mismatch_metrics(lp, lp, torch.zeros(2, 3, dtype=torch.bool), tis_cap=2.0)
    assert all(v == 0 for v in m.values()) and "tis_weight_mean" in m
    with pytest.raises(ValueError, match="NaN"):
        mismatch_metrics(torch.tensor([[float("nan")]]), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool))
