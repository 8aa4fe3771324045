"""Policy-gradient losses as pure tensor functions on ``(B, T)`` token tensors.

One clipped-surrogate implementation covers PPO, GRPO and DAPO: GRPO is PPO's clipped ratio with group
advantages broadcast over a sample's tokens; DAPO adds a separate, larger upper clip ("clip-higher",
``clip_high > clip_low``) and token-level aggregation; Dr. GRPO aggregates with a constant normaliser.

For every valid token (``mask`` true), with ``ratio = exp(logp - logp_old)`` and advantage ``A``::

    loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) * w_t

where ``w_t`` is an optional detached per-token weight: the truncated importance sampling (TIS) weight
``min(pi_train_old / pi_rollout, C)`` that corrects for rollout-vs-training mismatch (see
:func:`truncated_is_weights`). Prompt and padding positions are masked: their values never reach the
loss, its gradient or the metrics, even when they hold ``-inf``/NaN, and a fully masked row contributes 0.

Aggregation (``agg``), over the valid tokens of the whole (mini-)batch:

* ``"token"``: sum over valid tokens / number of valid tokens (DAPO; every token weighs the same).
* ``"sequence"``: mean over non-empty sequences of each sequence's token mean (original GRPO).
* ``"sequence-sum-norm"``: sum over valid tokens / (num sequences * max_len), ``max_len`` a constant such
  as the generation budget (Dr. GRPO; no length bias).

When a mini-batch is split into micro-batches for gradient accumulation, pass the mini-batch's
``num_tokens`` / ``num_seqs`` so that the micro-batch losses add up to the mini-batch loss exactly.

Metrics are returned as detached 0-dim tensors (no host sync); the caller reduces and logs them.
"""

from __future__ import annotations

from typing import Callable

import torch

from jetrl.config.choices import choice_registry

# exp() of a log-ratio beyond this is clamped: keeps k3 and importance ratios finite for tokens whose
# probabilities differ by more than e^20 (such tokens are clipped anyway)
MAX_LOG_RATIO = 20.0


