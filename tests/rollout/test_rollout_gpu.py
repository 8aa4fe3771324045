"""Rollout on a CUDA GPU: the Triton decode kernel in BF16, CUDA-graph decoding against eager decoding."""

import gc
import weakref

import pytest
import torch

from jetrl.models import DecoderConfig, PagedAttentionMetadata, build_model, paged_attention_reference
from jetrl.rollout import RolloutEngine, SamplingParams

pytestmark = pytest.mark.gpu
# each engine's KV pool, in bytes: the GPU tests run in several processes on one GPU, and a pool of most of the free
# memory (the default) would leave another process's graph capture without any (a capture fails, decoding runs eagerly)
POOL_BYTES = 1 << 30


@pytest.mark.parametrize("num_seqs,num_heads,num_kv_heads,head_dim,page,splits", [
    (5, 32, 8, 128, 16, None), (3, 16, 2, 64, 16, 4), (64, 28, 4, 128, 16, None), (2, 8, 8, 96, 8, 3)])
def test_paged_decode_bf16_matches_reference(num_seqs, num_heads, num_kv_heads, head_dim, page, splits):
    from jetrl.quant.kernels.paged_attention_triton import paged_decode

    gen = torch.Generator(device="cuda").manual_seed(num_seqs)
    contexts = torch.randint(1, 700, (num_seqs,), generator=gen, device="cuda").tolist()
    num_blocks = sum(-(-c // page) for c in contexts) + 4
    k = torch.randn(num_blocks, page, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(num_blocks, page, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    width = max(-(-c // page) for c in contexts)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").tolist()
    tables = torch.full((num_seqs, width), -1, dtype=torch.int32)
    for s, c in enumerate(contexts):
        n = -(-c // page)
        tables[s, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    meta = PagedAttentionMetadata(torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"),
                                  torch.tensor(contexts, dtype=torch.int32, device="cuda"), tables.cuda(),
                                  torch.zeros(num_seqs, dtype=torch.long, device="cuda"), 1, max(contexts))
    q = torch.randn(num_seqs, num_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), meta, head_dim ** -0.5)
    out = paged_decode(q, k, v, meta, head_dim ** -0.5, num_splits=splits)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err  # BF16 output and BF16 probabilities in P @ V: ~3e-3 relative


@pytest.mark.parametrize("recipe,kv_fp8", [("bf16", False), ("jet", False), ("jet", True)],
                         ids=["bf16", "jet", "jet-kv8"])
def test_cuda_graph_decoding_equals_eager(recipe, kv_fp8):
    config = DecoderConfig(model_type="qwen3", vocab_size=512, hidden_size=256, intermediate_size=512,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           qk_norm=True, max_position_embeddings=512, eos_token_id=0)
    model = build_model(config, dtype=torch.bfloat16, device="cuda", recipe=recipe, seed=0)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(3 + 5 * i)] for i in range(16)]
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=40, ignore_eos=True)
    eager = RolloutEngine(model, memory_budget=POOL_BYTES, cuda_graphs=False, max_num_seqs=32, progress=False,
                          max_model_len=256, kv_fp8=kv_fp8)
    graphs = RolloutEngine(model, memory_budget=POOL_BYTES, cuda_graphs=True, max_num_seqs=32, progress=False,
                           max_model_len=256, kv_fp8=kv_fp8)
    # 32 samples decode at a captured size (no padding), 11 x 2 = 22 are padded to 32. The graph's attention
    # may split the context differently from eager decoding (its max_context_len is max_model_len), so
    # results agree to BF16 summation-order noise: identical first tokens (shared prefill), close logprobs
    # on common prefixes, and nearly all samples identical
    for batch in (prompts, prompts[:11]):
        a = eager.generate(batch, params)
        b = graphs.generate(batch, params)
        assert graphs.runner.graphs is not None, "decode graphs were not captured"
        assert graphs.runner.kv_cache.is_fp8 == kv_fp8
        same = 0
        for x, y in zip(a, b):
            assert x.token_ids[0] == y.token_ids[0]
            common = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), len(x.token_ids))
            diff = max(abs(p - q) for p, q in zip(x.logprobs[:common], y.logprobs[:common]))
            assert diff < 5e-2, diff
            same += x.token_ids == y.token_ids
        print(f"{recipe}: {same}/{len(a)} graph samples identical to eager")
        assert same >= len(a) * 3 // 4


def test_decode_graphs_are_captured_on_first_use_and_kept():
    """A batch size's graph is captured when a decode step first needs it: 16 sequences that all run to
    max_tokens use one size (16), so one capture; a second call with the same weights captures nothing; after
    the weights move to new storage the first call captures again (the engine's ``graph_captures`` stats)."""
    config = DecoderConfig(model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, eos_token_id=0)
    model = build_model(config, dtype=torch.bfloat16, device="cuda", recipe="bf16", seed=0)
    engine = RolloutEngine(model, memory_budget=POOL_BYTES, cuda_graphs=True, max_num_seqs=64, progress=False,
                           max_model_len=128)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    prompts = [[5 + i, 9, 11 + i] for i in range(4)]
    first = engine.generate(prompts, params)
    assert engine.last_stats["graph_captures"] == 1 and engine.last_stats["graph_capture_seconds"] > 0
    assert sorted(engine.runner.graphs.graphs) == [16]
    again = engine.generate(prompts, params)
    assert engine.last_stats["graph_captures"] == 0 and engine.last_stats["graph_capture_seconds"] == 0
    assert [c.token_ids for c in again] == [c.token_ids for c in first]  # seeded: the replay is the same step
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()  # same values, new storage
    moved = engine.generate(prompts, params)
    assert engine.last_stats["graph_captures"] == 1
    assert [c.token_ids for c in moved] == [c.token_ids for c in first]
    # an engine dropped with its graphs is freed at once, not by the cyclic collector at a later allocation, which
    # may fall inside another engine's capture and invalidate it
    runner = weakref.ref(engine.runner)
    gc.disable()
    try:
        del engine
        assert runner() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("recipe,kv_fp8,exact", [("bf16", False, False), ("jet", False, False),
                                                 ("jet", True, False), ("jet", False, True), ("jet", True, True)],
                         ids=["bf16", "jet", "jet-kv8", "jet-exact", "jet-kv8-exact"])
def test_decode_runs_equal_single_steps_with_graphs(recipe, kv_fp8, exact):
    """Runs of 8 decode steps per host iteration (CUDA graphs; each step's inputs made on the device) against one
    step per iteration. Where every row runs to max_tokens the batches are the same, so the completions are
    bitwise the same; with stop tokens mid-run a run keeps stopped rows in its batch (another graph size, another
    GEMM rounding), so fast mode agrees on the tokens up to the first difference and exact mode (no batch
    dependence) bitwise. Seeded, greedy and top-k/top-p samples; GQA 6 at head_dim 128."""
    config = DecoderConfig(model_type="qwen2", vocab_size=1000, hidden_size=768, intermediate_size=1024,
                           num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=1, head_dim=128,
                           max_position_embeddings=512, eos_token_id=0)
    model = build_model(config, dtype=torch.bfloat16, device="cuda", recipe=recipe, seed=0)
    prompts = [[(7 * i + j) % 900 + 1 for j in range(3 + 5 * i)] for i in range(13)]
    plain = [SamplingParams(n=3, temperature=0.9, seed=i, max_tokens=37, ignore_eos=True) for i in range(12)] + \
        [SamplingParams(n=1, temperature=0.0, max_tokens=37, ignore_eos=True)]
    probe = RolloutEngine(model, memory_budget=POOL_BYTES, max_num_seqs=64, progress=False, max_model_len=256,
                          kv_fp8=kv_fp8, exact=exact, decode_steps=1).generate(prompts, plain)
    stops = tuple({c.token_ids[k] for c, k in zip(probe, range(3, 36, 3))})
    stopping = [SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=30 + i, stop_token_ids=stops,
                               top_k=50 if i % 2 else -1, top_p=0.95 if i % 3 else 1.0) for i in range(13)]
    for params, bitwise in ((plain, True), (stopping, exact)):
        runs = {}
        for steps in (1, 8):
            engine = RolloutEngine(model, memory_budget=POOL_BYTES, max_num_seqs=64, progress=False,
                                   max_model_len=256, kv_fp8=kv_fp8, exact=exact, decode_steps=steps)
            runs[steps] = engine.generate(prompts, params)
            assert engine.runner.graphs is not None and engine.runner.graphs.graphs
            if steps == 8 and params is plain:  # one max_tokens: runs of 8 but the last
                assert engine.last_stats["decode_launches"] * 6 < engine.last_stats["decode_steps"]
        for a, b in zip(runs[8], runs[1]):
            assert all(t >= 0 for t in a.token_ids)
            if bitwise:
                assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.finish_reason == b.finish_reason
            else:
                common = next((i for i, (s, t) in enumerate(zip(a.token_ids, b.token_ids)) if s != t),
                              min(len(a.token_ids), len(b.token_ids)))
                assert common >= 1 and max(abs(p - q) for p, q in zip(a.logprobs[:common], b.logprobs[:common])) < 5e-2
        if not bitwise:
            assert sum(a.token_ids == b.token_ids for a, b in zip(runs[8], runs[1])) >= len(runs[1]) // 2
        reasons = {c.finish_reason for c in runs[1]}
        assert reasons == {"length"} if params is plain else "stop" in reasons


@pytest.mark.parametrize("recipe,kv_fp8,exact", [("bf16", False, False), ("jet", True, False), ("jet", False, True),
                                                 ("jet", True, True)],
                         ids=["bf16", "jet-kv8", "jet-exact", "jet-kv8-exact"])
def test_preemption_under_graphs_and_decode_runs_matches_a_large_pool(recipe, kv_fp8, exact):
    """A pool too small for the batch preempts sequences mid-run (their blocks freed, their prompt and tokens
    recomputed later) while decode runs of 8 steps replay CUDA graphs; n = 3 samples share their prompt's blocks.
    Exact mode has no batch dependence, so the completions equal a large pool's bitwise; fast mode's batches differ
    in size (another GEMM rounding), so they agree up to their first difference, and most of them entirely."""
    config = DecoderConfig(model_type="qwen2", vocab_size=1000, hidden_size=512, intermediate_size=768,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                           max_position_embeddings=512, eos_token_id=0)
    model = build_model(config, dtype=torch.bfloat16, device="cuda", recipe=recipe, seed=1)
    prompts = [[(11 * i + j) % 900 + 1 for j in range(5 + 7 * i)] for i in range(9)]
    params = [SamplingParams(n=3, temperature=0.8, seed=i, max_tokens=50 + 3 * i, ignore_eos=True,
                             top_k=40 if i % 3 == 1 else -1) for i in range(9)]
    kw = dict(max_num_seqs=32, progress=False, max_model_len=256, block_size=16, kv_fp8=kv_fp8, exact=exact,
              decode_steps=8)
    large = RolloutEngine(model, num_blocks=512, **kw)
    ref = large.generate(prompts, params)
    assert large.last_stats["preemptions"] == 0
    # the longest sample holds 61 + 74 tokens, 9 blocks; 27 samples would need about 180
    tiny = RolloutEngine(model, num_blocks=24, **kw)
    got = tiny.generate(prompts, params)
    assert tiny.last_stats["preemptions"] > 0 and tiny.runner.graphs is not None and tiny.runner.graphs.graphs
    assert [len(c.token_ids) for c in got] == [len(c.token_ids) for c in ref]
    same = 0
    for a, b in zip(got, ref):
        assert all(t >= 0 for t in a.token_ids)
        if exact:
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        else:
            common = next((i for i, (s, t) in enumerate(zip(a.token_ids, b.token_ids)) if s != t), len(a.token_ids))
            assert common >= 1
            assert max(abs(p - q) for p, q in zip(a.logprobs[:common], b.logprobs[:common])) < 5e-2
        same += a.token_ids == b.token_ids
    assert same >= len(ref) // 2
