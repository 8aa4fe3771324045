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
