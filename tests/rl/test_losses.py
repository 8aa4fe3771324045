"""Policy loss, aggregation, KL estimators and TIS weights against hand-computed values."""

import math

import pytest
import torch

from jetrl.rl.losses import aggregate, kl_penalty, policy_loss, truncated_is_weights

NAN = float("nan")
# rows: (mask, advantage, ratios on valid tokens); T = 4, column 0 is a prompt token everywhere
MASK = torch.tensor([[0, 1, 1, 1],
                     [0, 0, 1, 0],     # one response token, then padding
                     [0, 1, 1, 0],
                     [0, 0, 0, 0]], dtype=torch.bool)   # fully masked row
ADV = torch.tensor([1.0, -1.0, -2.0, 3.0])
RATIOS = torch.tensor([[1.0, 1.5, 1.1, 0.7],
                       [1.0, 1.0, 0.5, 1.0],
                       [1.0, 1.5, 0.9, 1.0],
                       [1.0, 1.0, 1.0, 1.0]])
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
# per-token losses -min(r A, clip(r, 0.8, 1.28) A):
#  row 0 (A=+1): 1.5 -> clipped high, -1.28 ; 1.1 -> -1.1 ; 0.7 -> below 1-eps but A>0: unclipped, -0.7
#  row 1 (A=-1): 0.5 -> clipped low, +0.8
#  row 2 (A=-2): 1.5 -> above 1+eps but A<0: unclipped, +3.0 ; 0.9 -> +1.8
TOKEN_LOSSES = [-1.28, -1.1, -0.7, 0.8, 3.0, 1.8]


def make_inputs(gen):
    old = -torch.rand(4, 4, generator=gen) * 3 - 0.1
    logp = (old + RATIOS.log()).clone()
    # garbage where masked: must not leak into loss, grads or metrics
    logp[~MASK] = torch.tensor([NAN, -float("inf")]).repeat(int((~MASK).sum()))[: int((~MASK).sum())]
    old = old.clone()
    old[0, 0] = NAN
    return logp.requires_grad_(), old


def test_token_aggregation_hand_computed(gen):
    logp, old = make_inputs(gen)
    loss, m = policy_loss(logp, old, ADV, MASK, CLIP_LOW, CLIP_HIGH, agg="token")
    # fp32 ratios from exp(log r): relative error a few ulps
    assert loss.item() == pytest.approx(sum(TOKEN_LOSSES) / 6, rel=1e-6)
    loss.backward()
    grad = logp.grad
    assert torch.isfinite(grad).all()
    expected = torch.zeros(4, 4)
    expected[0, 2] = -1.0 * 1.1 / 6   # d(-r A)/d logp = -r A, over 6 tokens
    expected[0, 3] = -1.0 * 0.7 / 6
    expected[2, 1] = 2.0 * 1.5 / 6
    expected[2, 2] = 2.0 * 0.9 / 6
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-8)  # clipped tokens and masked: exactly 0
    assert m["clip_frac_low"].item() == pytest.approx(1 / 6)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 6)
    assert m["clip_frac"].item() == pytest.approx(2 / 6)
    assert m["ratio_max"].item() == pytest.approx(1.5, rel=1e-6)
    assert m["ratio_min"].item() == pytest.approx(0.5, rel=1e-6)
    assert m["ratio_mean"].item() == pytest.approx((1.5 + 1.1 + 0.7 + 0.5 + 1.5 + 0.9) / 6, rel=1e-6)
    # k3 of KL(old || new) on tokens drawn from old: r - 1 - log r with r = new / old (its mean over old's draws is
    # the KL: E[r] = 1); 1 / r - 1 + log r, the form before, has mean chi^2 - KL instead
    approx_kl = sum(r - 1 - math.log(r) for r in (1.5, 1.1, 0.7, 0.5, 1.5, 0.9)) / 6
    assert m["approx_kl"].item() == pytest.approx(approx_kl, rel=1e-5)
    assert m["num_tokens"].item() == 6
    assert all(torch.isfinite(v) for v in m.values())


