"""The batched sampler: distribution, truncation, log-probabilities, seeded reproducibility."""

import math

import pytest
import torch

from jetrl.rollout import SamplingBatch, SamplingParams, sample, seeded_uniform

# Chi-square critical values at p = 0.001 (a correct sampler fails with probability 1e-3 per seed; the
# seeds are fixed, so the test is deterministic; a wrong distribution overshoots these by far).
CHI2_CRIT_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 7: 24.32, 11: 31.26, 15: 37.70}


def _rows(params, num_rows, position=0):
    return SamplingBatch.build([params] * num_rows, list(range(num_rows)), [position] * num_rows, "cpu")


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_params_validation():
    for bad in (dict(n=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=0),
                dict(top_k=-2), dict(max_tokens=0), dict(stop=("",)), dict(seed=-1),
                dict(temperature=float("nan")), dict(stop_token_ids=(-3,))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    for bad in (dict(n=1.5), dict(stop_token_ids="abc"), dict(max_tokens=True), dict(seed=1.0)):
        with pytest.raises(TypeError):
            SamplingParams(**bad)
    p = SamplingParams(stop="###", stop_token_ids=[3, 4])
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4)


def test_greedy_and_logprob_definition(gen):
    logits = torch.randn(5, 37, generator=gen) * 3
    tokens, logprobs = sample(logits, _rows(SamplingParams(temperature=0.0), 5))
    assert torch.equal(tokens, logits.argmax(-1))
    # greedy rows report the temperature-1 log-probability
    assert torch.equal(logprobs, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1))


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_seeded_first_tokens_follow_softmax(gen, temperature):
    vocab, draws = 12, 6000
    logits = torch.randn(vocab, generator=gen) * 1.5
    probs = (logits / temperature).softmax(-1)
    params = SamplingParams(temperature=temperature, seed=2024)
    tokens, logprobs = sample(logits.expand(draws, vocab), _rows(params, draws))  # n = draws samples
    counts = torch.bincount(tokens, minlength=vocab).double()
    chi2 = _chi2(counts, probs.double())
    assert chi2 < CHI2_CRIT_001[11], f"chi2 {chi2:.1f} over {vocab - 1} dof"
    # the returned log-probability is log_softmax(logits / T) of the sampled token
    torch.testing.assert_close(logprobs, (logits / temperature).log_softmax(-1)[tokens], rtol=0, atol=1e-6)


def test_unseeded_rows_follow_softmax(gen):
    vocab, draws = 8, 6000
    logits = torch.randn(vocab, generator=gen)
    torch.manual_seed(7)
    tokens, _ = sample(logits.expand(draws, vocab), _rows(SamplingParams(temperature=1.0), draws))
    chi2 = _chi2(torch.bincount(tokens, minlength=vocab).double(), logits.softmax(-1).double())
    assert chi2 < CHI2_CRIT_001[7], chi2


def test_top_k_truncates_and_renormalises(gen):
    vocab, draws, k = 16, 4000, 3
    logits = torch.randn(vocab, generator=gen) * 2
    params = SamplingParams(temperature=1.0, top_k=k, seed=11)
    tokens, logprobs = sample(logits.expand(draws, vocab), _rows(params, draws))
    top = logits.topk(k).indices
    assert bool(torch.isin(tokens, top).all())
    counts = torch.bincount(tokens, minlength=vocab)[top].double()
    chi2 = _chi2(counts, logits[top].softmax(-1).double())
    assert chi2 < CHI2_CRIT_001[k - 1], chi2
    # logprobs are NOT renormalised over the top-k: they are the full-vocabulary log-softmax
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[tokens], rtol=0, atol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5 (1), 0.3 (3), 0.15 (2), 0.05 (0)
    logits = probs.log().expand(3000, 4)
    tokens, _ = sample(logits, _rows(SamplingParams(top_p=0.75, seed=5), 3000))
    assert set(tokens.tolist()) == {1, 3}  # 0.5 < 0.75 needs the second token; 0.8 >= 0.75 stops there
    counts = torch.bincount(tokens, minlength=4)[[1, 3]].double()
    assert _chi2(counts, torch.tensor([0.5, 0.3], dtype=torch.float64) / 0.8) < CHI2_CRIT_001[1]
    tokens, _ = sample(logits, _rows(SamplingParams(top_p=0.3, seed=5), 3000))
    assert set(tokens.tolist()) == {1}  # the most likely token is always kept
    # top-k then top-p on the renormalised top-k: top_k=2 -> {1: 0.625, 3: 0.375}; top_p=0.6 keeps {1}
    tokens, _ = sample(logits, _rows(SamplingParams(top_k=2, top_p=0.6, seed=5), 3000))
    assert set(tokens.tolist()) == {1}


