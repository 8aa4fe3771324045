"""ModelRunner on its own (CPU): KV-cache sizing, and its interface driven by hand as the engine drives it,
with a decode step launched before the previous step's tokens reach the host."""

import pytest
import torch

from jetrl.models import DecoderConfig, build_model
from jetrl.rollout import BlockManager, ModelRunner, SamplingBatch, SamplingParams, Scheduler, Sequence, sample

CONFIG = dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96, eos_token_id=1)
# K and V, 2 layers, 4 tokens, 2 KV heads of 128 / 4 = 32 dims, fp32
BYTES_PER_BLOCK = 2 * 2 * 4 * 2 * 32 * 4


@pytest.fixture(scope="module")
def model():
    return build_model(DecoderConfig(**CONFIG), dtype=torch.float32, recipe="bf16", seed=0)


def _runner(model, **kw):
    return ModelRunner(model, **{"max_model_len": 96, "block_size": 4, "max_num_seqs": 2, **kw})


def test_kv_cache_sizing_from_the_memory_budget(model):
    runner = _runner(model, memory_budget=10 * BYTES_PER_BLOCK + 100)
    assert runner.bytes_per_block == BYTES_PER_BLOCK
    assert runner.allocate_kv_cache() == 10
    assert runner.kv_cache.num_blocks == 11 and runner.scratch_block == 10  # one more: the graphs' scratch block
    cache = runner.kv_cache
    assert runner.allocate_kv_cache() == 10 and runner.kv_cache is cache  # made once, then kept
    runner.free_cache()
    assert runner.kv_cache is None and runner.allocate_kv_cache() == 10 and runner.kv_cache is not cache
    # never more than max_num_seqs full-length sequences need: 2 x ceil(96 / 4)
    assert _runner(model, memory_budget=2 ** 30).allocate_kv_cache() == 48
    assert _runner(model, num_blocks=5, memory_budget=2 ** 30).allocate_kv_cache() == 5
    with pytest.raises(ValueError, match="in bytes"):
        _runner(model, memory_budget=0.5).allocate_kv_cache()
    with pytest.raises(ValueError, match="holds no KV block"):
        _runner(model, memory_budget=BYTES_PER_BLOCK - 1).allocate_kv_cache()


@torch.no_grad()
def _naive(model, prompt, params, sample_index, steps):
    """Recompute the whole sequence every step with the training forward and sample its last row."""
    ids, tokens, lps = list(prompt), [], []
    for pos in range(steps):
        logits = model(torch.tensor([ids]))[0, -1:].float()
        tok, lp = sample(logits, SamplingBatch.build([params], [sample_index], [pos], "cpu"))
        ids.append(int(tok)), tokens.append(int(tok)), lps.append(float(lp))
    return tokens, lps


def test_steps_launched_ahead_of_collection_match_full_recompute(model):
    """The engine's asynchronous loop by hand: each step is launched before the previous one is collected,
    so every decode input is a placeholder the runner reads from the previous step's tokens on the device."""
    prompt, steps = [5, 6, 7, 8, 9, 10], 4
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=steps, ignore_eos=True)
    runner = _runner(model, num_blocks=16)
    scheduler = Scheduler(BlockManager(runner.allocate_kv_cache(), 4), max_num_seqs=2, max_num_batched_tokens=64,
                          max_model_len=96)
    seqs = [Sequence(j, 0, j, prompt, params, frozenset()) for j in range(params.n)]
    scheduler.add(seqs)
    runner.begin(seqs)
    prev = None  # (launched step, its rows)
    num_placeholder_steps = 0
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        num_placeholder_steps += out.is_decode and all(c.seqs[0].token_ids[c.start] < 0 for c in out.chunks)
        launched = runner.launch(out, None if prev is None else prev[0])
        if prev is not None:
            tokens, logprobs = runner.collect(prev[0])
            scheduler.resolve(prev[1], tokens, logprobs)
        rows, _ = scheduler.advance(out)
        prev = (launched, rows)
    scheduler.resolve(prev[1], *runner.collect(prev[0]))
    assert num_placeholder_steps == steps - 1  # every decode step read its inputs on the device
    for j, seq in enumerate(seqs):
        tokens, lps = _naive(model, prompt, params, j, steps)
        assert seq.output_ids == tokens
        assert seq.logprobs == pytest.approx(lps, abs=1e-4)  # fp32: paged vs full attention, summation order only
    assert seqs[0].output_ids != seqs[1].output_ids  # two samples of one prompt, drawn independently


