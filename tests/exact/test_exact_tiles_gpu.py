"""Exact mode's attention with several tiles per program (``exact_attention_tiles_per_program``) on an H200 (``gpu``
marker): at the 8B head shape (32 query heads, 8 KV heads, head_dim 128, bf16) the kernel's output for T = 1..4 tiles
per program, and for stacked tiles (``exact_attention_stacked``, T = 2 and 4), equals the kernel before the multi-tile
schedule (``one_tile_exact_attention.py``) bit for bit, for the packed training forward and for prefill chunks and
decode steps over an FP8 paged cache; and the engine's log-probabilities still equal the trainer's bitwise with the
setting on, on both sides or on the trainer's only (T is a schedule: the rollout and the trainer may run different
values)."""

import pytest
import torch

from jetrl.models import DecoderConfig, build_model
from jetrl.models.attention import PagedAttentionMetadata, packed_as_paged, quantize_kv
from jetrl.quant.kernels import tuning
from jetrl.rollout import RolloutEngine, SamplingParams

pytestmark = pytest.mark.gpu

# (exact_attention_tiles_per_program, exact_attention_stacked)
SCHEDULES = ((1, False), (2, False), (3, False), (4, False), (2, True), (4, True))


def _all_tiles_equal_one_tile(q, kc, vc, meta, ks=None, vs=None) -> None:
    from one_tile_exact_attention import one_tile_exact_attention

    from jetrl.quant.kernels.exact_attention_triton import exact_attention_fwd

    want = one_tile_exact_attention(q, kc, vc, meta, 0.088, k_scale=ks, v_scale=vs)
    assert torch.isfinite(want).all()
    for tiles, stacked in SCHEDULES:
        with tuning.override(exact_attention_tiles_per_program=tiles, exact_attention_stacked=stacked):
            got = exact_attention_fwd(q, kc, vc, meta, 0.088, k_scale=ks, v_scale=vs)
        assert torch.equal(got, want), (tiles, stacked, (got.float() - want.float()).abs().max())


def test_packed_forward_bits_do_not_depend_on_tiles_per_program():
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [1, 512, 16, 17, 63, 65, 300, 1, 129, 512, 48]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    bf = dict(device="cuda", generator=g, dtype=torch.bfloat16)
    q, k, v = torch.randn(cu[-1], 32, 128, **bf), torch.randn(cu[-1], 8, 128, **bf), torch.randn(cu[-1], 8, 128, **bf)
    _all_tiles_equal_one_tile(q, k[:, None], v[:, None], packed_as_paged(cu, "cuda"))


