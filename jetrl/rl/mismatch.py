"""Rollout-vs-training mismatch, measured on the same tokens every step.

The engine returns the log-probability of each token it sampled (behaviour policy ``pi_rollout``); the
trainer recomputes the same tokens with a training-side forward (``pi_train``). With a unified precision
flow (``jet``) the two differ only by summation order, so these numbers are the health check of the
design; with ``fp8-rollout`` they measure how off-policy the data is.

All statistics are over valid tokens (``mask``). The KL estimators take the rollout policy as the
sampling distribution: ``log r = logp_train - logp_rollout``, ``k1 = -log r``, ``k3 = (r - 1) - log r``,
both estimating KL(pi_rollout || pi_train).
"""

from __future__ import annotations

import torch

from jetrl.rl.losses import MAX_LOG_RATIO, _checked_mask

PROB_DIFF_THRESHOLD = 1e-3


@torch.no_grad()
def mismatch_metrics(rollout_logprobs: torch.Tensor, train_logprobs: torch.Tensor, mask: torch.Tensor,
                     tis_cap: float | None = None, threshold: float = PROB_DIFF_THRESHOLD) -> dict[str, float]:
    """Mismatch statistics between rollout and training log-probabilities of the same (B, T) tokens.

    Returns floats (one host sync): ``logp_abs_diff_mean``, ``logp_abs_diff_max``, ``kl_k1``, ``kl_k3``,
    ``prob_abs_diff_mean``, ``prob_abs_diff_max``, ``frac_prob_diff_gt_thr`` (tokens whose
    ``|p_rollout - p_train| > threshold``, 1e-3 by default), the importance weight ``pi_train / pi_rollout``
    statistics ``is_ratio_mean/min/max`` and, with ``tis_cap``, ``tis_weight_mean`` (after capping) and
    ``tis_frac_capped``; ``num_tokens``. With no valid token every statistic is 0.
    """
    mask = _checked_mask(mask, rollout_logprobs=rollout_logprobs, train_logprobs=train_logprobs)
    n = int(mask.sum())
    keys = ["logp_abs_diff_mean", "logp_abs_diff_max", "kl_k1", "kl_k3", "prob_abs_diff_mean",
            "prob_abs_diff_max", "frac_prob_diff_gt_thr", "is_ratio_mean", "is_ratio_min", "is_ratio_max"]
    if tis_cap is not None:
        keys += ["tis_weight_mean", "tis_frac_capped"]
    if n == 0:
        return {**{k: 0.0 for k in keys}, "num_tokens": 0.0}
    lr, lt = rollout_logprobs[mask].double(), train_logprobs[mask].double()
    if not bool(torch.isfinite(lr).all() and torch.isfinite(lt).all()):
        raise ValueError("rollout or training log-probabilities are NaN/inf on valid tokens")
    log_r = (lt - lr).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_r.exp()
    prob_diff = (lr.exp() - lt.exp()).abs()
    out = {
        "logp_abs_diff_mean": log_r.abs().mean(),
        "logp_abs_diff_max": log_r.abs().max(),
        "kl_k1": (-log_r).mean(),
        "kl_k3": (ratio - 1.0 - log_r).mean(),
        "prob_abs_diff_mean": prob_diff.mean(),
        "prob_abs_diff_max": prob_diff.max(),
        "frac_prob_diff_gt_thr": (prob_diff > threshold).double().mean(),
        "is_ratio_mean": ratio.mean(),
        "is_ratio_min": ratio.min(),
        "is_ratio_max": ratio.max(),
    }
    if tis_cap is not None:
        out["tis_weight_mean"] = ratio.clamp(max=tis_cap).mean()
        out["tis_frac_capped"] = (ratio > tis_cap).double().mean()
    return {**{k: float(v) for k, v in out.items()}, "num_tokens": float(n)}


__all__ = ["mismatch_metrics", "PROB_DIFF_THRESHOLD"]