def test_sequence_aggregations_hand_computed(gen):
    logp, old = make_inputs(gen)
    loss, _ = policy_loss(logp, old, ADV, MASK, CLIP_LOW, CLIP_HIGH, agg="sequence")
    seq_means = [sum(TOKEN_LOSSES[:3]) / 3, TOKEN_LOSSES[3], sum(TOKEN_LOSSES[4:]) / 2]
    assert loss.item() == pytest.approx(sum(seq_means) / 3, rel=1e-6)  # the empty row is not a sequence
    loss, _ = policy_loss(logp, old, ADV, MASK, CLIP_LOW, CLIP_HIGH, agg="sequence-sum-norm", max_len=8)
    assert loss.item() == pytest.approx(sum(TOKEN_LOSSES) / (4 * 8), rel=1e-6)
    loss, _ = policy_loss(logp, old, ADV, MASK, CLIP_LOW, CLIP_HIGH, agg="sequence-sum-norm")
    assert loss.item() == pytest.approx(sum(TOKEN_LOSSES) / (4 * 4), rel=1e-6)  # default max_len = T


def test_per_token_advantages_match_per_sequence(gen):
    logp, old = make_inputs(gen)
    a, _ = policy_loss(logp, old, ADV, MASK, CLIP_LOW, CLIP_HIGH)
    b, _ = policy_loss(logp, old, ADV[:, None].expand(4, 4).clone(), MASK, CLIP_LOW, CLIP_HIGH)
    assert torch.equal(a, b)
    adv_tok = ADV[:, None].expand(4, 4).clone()
    adv_tok[0, 3] = -5.0  # ratio 0.7 with A<0 -> clipped low: -min(-3.5, -4.0) = 4.0
    c, m = policy_loss(logp, old, adv_tok, MASK, CLIP_LOW, CLIP_HIGH)
    assert c.item() == pytest.approx((sum(TOKEN_LOSSES) + 0.7 + 4.0) / 6, rel=1e-6)
    assert m["clip_frac_low"].item() == pytest.approx(2 / 6)


def test_is_weights_multiply_per_token(gen):
    logp, old = make_inputs(gen)
    w = 0.5 + torch.rand(4, 4, generator=gen)
    w[~MASK] = NAN  # ignored where masked
    loss, m = policy_loss(logp, old, ADV, MASK, CLIP_LOW, CLIP_HIGH, is_weights=w)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    ws = w[MASK].tolist()
    assert loss.item() == pytest.approx(sum(l * x for l, x in zip(TOKEN_LOSSES, ws)) / 6, rel=1e-6)
    assert m["is_weight_mean"].item() == pytest.approx(sum(ws) / 6, rel=1e-6)


def test_no_clipping_is_vanilla_policy_gradient(gen):
    """At ratio 1 (first PPO epoch, on-policy) the gradient is -A / N per token for token-mean."""
    old = -torch.rand(3, 5, generator=gen)
    logp = old.clone().requires_grad_()
    mask = torch.rand(3, 5, generator=gen) > 0.3
    adv = torch.randn(3, generator=gen)
    loss, m = policy_loss(logp, old, adv, mask)
    loss.backward()
    expected = torch.where(mask, -adv[:, None].expand(3, 5) / mask.sum(), torch.zeros(()))
    torch.testing.assert_close(logp.grad, expected, rtol=1e-6, atol=0)
    assert m["clip_frac"].item() == 0 and m["approx_kl"].item() == 0


