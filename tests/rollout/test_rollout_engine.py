"""RolloutEngine on tiny random models (CPU): against a naive full-recompute reference and the training
forward's log-probabilities, in the bf16 and jet recipes."""

import gc
import weakref

import pytest
import torch

from jetrl.models import DecoderConfig, build_model, token_logprobs
from jetrl.quant import fp8_linears
from jetrl.rollout import RolloutEngine, SamplingBatch, SamplingParams, sample

CONFIG = dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96, eos_token_id=1)
PROMPTS = [[5, 6, 7], [9] * 11, [3, 4, 5, 6, 7, 8, 9, 10], [200, 17, 33, 41, 2, 2, 90, 91, 92, 93, 94, 95, 96,
                                                              97, 98, 99, 100]]


def _model(recipe: str, seed: int = 0, **overrides):
    return build_model(DecoderConfig(**{**CONFIG, **overrides}), dtype=torch.float32, recipe=recipe, seed=seed)


@pytest.fixture(scope="module")
def models():
    return {"bf16": _model("bf16"), "jet": _model("jet")}


def _engine(model, **kw):
    kw = {"max_num_seqs": 16, "num_blocks": 128, "block_size": 4, "progress": False, **kw}
    return RolloutEngine(model, **kw)


@torch.no_grad()
def _naive(model, prompt, params, sample_index, steps):
    """Recompute the whole sequence every step with the training forward; sample the last row with the
    engine's sampler (same seeded noise) -> (tokens, logprobs)."""
    ids, tokens, lps = list(prompt), [], []
    for pos in range(steps):
        logits = model(torch.tensor([ids]))[0, -1:].float()
        tok, lp = sample(logits, SamplingBatch.build([params], [sample_index], [pos], "cpu"))
        ids.append(int(tok)), tokens.append(int(tok)), lps.append(float(lp))
    return tokens, lps


@pytest.mark.parametrize("recipe", ["bf16", "jet"])
def test_greedy_matches_full_recompute(models, recipe):
    model = models[recipe]
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    # chunked prefill (8 tokens per step) and 4-token blocks, so prompts span several blocks and steps
    outs = _engine(model, max_num_batched_tokens=8).generate(PROMPTS, params)
    assert [c.prompt_index for c in outs] == [0, 1, 2, 3]
    for c, prompt in zip(outs, PROMPTS):
        ref_tokens, _ = _naive(model, prompt, params, 0, 7)
        assert c.token_ids == ref_tokens, (prompt, c.token_ids, ref_tokens)
        assert c.finish_reason == "length" and len(c.logprobs) == 7


def _training_logprobs(model, prompt, tokens, temperature):
    ids = torch.tensor(prompt + tokens)
    targets = torch.cat([ids[1:], torch.tensor([-1])])
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32),
                               len(ids), targets, temperature=temperature)
    return lp[len(prompt) - 1:len(ids) - 1]


@pytest.mark.parametrize("recipe,bound", [("bf16", 2e-5), ("jet", 1e-3)])
def test_logprobs_match_training_forward(models, recipe, bound):
    """bf16 recipe, fp32 weights: cached decoding and the packed forward differ only by summation order
    (fp32 rounding, ~1e-6). jet: an activation that differs in its last fp32 bit can round to a neighbouring
    E4M3 value; the resulting differences are small and rare, bounded here by 1e-3."""
    model = models[recipe]
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    outs = _engine(model).generate(PROMPTS, params)
    diffs = []
    for c in outs:
        ref = _training_logprobs(model, PROMPTS[c.prompt_index], c.token_ids, 0.8)
        diffs.append((torch.tensor(c.logprobs) - ref).abs())
    diffs = torch.cat(diffs)
    print(f"{recipe}: rollout vs training logprobs, max |diff| {diffs.max():.3e}, mean {diffs.mean():.3e}")
    assert not torch.isnan(diffs).any()
    assert diffs.max() < bound


def test_seeded_sampling_reproducible_and_shared_prefix_equals_independent(models):
    model = models["bf16"]
    params = SamplingParams(n=3, temperature=1.0, top_k=50, top_p=0.95, seed=123, max_tokens=6, ignore_eos=True)
    engine = _engine(model)
    first = engine.generate(PROMPTS, params)
    again = engine.generate(PROMPTS, params)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.prompt_index for c in first] == [i for i in range(4) for _ in range(3)]
    assert [c.sample_index for c in first] == [0, 1, 2] * 4
    assert len({tuple(c.token_ids) for c in first}) > 4  # the samples of a prompt differ
    # a prompt alone in the batch gets the same samples (seeded noise is batch-independent)
    alone = engine.generate([PROMPTS[3]], params)
    assert [c.token_ids for c in alone] == [c.token_ids for c in first[9:12]]
    # each shared-prefix sample equals an independent full recompute of that sample
    for c in first:
        ref_tokens, ref_lps = _naive(model, PROMPTS[c.prompt_index], params, c.sample_index, 6)
        assert c.token_ids == ref_tokens
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(ref_lps), rtol=0, atol=2e-5)