def test_seeded_sampling_is_reproducible_and_batch_independent(gen):
    vocab = 50
    logits = torch.randn(6, vocab, generator=gen)
    params = [SamplingParams(temperature=0.9, seed=s) for s in (1, 2, 3, 1, 2 ** 63 + 5, 4)]
    batch = SamplingBatch.build(params, [0, 1, 2, 3, 0, 5], [0, 4, 2, 0, 9, 1], "cpu")
    tokens_a, lp_a = sample(logits, batch)
    tokens_b, lp_b = sample(logits, batch)
    assert torch.equal(tokens_a, tokens_b) and torch.equal(lp_a, lp_b)
    # each row alone, or in reversed order, gets the same token
    for i in range(6):
        one = SamplingBatch.build([params[i]], [batch.sample_index[i].item()], [batch.position[i].item()], "cpu")
        assert sample(logits[i:i + 1], one)[0].item() == tokens_a[i].item()
    rev = SamplingBatch.build(params[::-1], batch.sample_index.flip(0).tolist(), batch.position.flip(0).tolist(),
                              "cpu")
    assert torch.equal(sample(logits.flip(0), rev)[0], tokens_a.flip(0))
    # a seeded row keeps its token next to unseeded rows
    mixed = SamplingBatch.build([params[0], SamplingParams()], [0, 0], [0, 0], "cpu")
    assert sample(logits[:2], mixed)[0][0].item() == tokens_a[0].item()


def test_seeded_noise_is_uniform_and_keyed():
    u = seeded_uniform(torch.tensor([5, 5, 6]), torch.tensor([0, 0, 0]), torch.tensor([0, 1, 0]),
                       torch.tensor([0, 0, 0]), 20000)
    assert bool(((u > 0) & (u < 1)).all())
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    # different sample index or seed gives unrelated noise
    assert abs(torch.corrcoef(torch.stack([u[0], u[1]]))[0, 1].item()) < 0.05
    assert abs(torch.corrcoef(torch.stack([u[0], u[2]]))[0, 1].item()) < 0.05
    hist = torch.histc(u[0], bins=10, min=0, max=1)
    assert _chi2(hist.double(), torch.full((10,), 0.1, dtype=torch.float64)) < 27.9  # 9 dof, p = 0.001
    assert not math.isnan(u.sum().item())


# (seed, sample index, position, token): the hash's 24 noise bits are all ones there, (2^24 - 1) + 0.5 rounds to 2^24
# in float32, and the unclamped noise was u = 1, g = -log(-log(1)) = +inf: that token won whatever its logit
TOP_NOISE_CELL = (55, 0, 5, 1746)


def test_the_top_noise_cell_is_finite_and_does_not_override_the_logits():
    seed, index, position, token = TOP_NOISE_CELL
    params = SamplingParams(seed=seed)
    batch = SamplingBatch.build([params], [index], [position], "cpu")
    u = seeded_uniform(batch.seed_lo, batch.seed_hi, batch.sample_index, batch.position, token + 1)[0]
    assert float(u[token]) == 1.0 - 2.0 ** -24 and float(u.max()) < 1.0  # the clamped cell, every u below 1
    gumbel = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(gumbel).all()) and abs(float(gumbel[token]) - 16.6355) < 1e-3
    logits = torch.zeros(1, 2000)
    logits[0, 7], logits[0, token] = 30.0, -30.0  # the token is e^-60 as likely as token 7
    tokens, _ = sample(logits, batch)
    assert int(tokens[0]) == 7


def test_top_k_alone_keeps_k_tokens_even_when_the_mass_rounds_to_one():
    """top_p=1 disables nucleus truncation: a dominant token whose probability rounds the fp32 cumulative
    mass to 1.0 must not remove the other top-k tokens."""
    from jetrl.rollout.sampling import _truncation_mask

    logits = torch.tensor([[30.0, 0.0, -1.0, -2.0, -3.0]])
    removed = _truncation_mask(logits, torch.tensor([3]), torch.tensor([1.0]))
    assert removed.tolist() == [[False, False, False, True, True]]