@pytest.mark.parametrize("agg", ["token", "sequence", "sequence-sum-norm"])
def test_micro_batches_add_up_to_the_mini_batch(gen, agg):
    B, T = 6, 7
    old = -torch.rand(B, T, generator=gen) * 2
    logp = old + 0.3 * torch.randn(B, T, generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.4
    mask[4] = False
    adv = torch.randn(B, generator=gen)
    full, _ = policy_loss(logp, old, adv, mask, agg=agg, max_len=10)
    num_tokens = int(mask.sum())
    num_seqs = int((mask.sum(1) > 0).sum()) if agg == "sequence" else B
    parts = [policy_loss(logp[s], old[s], adv[s], mask[s], agg=agg, num_tokens=num_tokens, num_seqs=num_seqs,
                         max_len=10)[0] for s in (slice(0, 2), slice(2, 5), slice(5, 6))]
    torch.testing.assert_close(sum(parts), full, rtol=1e-6, atol=1e-7)


def test_fully_masked_batch_gives_zero_not_nan(gen):
    logp = torch.full((2, 3), NAN, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for agg in ("token", "sequence", "sequence-sum-norm"):
        loss, m = policy_loss(logp, torch.zeros(2, 3), torch.ones(2), mask, agg=agg)
        assert loss.item() == 0.0
        assert all(torch.isfinite(v) for v in m.values()), m
        loss.backward()
        assert torch.equal(logp.grad, torch.zeros(2, 3))
        logp.grad = None


def test_bad_inputs():
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="clip ranges must be >= 0"):
        policy_loss(x, x, torch.ones(2), m, clip_low=-0.1)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        policy_loss(x, x, torch.ones(2), m, agg="mean")
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        policy_loss(x, torch.zeros(2, 4), torch.ones(2), m)
    with pytest.raises(ValueError, match="per-sequence advantages have 3 rows"):
        policy_loss(x, x, torch.ones(3), m)
    with pytest.raises(ValueError, match="only 0/1"):
        aggregate(x, torch.full((2, 3), 0.5))


def test_kl_estimators_hand_computed():
    logp = torch.tensor([[math.log(0.5), math.log(0.2), 0.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.4), NAN]])
    mask = torch.tensor([[True, True, False]])
    k1 = kl_penalty(logp, ref, mask, "k1")
    k2 = kl_penalty(logp, ref, mask, "k2")
    k3 = kl_penalty(logp, ref, mask, "k3")
    l1, l2 = math.log(0.25 / 0.5), math.log(0.4 / 0.2)  # log r = logp_ref - logp
    torch.testing.assert_close(k1, torch.tensor([[-l1, -l2, 0.0]]))
    torch.testing.assert_close(k2, torch.tensor([[0.5 * l1 ** 2, 0.5 * l2 ** 2, 0.0]]))
    torch.testing.assert_close(k3, torch.tensor([[0.5 - 1 - l1, 2.0 - 1 - l2, 0.0]]))
    k3.sum().backward()  # d k3 / d logp = 1 - r
    torch.testing.assert_close(logp.grad, torch.tensor([[1 - 0.5, 1 - 2.0, 0.0]]))
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(logp, ref, mask, "k4")


def test_kl_estimators_are_unbiased_in_expectation(gen):
    """k1 and k3 averaged over samples from pi estimate KL(pi || ref); k3 is never negative."""
    logits_p, logits_r = torch.randn(20, generator=gen), torch.randn(20, generator=gen)
    lp, lr = logits_p.log_softmax(0), logits_r.log_softmax(0)
    exact = (lp.exp() * (lp - lr)).sum().item()
    idx = torch.multinomial(lp.exp(), 200_000, replacement=True, generator=gen)[None]
    mask = torch.ones_like(idx, dtype=torch.bool)
    k1 = kl_penalty(lp[idx], lr[idx], mask, "k1")
    k3 = kl_penalty(lp[idx], lr[idx], mask, "k3")
    assert (k3 >= 0).all()
    # Monte Carlo with 2e5 samples: standard error well under 2% of KL for these distributions
    assert k1.mean().item() == pytest.approx(exact, rel=0.05)
    assert k3.mean().item() == pytest.approx(exact, rel=0.05)


def test_truncated_is_weights():
    old = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.1), NAN]])
    rollout = torch.tensor([[math.log(0.25), math.log(0.9), math.log(0.4), 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    w = truncated_is_weights(old, rollout, mask, cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.0, 0.25, 1.0]]))  # 2.0 capped at 1.5
    with pytest.raises(ValueError, match="cap must be >= 1"):
        truncated_is_weights(old, rollout, mask, cap=0.5)