def _checked_mask(mask: torch.Tensor, **tensors: torch.Tensor | None) -> torch.Tensor:
    """``mask`` as booleans (:func:`_as_bool_mask`), after checking that it is (B, T) and ``tensors`` have its
    shape."""
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        raise ValueError(f"mask must be a (B, T) tensor, got {getattr(mask, 'shape', type(mask).__name__)}")
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != tuple(mask.shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected the mask's shape {tuple(mask.shape)}")
    return _as_bool_mask(mask)


def _as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must be boolean or hold only 0/1")
    return mask != 0


def masked_log_ratio(logprobs: torch.Tensor, other_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logprobs - other_logprobs`` on valid tokens, exactly 0 elsewhere (NaN-safe, gradient-safe)."""
    diff = logprobs.float() - other_logprobs.float()
    return torch.where(mask, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))


# a denominator: a number, or a 0-dim tensor (a CUDA graph's input, set before each replay: no host read)
Count = int | float | torch.Tensor


def _at_least_one(count):
    return count.clamp(min=1) if torch.is_tensor(count) else max(count, 1)


def _token_mean(v: torch.Tensor, mask: torch.Tensor, num_tokens: Count | None, num_seqs: Count | None,
                max_len: int | None) -> torch.Tensor:
    return v.sum() / _at_least_one(mask.sum() if num_tokens is None else num_tokens)


def _sequence_mean(v: torch.Tensor, mask: torch.Tensor, num_tokens: Count | None, num_seqs: Count | None,
                   max_len: int | None) -> torch.Tensor:
    counts = mask.sum(dim=1)
    seq_mean = v.sum(dim=1) / counts.clamp(min=1)
    # empty rows (no response token) are not sequences of the mean
    return seq_mean.sum() / _at_least_one((counts > 0).sum() if num_seqs is None else num_seqs)


def _sequence_sum_norm(v: torch.Tensor, mask: torch.Tensor, num_tokens: Count | None, num_seqs: Count | None,
                       max_len: int | None) -> torch.Tensor:
    seqs = mask.shape[0] if num_seqs is None else num_seqs
    length = mask.shape[1] if max_len is None else max_len
    if length < 1:
        raise ValueError(f"max_len must be >= 1, got {length}")
    return v.sum() / _at_least_one(seqs * length)


# agg name -> reduction of the masked values (B, T) given the batch's denominators (see the module doc), for the
# names of jetrl.config.choices (the config checks algorithm.agg against them)
AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = choice_registry("loss_aggregation", {
    "token": _token_mean, "sequence": _sequence_mean, "sequence-sum-norm": _sequence_sum_norm})


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str = "token", *, num_tokens: Count | None = None,
              num_seqs: Count | None = None, max_len: int | None = None) -> torch.Tensor:
    """Reduce per-token ``values`` (B, T) over the valid tokens of ``mask`` to a scalar (see module doc).

    ``num_tokens`` (token), ``num_seqs`` (sequence, sequence-sum-norm) and ``max_len`` (sequence-sum-norm)
    override the denominators taken from this batch, for gradient accumulation over micro-batches; ``num_tokens``
    and ``num_seqs`` may be 0-dim tensors (no host read: a CUDA graph's inputs).
    """
    mask = _checked_mask(mask, values=values)
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {tuple(AGGREGATIONS)}")
    v = values.masked_fill(~mask, 0.0)  # masked slots may hold NaN/inf: never multiply them
    return AGGREGATIONS[agg](v, mask, num_tokens, num_seqs, max_len)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over valid tokens (0 when there are none); detached helper for metrics."""
    return aggregate(values.detach().float(), mask, "token")


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """TIS weights ``min(exp(old - rollout), cap)`` (B, T), detached; 1 on masked tokens.

    ``old_logprobs`` come from the training-side forward before the update, ``rollout_logprobs`` from the
    engine that sampled the tokens; the weight corrects the policy gradient for sampling from the rollout
    policy while the ratio is taken against the training policy (the ``fp8-rollout`` mismatch).
    """
    mask = _checked_mask(mask, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    if not cap >= 1.0:
        raise ValueError(f"the TIS cap must be >= 1, got {cap}")
    log_w = masked_log_ratio(old_logprobs.detach(), rollout_logprobs.detach(), mask).clamp(max=MAX_LOG_RATIO)
    return torch.exp(log_w).clamp(max=cap)


def _kl_k3(log_r: torch.Tensor) -> torch.Tensor:
    log_r = log_r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_r) - 1.0 - log_r


# name -> per-token estimate from log r = logp_ref - logp (see :func:`kl_penalty`), for the names of
# jetrl.config.choices (the config checks algorithm.kl_estimator against them)
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = choice_registry(
    "kl_estimator", {"k1": lambda log_r: -log_r, "k2": lambda log_r: 0.5 * log_r.square(), "k3": _kl_k3})


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
               estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi; (B, T), 0 on masked tokens.

    With ``log r = logp_ref - logp`` (Schulman's estimators): ``k1 = -log r`` (unbiased, can be negative),
    ``k2 = (log r)^2 / 2`` (biased, low variance), ``k3 = (r - 1) - log r`` (unbiased, >= 0, low variance).
    Differentiable with respect to ``logprobs``; ``ref_logprobs`` is treated as a constant.
    """
    mask = _checked_mask(mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {tuple(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](masked_log_ratio(ref_logprobs.detach(), logprobs, mask))


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, agg: str = "token", *,
                is_weights: torch.Tensor | None = None, num_tokens: Count | None = None, num_seqs: Count | None = None,
                max_len: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO/DAPO clipped surrogate loss and its metrics (see the module doc for the formula).

    ``logprobs`` (B, T) are the taken tokens' log-probabilities under the policy being optimised (grad),
    ``old_logprobs`` the same under the policy the ratio is taken against (no grad); ``advantages`` (B,) per
    sequence or (B, T) per token; ``mask`` (B, T) bool (or 0/1) marks response tokens; ``is_weights``: optional
    (B, T) per-token weights (e.g. :func:`truncated_is_weights`); ``num_tokens``, ``num_seqs``, ``max_len``: as
    :func:`aggregate`'s.

    Returns ``(loss, metrics)``; metrics (detached, over valid tokens): ``pg_loss``, ``clip_frac_low``
    (ratio below ``1 - clip_low`` with A < 0: the gradient is cut), ``clip_frac_high`` (ratio above
    ``1 + clip_high`` with A > 0), ``clip_frac``, ``ratio_mean/min/max``, ``approx_kl`` (k3 estimate of
    KL(old || new)), ``is_weight_mean`` when weights are given, ``num_tokens``.
    """
    mask = _checked_mask(mask, logprobs=logprobs, old_logprobs=old_logprobs, is_weights=is_weights,
                         advantages=None if advantages.ndim == 1 else advantages)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if clip_low >= 1:
        raise ValueError(f"clip_low must be < 1 (the lower bound 1 - clip_low must stay positive), got {clip_low}")
    if advantages.ndim == 1:
        if advantages.shape[0] != mask.shape[0]:
            raise ValueError(f"per-sequence advantages have {advantages.shape[0]} rows, the mask {mask.shape[0]}")
        advantages = advantages[:, None].expand_as(mask)
    adv = advantages.detach().float()

    log_ratio = masked_log_ratio(logprobs, old_logprobs.detach(), mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)  # exactly 1 on masked tokens
    surrogate = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(surrogate, clipped)
    if is_weights is not None:
        is_weights = torch.where(mask, is_weights.detach().float(), torch.ones((), device=mask.device))
        per_token = per_token * is_weights
    loss = aggregate(per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)

    with torch.no_grad():
        r = ratio.detach()
        low = (r < 1.0 - clip_low) & (adv < 0) & mask
        high = (r > 1.0 + clip_high) & (adv > 0) & mask
        n_valid = mask.sum()
        denom = n_valid.clamp(min=1).float()
        inf = torch.full((), float("inf"), device=r.device)  # a fill, not a host copy (CUDA graphs capture it)
        one = torch.ones((), device=r.device)
        has_tokens = n_valid > 0
        metrics = {
            "pg_loss": loss.detach(),
            "clip_frac_low": low.sum() / denom,
            "clip_frac_high": high.sum() / denom,
            "clip_frac": (low | high).sum() / denom,
            "ratio_mean": (r * mask).sum() / denom,
            "ratio_max": torch.where(has_tokens, torch.where(mask, r, -inf).max(), one),
            "ratio_min": torch.where(has_tokens, torch.where(mask, r, inf).min(), one),
            # KL(old || new) on tokens from old: r - 1 - log r with r = new / old
            "approx_kl": (_kl_k3(log_ratio.detach()) * mask).sum() / denom,
            "num_tokens": n_valid.float(),
        }
        if is_weights is not None:
            metrics["is_weight_mean"] = (is_weights * mask).sum() / denom
    return loss, metrics


__all__ = ["AGGREGATIONS", "KL_ESTIMATORS", "aggregate", "masked_mean", "masked_log_ratio", "policy_loss", "kl_penalty",
           "truncated_is_weights"]