@pytest.fixture(scope="module")
def model_d128():
    """bf16, head_dim 128 (the 8B shape's): where an FP8 KV cache costs (128 + 4) / 256 of the BF16 bytes."""
    cfg = dict(CONFIG, hidden_size=256, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    return build_model(DecoderConfig(**cfg), dtype=torch.bfloat16, recipe="fp8-rollout", seed=0)


def test_fp8_kv_cache_holds_about_twice_the_blocks(model_d128):
    budget = 2 ** 20
    bf16 = ModelRunner(model_d128, max_model_len=96, block_size=16, max_num_seqs=64, memory_budget=budget)
    fp8 = ModelRunner(model_d128, max_model_len=96, block_size=16, max_num_seqs=64, memory_budget=budget, kv_fp8=True)
    assert bf16.bytes_per_block == 2 * 1 * 16 * 1 * 128 * 2  # K and V, 1 layer, 16 tokens, 1 head, 128 dims, bf16
    assert fp8.bytes_per_block == 2 * 1 * 16 * 1 * (128 + 4)  # 1 byte a value, one fp32 scale per token and head
    blocks_bf16, blocks_fp8 = bf16.allocate_kv_cache(), fp8.allocate_kv_cache()
    assert blocks_bf16 == budget // bf16.bytes_per_block and blocks_fp8 == budget // fp8.bytes_per_block
    assert 1.9 < blocks_fp8 / blocks_bf16 < 2.0
    assert fp8.kv_cache.is_fp8 and not bf16.kv_cache.is_fp8
    assert fp8.kv_cache.nbytes() == (blocks_fp8 + 1) * fp8.bytes_per_block  # the scratch block included


def test_fp8_kv_cache_preempts_less_in_the_same_memory(model_d128):
    """The engine's stats show the doubling: twice the tokens in the pool, fewer preemptions (fp8-rollout with
    kv_fp8: the rollout-only FP8 cache)."""
    from jetrl.rollout import RolloutEngine

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 256, (20,), generator=g).tolist() for _ in range(8)]
    params = SamplingParams(n=1, temperature=1.0, max_tokens=20, seed=5, ignore_eos=True)
    stats = {}
    for kv_fp8 in (False, True):
        engine = RolloutEngine(model_d128, block_size=4, max_num_seqs=8, max_model_len=48, progress=False,
                               memory_budget=30 * 2 * 4 * 128 * 2, kv_fp8=kv_fp8)  # 30 BF16 blocks
        outs = engine.generate(prompts, params)
        assert all(len(c.token_ids) == 20 for c in outs)
        stats[kv_fp8] = engine.last_stats
    assert stats[False]["num_blocks"] == 30 and stats[True]["kv_capacity_tokens"] == 4 * stats[True]["num_blocks"]
    assert stats[True]["num_blocks"] == 30 * 256 // 132 and stats[True]["kv_fp8"] == 1.0
    assert stats[False]["preemptions"] > stats[True]["preemptions"], stats


def test_graph_key_follows_the_kernel_tuning(model):
    """CUDA graphs replay the kernels chosen at capture, so the key that decides a recapture includes the tuning:
    a different tuning is a different key, an equal one (a fresh but equal override) the same key."""
    from jetrl.quant.kernels import tuning

    runner = _runner(model, num_blocks=4)
    key = runner._weights_key()
    assert runner._weights_key() == key
    with tuning.override(kv_decode_factored=not tuning.current().kv_decode_factored):
        assert runner._weights_key() != key
    with tuning.override(exact_split_k=tuning.current().exact_split_k):
        assert runner._weights_key() == key