def test_preemption_under_tiny_pool_matches_large_pool(models):
    model = models["bf16"]
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)
    large = _engine(model, num_blocks=256)
    ref = large.generate(PROMPTS, params)
    assert large.last_stats["preemptions"] == 0
    # 17 + 10 - 1 = 26 cached tokens -> 7 blocks of 4: the longest sample fits alone, little else does
    tiny = _engine(model, num_blocks=8)
    got = tiny.generate(PROMPTS, params)
    assert tiny.last_stats["preemptions"] > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for a, b in zip(got, ref):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=2e-5)


def test_a_dropped_engine_is_freed_without_the_cyclic_collector(models):
    """No reference cycle holds an engine, its runner or its KV cache: they go when the last reference does, not
    at a later collection (on the GPU that may fall inside another engine's CUDA-graph capture and invalidate it;
    the GPU test of the decode graphs checks the same with graphs captured)."""
    engine = _engine(models["jet"])
    engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))
    refs = [weakref.ref(engine), weakref.ref(engine.runner), weakref.ref(engine.runner.kv_cache.k[0])]
    gc.disable()
    try:
        del engine
        assert [r() for r in refs] == [None] * 3
    finally:
        gc.enable()


def test_stops_and_lengths(models):
    model = models["bf16"]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = _engine(model).generate([PROMPTS[2]], greedy)[0].token_ids
    stop_tok = base[4]
    cut = base.index(stop_tok) + 1
    out = _engine(model).generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=8,
                                                               stop_token_ids=(stop_tok,)))[0]
    assert out.token_ids == base[:cut] and out.finish_reason == "stop"
    # the config's eos id stops a sample unless ignore_eos
    eos_model = _model("bf16", eos_token_id=stop_tok)
    assert _engine(eos_model).generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8))[0].token_ids \
        == base[:cut]
    assert _engine(eos_model).generate([PROMPTS[2]], greedy)[0].token_ids == base
    # max_tokens and the context limit end with "length"
    out = _engine(model).generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    out = _engine(model, max_model_len=12).generate([PROMPTS[2]], greedy)[0]
    assert len(out.token_ids) == 12 - len(PROMPTS[2]) and out.finish_reason == "length"


class _LetterTokenizer:
    def decode(self, ids):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_strings(models):
    model = models["bf16"]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = _engine(model).generate([PROMPTS[1]], greedy)[0].token_ids
    text = _LetterTokenizer().decode(base)
    stop = text[3:5]
    out = _engine(model, tokenizer=_LetterTokenizer()).generate(
        [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == base[:text.index(stop) + len(stop)]


def test_jet_engine_reads_the_trainers_fp8_weights_and_follows_updates():
    model = _model("jet", seed=1)
    engine = _engine(model)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.generate(PROMPTS[:2], params)
    layer = fp8_linears(model)[0]
    cached = layer.quantized_weight()
    # a training-side forward/backward reuses the very FP8 tensors the rollout used (same version)
    model(torch.tensor([PROMPTS[0]])).sum().backward()
    assert layer.quantized_weight() is cached
    old_bytes = cached.data.view(torch.uint8).clone()
    with torch.no_grad():  # an optimizer-like in-place update: the engine must see the new weights
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    outs = engine.generate(PROMPTS[:2], params)
    # re-quantized in place (stable buffers keep captured CUDA graphs valid), with new values
    assert layer.quantized_weight().data.data_ptr() == cached.data.data_ptr()
    assert not torch.equal(layer.quantized_weight().data.view(torch.uint8), old_bytes)
    for c in outs:
        assert c.token_ids == _naive(model, PROMPTS[c.prompt_index], params, 0, 5)[0]


def test_bad_inputs_get_clear_errors(models):
    engine = _engine(models["bf16"], max_model_len=32)
    ok = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1, 2], []], ok)
    with pytest.raises(ValueError, match="no room"):
        engine.generate([list(range(2, 34))], ok)
    with pytest.raises(ValueError, match="n must be"):
        engine.generate([[1, 2]], SamplingParams(n=0))
    with pytest.raises(ValueError, match="at least one prompt"):
        engine.generate([], ok)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 999]], ok)
    with pytest.raises(TypeError):
        engine.generate("hello", ok)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate([[1, 2]], SamplingParams(stop=("x",)))
    with pytest.raises(ValueError, match="KV blocks"):
        _engine(models["bf16"], num_blocks=2).generate([[1, 2, 3]], SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="bytes"):
        RolloutEngine(models["bf16"], memory_budget=0.5, progress=False).generate([[1, 2]], ok)
    with pytest.raises(TypeError, match="forward_paged"):
        RolloutEngine(torch.nn.Linear(2, 2))


def test_progress_display(models, capsys):
    engine = _engine(models["bf16"], progress=True)
    engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    err = capsys.readouterr().err
    assert "rollout" in err
    assert engine.last_stats["generated_tokens"] == 6 and engine.last_stats["tokens_per_s"] > 0