def test_fp8_paged_prefill_and_decode_bits_do_not_depend_on_tiles_per_program():
    g = torch.Generator(device="cuda").manual_seed(1)
    page, ctx, new = 16, [1, 33, 200, 511, 64], [1, 33, 77, 130, 5]
    width = -(-max(ctx) // page)
    nblocks = sum(-(-c // page) for c in ctx) + 1
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(1)).tolist()
    tables = torch.full((len(ctx), width), -1, dtype=torch.int32)
    for s, c in enumerate(ctx):
        for j in range(-(-c // page)):
            tables[s, j] = perm.pop()
    tables = tables.cuda()
    kd, ks = (t.view(nblocks, page, *t.shape[1:]) for t in quantize_kv(
        torch.randn(nblocks * page, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16) * 2))
    vd, vs = (t.view(nblocks, page, *t.shape[1:]) for t in quantize_kv(
        torch.randn(nblocks * page, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16) * 2))
    for rows in (new, [1] * len(ctx)):  # prefill chunks (the last rows of each context), then a decode step
        qsl = torch.tensor([0] + torch.tensor(rows).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        meta = PagedAttentionMetadata(qsl, torch.tensor(ctx, dtype=torch.int32, device="cuda"), tables,
                                      torch.zeros(sum(rows), dtype=torch.long, device="cuda"), max(rows), max(ctx))
        q = torch.randn(sum(rows), 32, 128, device="cuda", generator=g, dtype=torch.bfloat16)
        _all_tiles_equal_one_tile(q, kd, vd, meta, ks, vs)


@pytest.mark.parametrize("heads", [32, 40])  # GQA groups 4 (Llama 8B) and 5 (Qwen2.5-32B) over 8 KV heads
def test_swapped_decode_gives_the_training_forwards_bits(heads):
    """A decode step on the swapped kernel (``exact_decode_attention_swapped``, one query row per program, keys as
    the MMA's rows) gives each row the bits the packed training forward (the one-tile kernel) gives it as the last
    row of its sequence, at every pipeline depth, and so does the tile kernel's decode schedule; contexts from one
    key to 1,280, partial and whole chunks."""
    from one_tile_exact_attention import one_tile_exact_attention

    from jetrl.quant.kernels.exact_attention_triton import exact_attention_fwd

    g = torch.Generator(device="cuda").manual_seed(2)
    lengths = [1, 15, 16, 17, 63, 64, 65, 300, 777, 1280]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    bf = dict(device="cuda", generator=g, dtype=torch.bfloat16)
    q, k, v = (torch.randn(cu[-1], heads, 128, **bf), torch.randn(cu[-1], 8, 128, **bf) * 2,
               torch.randn(cu[-1], 8, 128, **bf))
    packed = packed_as_paged(cu, "cuda")
    want = one_tile_exact_attention(q, k[:, None], v[:, None], packed, 0.088)
    last = torch.tensor(cu[1:], device="cuda") - 1
    meta = PagedAttentionMetadata(torch.arange(len(lengths) + 1, dtype=torch.int32, device="cuda"),
                                  packed.context_lens, packed.block_tables,
                                  torch.zeros(len(lengths), dtype=torch.long, device="cuda"), 1, max(lengths))
    assert torch.isfinite(want).all()
    for over in ({}, dict(exact_decode_attention_stages=2), dict(exact_decode_attention_stages=3),
                 dict(exact_decode_attention_swapped=False)):
        with tuning.override(**over):
            got = exact_attention_fwd(q[last], k[:, None], v[:, None], meta, 0.088)
        assert torch.equal(got, want[last]), (over, (got.float() - want[last].float()).abs().max())


@pytest.fixture(scope="module")
def jet_8b():
    from test_exact_gpu import LLAMA8B_2_BLOCKS

    return build_model(DecoderConfig.from_hf(LLAMA8B_2_BLOCKS), dtype=torch.bfloat16, device="cuda", recipe="jet",
                       seed=0)


@pytest.mark.parametrize("engine_tiles,trainer_tiles,stacked,kv_fp8", [
    (1, 2, False, False), (3, 3, False, False), (2, 4, False, True), (1, 2, True, False), (4, 4, True, True)],
    ids=["engine1-trainer2", "engine3-trainer3", "engine2-trainer4-kv8", "stacked-engine1-trainer2",
         "stacked-engine4-trainer4-kv8"])
def test_engine_equals_trainer_bitwise_with_tiles_per_program(jet_8b, engine_tiles, trainer_tiles, stacked, kv_fp8):
    from test_exact_gpu import _prompts, _score

    engine = RolloutEngine(jet_8b, max_num_seqs=64, max_model_len=512, memory_budget=0.2, progress=False,
                           exact=True, kv_fp8=kv_fp8)
    for num_prompts, n in ((17, 1), (16, 4)):
        prompts = _prompts(num_prompts, seed=num_prompts + 100)
        with tuning.override(exact_attention_tiles_per_program=engine_tiles, exact_attention_stacked=stacked):
            outs = engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=40, seed=5,
                                                           ignore_eos=True))
        assert engine.runner.graphs is not None, "the decode step was not captured"
        with tuning.override(exact_attention_tiles_per_program=trainer_tiles, exact_attention_stacked=stacked):
            scored = _score(jet_8b, prompts, outs, micro=16, kv_fp8=kv_fp8)
        for c, lp in zip(outs, scored):
            engine_lp = torch.tensor(c.logprobs, dtype=torch.float32)
            assert torch.equal(engine_lp, lp), (engine_tiles, trainer_tiles, (engine_lp - lp).abs().max())
