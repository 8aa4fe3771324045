"""The Gluon FP8-cache decode kernel (:mod:`jetrl.quant.kernels.paged_attention_gluon`, the tuning's
``kv_decode_streams``): warps as independent streams of 16-token tiles, copies in flight, operands straight into the
MMA's registers.

* CPU: the head_dim permutations the kernel's relabellings imply (the q load's and the output store's formulas) are
  the ones its reshape/permute chains compute, and bijections; the shapes it takes (``shapes_supported``); the
  context split; the tuning fields' checks; compiled for the H200 (sm_90a) on this machine at 1, 2 and 4 warps,
  with and without a split, over groups 1 to 8: the loop's MMAs are the 24 a 16-token tile needs, the conversion is
  the bit operations (no conversion instruction, no byte read of shared memory), the copies are 16-byte
  ``cp.async``, and the operand relabellings compile (each is asserted trivial in the kernel);
* GPU (Llama-3.1-8B heads, and groups 1 to 8): against the fp32 reference over the dequantized cache and against the
  Triton kernel, for partial pages, one-token contexts, shared prefix blocks, contexts up to 8,000 tokens, forced
  and heuristic splits, pages of 16, 32 and 64 tokens, every warp count and ring depth; rows past a context holding
  NaN bytes and NaN scales change nothing; a CUDA-graph replay gives the eager bits; the default dispatch takes it.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from sm90_compile import skip_without_sm90_compiler
from test_kv_fp8_kernels import dequantize_kv_ref, paged_case, rel_err

gluon_missing = importlib.util.find_spec("triton") is None


def _streams():
    if gluon_missing:
        pytest.skip("triton is not installed (pip install triton)")
    from jetrl.quant.kernels.quantize_gluon import available

    if not available():
        pytest.skip("this Triton has no Gluon")
    from jetrl.quant.kernels import paged_attention_gluon

    return paged_attention_gluon


# ------------------------------------------------------------------------------------------------------------
# CPU: the permutations, the shapes, the split, the fields


def test_head_dim_permutations_are_the_relabelling_chains():
    """The kernel loads q at byte ``32r + 4c + 2j1 + j0`` for k-slot ``16c + 8j1 + 2r + j0`` and stores output row
    ``16i + 8h + q`` to head_dim ``16q + 2i + h``. Those are its reshape/permute chains (copied here from
    ``_scores`` and ``_accumulate``) read backwards, and bijections of 0..127."""
    slot = torch.arange(128)
    q_byte = 32 * ((slot // 2) % 4) + 4 * (slot // 16) + 2 * ((slot // 8) % 2) + slot % 2  # the kernel's formula
    # _scores: bytes in order -> (r, c, j1, j0) -> (c, j1, r, j0): what each k-slot holds
    chain = torch.arange(128).reshape(4, 8, 2, 2).permute(1, 2, 0, 3).reshape(128)
    assert torch.equal(chain, q_byte)
    assert torch.equal(q_byte.sort().values, slot)
    row = torch.arange(128)
    out_d = 16 * (row % 8) + 2 * (row // 16) + (row // 8) % 2  # the kernel's store formula
    # _accumulate: bytes in order -> (q, i, h) -> (i, h, q): what each A-operand row holds
    chain = torch.arange(128).reshape(8, 8, 2).permute(1, 2, 0).reshape(128)
    assert torch.equal(chain, out_d)
    assert torch.equal(out_d.sort().values, row)
    # the V words' relabelling: (tp, word, tbit, i1, i0) of the converted pairs -> (byte, token)
    tp, word, tbit, i1, i0 = torch.meshgrid(torch.arange(8), torch.arange(32), torch.arange(2), torch.arange(2),
                                            torch.arange(2), indexing="ij")
    token = (2 * tp + tbit).permute(1, 3, 4, 0, 2).reshape(128, 16)
    byte = (4 * word + 2 * i1 + i0).permute(1, 3, 4, 0, 2).reshape(128, 16)
    assert torch.equal(token, torch.arange(16).expand(128, 16))
    assert torch.equal(byte, torch.arange(128)[:, None].expand(128, 16))


def _shapes(hq=32, hkv=8, d=128, page=16, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, seqs=4):
    q = torch.zeros(1, hq, d, dtype=dtype).expand(seqs, hq, d)  # shapes only
    k = torch.zeros(10, page, hkv, d, dtype=kv_dtype)
    s = torch.zeros(10, page, hkv)
    return q, k, k.clone(), s, s.clone()


@pytest.mark.parametrize("change, taken", [
    ({}, True), ({"hq": 8}, True), ({"hq": 64}, True), ({"hq": 40}, True), ({"hq": 72}, False),
    ({"page": 32}, True), ({"page": 64}, True), ({"page": 8}, False), ({"page": 24}, False),
    ({"d": 64}, False), ({"dtype": torch.float32}, False), ({"dtype": torch.float16}, False),
    ({"kv_dtype": torch.bfloat16}, False), ({"seqs": 65535}, True), ({"seqs": 65536}, False),
])
def test_the_shapes_it_takes(change, taken):
    streams = _streams()
    assert streams.shapes_supported(*_shapes(**change)) is taken
    assert not streams.supports(*_shapes(**change))  # CPU tensors: never this kernel


def test_caches_of_other_strides_are_not_taken():
    streams = _streams()
    q, k, v, ks, vs = _shapes()
    assert streams.shapes_supported(q, k, v, ks, vs)
    wide = torch.zeros(10, 16, 9, 128, dtype=torch.float8_e4m3fn)[:, :, :8]  # a view of 9 heads
    assert not streams.shapes_supported(q, k, wide, ks, vs)  # K and V strides differ
    odd = torch.zeros(10 * 16 * 8 * 128 + 2, dtype=torch.uint8)[2:].view(torch.float8_e4m3fn).view(10, 16, 8, 128)
    assert not streams.shapes_supported(q, odd, odd, ks, vs)  # not 16-byte aligned
    assert not streams.shapes_supported(q, k, v, ks, torch.zeros(10, 16, 9)[:, :, :8])  # scales' strides differ


@pytest.mark.parametrize("seqs, kv_heads, context, warps, waves, max_splits, want", [
    (256, 8, 768, 1, 8.0, 64, 1),  # 2,048 programs already past 8 per SM of 132
    (64, 8, 768, 1, 8.0, 64, 3),  # ceil(1056 / 512)
    (64, 8, 4352, 1, 8.0, 64, 3),
    (1, 8, 8000, 1, 8.0, 64, 64),  # the cap
    (1, 8, 40, 1, 8.0, 64, 3),  # no more splits than 16-token tiles
    (1, 8, 40, 2, 8.0, 64, 2),  # ... rounds of 2 warps' tiles
    (5, 2, 3000, 4, 2.0, 16, 16),
])
def test_context_split(seqs, kv_heads, context, warps, waves, max_splits, want):
    streams = _streams()
    assert streams.num_splits(seqs, kv_heads, context, 132, warps, waves, max_splits) == want


def test_tuning_fields():
    from jetrl.quant.kernels import tuning

    knobs = tuning.current()
    assert (knobs.kv_decode_streams, knobs.kv_decode_stream_warps, knobs.kv_decode_stream_stages,
            knobs.kv_decode_stream_waves, knobs.kv_decode_stream_max_splits) == (True, 1, 3, 8.0, 64)
    for name, bad, message in [
        ("kv_decode_streams", 1, "kv_decode_streams must be a bool"),
        ("kv_decode_stream_warps", 3, "power of two in 1..8, got 3"),
        ("kv_decode_stream_warps", 16, "power of two in 1..8, got 16"),
        ("kv_decode_stream_stages", 1, "kv_decode_stream_stages must be an int >= 2"),
        ("kv_decode_stream_stages", 3.0, "kv_decode_stream_stages must be an int >= 2"),
        ("kv_decode_stream_waves", 0.0, "kv_decode_stream_waves must be a positive finite number"),
        ("kv_decode_stream_waves", float("nan"), "kv_decode_stream_waves must be a positive finite number"),
        ("kv_decode_stream_max_splits", 0, "kv_decode_stream_max_splits must be a positive int"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            with tuning.override(**{name: bad}):
                pass


# ------------------------------------------------------------------------------------------------------------
# CPU: compiled for the H200 (sm_90a)


def _compile(warps: int, stages: int, splits: int, group: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from jetrl.quant.kernels.tuning import COMPILE_OPTIONS

    streams = _streams()
    skip_without_sm90_compiler()
    kernel = streams._paged_decode_streams_kernel
    names = kernel.arg_names
    consts = dict(GROUP=group, PAGE=16, NUM_SPLITS=splits, W=warps, STAGES=stages, WIDE=False, stride_sh=1)
    ptrs = {"q_ptr": "*bf16", "k_ptr": "*i32", "v_ptr": "*i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32",
            "tables_ptr": "*i32", "ctx_ptr": "*i32", "out_ptr": "*bf16", "part_acc_ptr": "*fp32",
            "part_ml_ptr": "*fp32", "scale_log2": "fp32"}
    # the runtime's specialization at the 8B head shapes: strides in int32 words, ints divisible by 16 marked so
    ints = dict(tokens_per_split=768, stride_qs=4096, stride_qh=128, stride_kb=4096, stride_kt=256, stride_kh=32,
                stride_sb=128, stride_st=8, stride_ts=48, stride_os=4096, stride_oh=128)
    assert set(names) == set(consts) | set(ptrs) | set(ints), set(names) ^ (set(consts) | set(ptrs) | set(ints))
    signature = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n in ptrs and n != "scale_log2" or ints.get(n, 1) % 16 == 0}
    src = GluonASTSource(fn=kernel, signature=signature,
                         constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, **COMPILE_OPTIONS))


@pytest.mark.parametrize("warps, stages, splits, group", [(1, 3, 1, 4), (2, 2, 3, 8), (4, 4, 1, 1), (1, 3, 5, 5)])
def test_compiles_for_sm90_to_register_operands(warps, stages, splits, group):
    ptx = _compile(warps, stages, splits, group).asm["ptx"]
    # one 16-token tile per warp: scores 16 x 16 over 128 (2 x 8 steps) and output 128 x 8 over 16 (8 steps)
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx)) == 24
    # the conversion: per thread and tile 16 K words (2 prmts each) and 8 pairs of V words (4 prmts each), one
    # packed multiply per prmt; no conversion instruction, no shared memory read a byte at a time
    assert len(re.findall(r"prmt\.b32", ptx)) == 64 and len(re.findall(r"fma\.rn\.bf16x2", ptx)) == 64
    assert not re.search(r"cvt\.[a-z0-9.]*e4m3|ld\.shared(\.v\d)?\.[bu]8|ldmatrix[a-z0-9.]*trans", ptx)
    # shared memory into operand registers only for q, once per program: 16 x 128 bf16, 8 four-matrix loads
    assert len(re.findall(r"ldmatrix\.sync\.aligned\.m8n8\.x4\.", ptx)) == 8
    # K and V words copied 16 bytes at a time (4 copies each per thread and tile: a warp's tile is 16 tokens of
    # 128 bytes), in the prologue's STAGES - 1 tiles and in the loop's
    assert len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)) == 8 * stages


# ------------------------------------------------------------------------------------------------------------
# GPU


def _case(gen, contexts, hq, hkv, page, shared_blocks=0):
    meta, kd, ks, vd, vs = paged_case(gen, contexts, [1] * len(contexts), page, hkv, 128, "cuda",
                                      shared_blocks=shared_blocks)
    q = torch.randn(len(contexts), hq, 128, generator=gen, device="cuda").to(torch.bfloat16)
    kq, vq = dequantize_kv_ref(kd, ks, torch.float32), dequantize_kv_ref(vd, vs, torch.float32)
    return q, meta, kd, ks, vd, vs, kq, vq


def _reference(q, meta, kq, vq):
    from jetrl.models.attention import paged_attention_reference

    return paged_attention_reference(q.float(), kq, vq, meta, 128 ** -0.5)


# Tolerance: the kernel rounds P and the output to bf16 (each ~2^-9 relative), ~3e-3 overall as every decode
# kernel's GPU test; a wrong token, head, scale or head_dim permutation misses by O(1).
TOL = 1e-2

CASES = {  # name: (contexts, query heads, KV heads, page, shared prefix blocks)
    "8b-1x8000": ([8000], 32, 8, 16, 0),
    "8b-5-partial": ([1, 17, 3000, 1234, 16], 32, 8, 16, 2),
    "8b-64": (list(range(1, 1500, 23))[:64], 32, 8, 16, 2),
    "group1": ([700, 33, 1], 8, 8, 16, 0),
    "group5-32b": ([900, 2049, 15], 40, 8, 32, 1),
    "group6": ([1, 4099, 6000, 17], 12, 2, 16, 1),
    "group7-page64": ([640, 65, 129], 28, 4, 64, 1),
    "group8": ([513, 1, 2000], 64, 8, 16, 0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_against_the_reference_and_the_triton_kernel(name):
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.paged_attention_triton import paged_decode

    streams = _streams()
    contexts, hq, hkv, page, shared = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(sum(contexts) + hq)
    q, meta, kd, ks, vd, vs, kq, vq = _case(gen, contexts, hq, hkv, page, shared)
    assert streams.supports(q, kd, vd, ks, vs)
    ref = _reference(q, meta, kq, vq)
    with tuning.override(kv_decode_streams=False):
        triton_out = paged_decode(q, kd, vd, meta, 128 ** -0.5, ks, vs)
    for warps, stages in ((1, 3), (1, 2), (2, 4), (4, 3)):
        for splits in (None, 1, 3):
            out = streams.paged_decode_streams(q, kd, vd, meta, 128 ** -0.5, ks, vs, num_warps=warps,
                                               stages=stages, waves=8.0, max_splits=64, splits=splits)
            what = (warps, stages, splits)
            assert out.dtype == torch.bfloat16 and torch.isfinite(out).all(), what
            assert rel_err(out, ref) < TOL and rel_err(out, triton_out) < TOL, (what, rel_err(out, ref))


@pytest.mark.gpu
def test_rows_past_the_context_change_nothing():
    """Every pool row no sequence holds is set to NaN bytes (0x7F, 0xFF) and NaN scales: the tiles past a context
    (read from their page, or from page 0 past the table) are masked in the scores and weighted by 0, so the
    output's bits do not move."""
    streams = _streams()
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, meta, kd, ks, vd, vs, kq, vq = _case(gen, [1, 20, 1000, 47], 32, 8, 16)
    clean = streams.paged_decode_streams(q, kd, vd, meta, 128 ** -0.5, ks, vs, num_warps=2, stages=3, waves=8.0,
                                         max_splits=64)
    held = torch.zeros(kd.shape[0] * kd.shape[1], dtype=torch.bool, device="cuda")
    for s, ctx in enumerate(meta.context_lens.tolist()):
        pos = torch.arange(ctx, device="cuda")
        held[meta.block_tables[s, pos // 16].long() * 16 + pos % 16] = True
    free = ~held.view(kd.shape[:2])
    for data, code in ((kd, 0x7F), (vd, 0xFF)):
        data.view(torch.uint8)[free] = code
    for scale in (ks, vs):
        scale[free] = float("nan")
    dirty = streams.paged_decode_streams(q, kd, vd, meta, 128 ** -0.5, ks, vs, num_warps=2, stages=3, waves=8.0,
                                         max_splits=64)
    assert torch.equal(dirty, clean)
    assert rel_err(clean, _reference(q, meta, kq, vq)) < TOL


@pytest.mark.gpu
def test_default_dispatch_and_graph_replay():
    """``paged_decode`` runs this kernel by default over an FP8 cache at the 8B shapes (bitwise its direct call at
    the tuning's launch), an explicit ``block_n`` keeps the Triton kernel, and a CUDA-graph replay gives the
    eager bits."""
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.paged_attention_triton import paged_decode

    streams = _streams()
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, meta, kd, ks, vd, vs, _, _ = _case(gen, [300, 1, 2500], 32, 8, 16)
    knobs = tuning.current()
    direct = streams.paged_decode_streams(q, kd, vd, meta, 128 ** -0.5, ks, vs, num_warps=knobs.kv_decode_stream_warps,
                                          stages=knobs.kv_decode_stream_stages, waves=knobs.kv_decode_stream_waves,
                                          max_splits=knobs.kv_decode_stream_max_splits)
    eager = paged_decode(q, kd, vd, meta, 128 ** -0.5, ks, vs)
    assert torch.equal(eager, direct)
    with tuning.override(kv_decode_streams=False):
        assert not torch.equal(paged_decode(q, kd, vd, meta, 128 ** -0.5, ks, vs), eager)  # another kernel's order
    assert not torch.equal(paged_decode(q, kd, vd, meta, 128 ** -0.5, ks, vs, block_n=64), eager)
    out = torch.empty_like(eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(paged_decode(q, kd, vd, meta, 128 ** -0.5, ks, vs))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(paged_decode(q, kd, vd, meta, 128 ** -0.5, ks, vs))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