def test_eos_falls_back_to_the_tokenizer_when_the_config_has_none():
    class Tokenizer:
        eos_token_id = 3

        def decode(self, ids):
            return ""

    model = _model("bf16", eos_token_id=None)
    assert _engine(model, tokenizer=Tokenizer()).eos_token_ids == {3}
    assert _engine(model).eos_token_ids == frozenset()
    assert _engine(_model("bf16")).eos_token_ids == {1}  # the config's own id wins


@pytest.mark.parametrize("recipe", ["bf16", "jet"])
def test_async_scheduling_equals_synchronous(models, recipe):
    """Step t+1 queued before step t's tokens reach the host gives the same completions as waiting for
    them: samples that stop (stop ids, stop strings, max_tokens of several lengths) mid-batch, prefix
    sharing, chunked prefill, preemption in a small pool, new prompts joining as others finish."""
    model = models[recipe]
    probe = _engine(model).generate(PROMPTS, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12,
                                                            ignore_eos=True))
    stop_ids = (probe[0].token_ids[2], probe[5].token_ids[6])  # tokens these samples do produce
    stop_str = _LetterTokenizer().decode(probe[3].token_ids[4:6])
    params = [SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, stop_token_ids=stop_ids),
              SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=9, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, stop=(stop_str,), ignore_eos=True),
              SamplingParams(n=1, temperature=0.0, max_tokens=4)]
    for kw in (dict(), dict(num_blocks=10, max_num_seqs=5, max_num_batched_tokens=8)):
        runs = {}
        for mode in (False, True):
            engine = _engine(model, tokenizer=_LetterTokenizer(), async_scheduling=mode, **kw)
            runs[mode] = engine.generate(PROMPTS, params)
            stats = engine.last_stats
        sync, asyn = runs[False], runs[True]
        assert [c.token_ids for c in asyn] == [c.token_ids for c in sync], kw
        assert [c.finish_reason for c in asyn] == [c.finish_reason for c in sync]
        assert {c.finish_reason for c in sync} == {"stop", "length"}
        for a, b in zip(asyn, sync):
            assert all(t >= 0 for t in a.token_ids)  # no placeholder left behind
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=2e-5)
        assert stats["generated_tokens"] == sum(len(c.token_ids) for c in asyn)
        if kw:
            assert stats["preemptions"] > 0


@pytest.mark.parametrize("recipe", ["bf16", "jet"])
def test_decode_runs_equal_single_steps(models, recipe):
    """Several decode steps per host iteration (each step's inputs made on the device from the step before)
    give the completions of one step per iteration: seeded, greedy and top-k/top-p samples, stops by token,
    string and length inside runs, prefix sharing, chunked prefill, preemption in a small pool, prompts
    joining as others finish, synchronous and asynchronous; and far fewer host iterations."""
    model = models[recipe]
    probe = _engine(model, decode_steps=1).generate(PROMPTS, SamplingParams(n=2, temperature=1.0, seed=3,
                                                                            max_tokens=12, ignore_eos=True))
    stop_ids = (probe[0].token_ids[2], probe[5].token_ids[6])
    stop_str = _LetterTokenizer().decode(probe[3].token_ids[4:6])
    params = [SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, stop_token_ids=stop_ids),
              SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=19, ignore_eos=True, top_k=20, top_p=0.9),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, stop=(stop_str,), ignore_eos=True),
              SamplingParams(n=1, temperature=0.0, max_tokens=4)]
    for kw in (dict(), dict(num_blocks=10, max_num_seqs=5, max_num_batched_tokens=8)):
        for asyn in (False, True):
            runs, stats = {}, {}
            for steps in (1, 3, 8):
                engine = _engine(model, tokenizer=_LetterTokenizer(), async_scheduling=asyn, decode_steps=steps,
                                 **kw)
                runs[steps] = engine.generate(PROMPTS, params)
                stats[steps] = engine.last_stats
            for steps in (3, 8):
                got, ref = runs[steps], runs[1]
                assert [c.token_ids for c in got] == [c.token_ids for c in ref], (kw, asyn, steps)
                assert [c.finish_reason for c in got] == [c.finish_reason for c in ref]
                for a, b in zip(got, ref):
                    assert all(t >= 0 for t in a.token_ids) and len(a.logprobs) == len(a.token_ids)
                    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0,
                                               atol=2e-5)
                assert stats[steps]["generated_tokens"] == sum(len(c.token_ids) for c in got)
                assert stats[steps]["decode_launches"] < stats[1]["decode_launches"]
            assert stats[1]["decode_launches"] == stats[1]["decode_steps"]
            assert {c.finish_reason for c in runs[1]} == {"stop", "length"}
            if kw:
                assert stats[8]["preemptions"] > 0
    long = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=40, ignore_eos=True)
    engine = _engine(model, decode_steps=8)
    engine.generate(PROMPTS[:2], long)
    assert engine.last_stats["decode_launches"] <= engine.last_stats["decode_steps"] / 6
