"""Regression tests from a review of the rollout engine (scheduler, blocks, sampling parameters)."""

import pytest

from jetrl.rollout import SamplingParams


def test_none_stop_and_stop_token_ids_mean_none():
    """vLLM's own defaults are ``stop=None`` and ``stop_token_ids=None``: code written against vLLM (or a config whose
    ``stop: null``) passes them. They mean "no stop strings / ids", not a bare "'NoneType' object is not iterable"."""
    p = SamplingParams(stop=None, stop_token_ids=None)
    assert p.stop == () and p.stop_token_ids == ()
    assert p == SamplingParams()
    with pytest.raises(ValueError, match="non-empty strings"):  # a None inside the list is still a mistake
        SamplingParams(stop=["###", None])


@pytest.mark.parametrize("temperature", [1e-39, 1e-20, 9.99e-6])
def test_a_temperature_too_small_for_float32_is_refused(temperature):
    """logits / 1e-39 is inf in float32, and its log-softmax NaN: such a temperature is an error, not NaN samples."""
    with pytest.raises(ValueError, match="is below 1e-05: logits / temperature would overflow float32"):
        SamplingParams(temperature=temperature)


def test_the_smallest_temperature_samples_finite_log_probs():
    import torch

    from jetrl.rollout.sampling import MIN_TEMPERATURE, SamplingBatch, sample

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    logits = torch.randn(5, 1000, generator=gen) * 40  # logits of a confident model, up to about +-150
    params = [SamplingParams(temperature=MIN_TEMPERATURE, seed=i) for i in range(5)]
    batch = SamplingBatch.build(params, [0] * 5, [0] * 5, "cpu")
    tokens, logprobs = sample(logits, batch, impl="reference")
    assert torch.equal(tokens, logits.argmax(-1))  # this cold, the sample is the arg max
    assert torch.isfinite(logprobs).all()


def test_an_engine_longer_than_the_model_context_is_refused():
    """max_model_len past max_position_embeddings: positions the model never trained (and RoPE tables may end)."""
    from jetrl.models import DecoderConfig, DecoderLM
    from jetrl.rollout import RolloutEngine

    config = DecoderConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           max_position_embeddings=96, eos_token_id=1)
    model = DecoderLM(config)
    with pytest.raises(ValueError, match=r"RolloutEngine max_model_len = 97 tokens exceed the model's context of 96"):
        RolloutEngine(model, max_model_len=97, progress=False)
    assert RolloutEngine(model, max_model_len=96, progress=False).max_model_len == 96
