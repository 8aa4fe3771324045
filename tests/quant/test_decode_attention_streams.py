"""The Gluon FP8-cache decode kernel (:mod:`jetrl.quant.kernels.paged_attention_gluon`, the tuning's
``kv_decode_streams``): warps as independent streams of 16-token tiles, copies in flight, operands straight into the
MMA's registers.

* CPU: the head_dim permutations the kernel's relabellings imply (the q load's and the output store's formulas) are
  the ones its reshape/permute chains compute, and bijections; the shapes it takes (``supports``); the
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

import dataclasses
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


def _relabelled(split, order):
    """What each position of a 128-long row holds after the kernel's relabelling (reshape to ``split``, permute to
    ``order``): the byte index it came from."""
    return torch.arange(128).reshape(split).permute(order).reshape(128)


def test_head_dim_permutations_match_the_kernels_relabellings():
    """The kernel loads q at byte ``32r + 4c + 2j1 + j0`` for k-slot ``16c + 8j1 + 2r + j0`` and stores output row
    ``16i + 8h + q`` to head_dim ``16q + 2i + h``: formulas written out in the kernel. They must be what its
    relabellings of the converted K and V bytes (the module's ``K_SPLIT``/``K_ORDER`` and ``V_SPLIT``/``V_ORDER``,
    which the kernel's reshapes and permutes use) put at each k-slot and row, and bijections of 0..127."""
    streams = _streams()
    slot = torch.arange(128)
    q_byte = 32 * ((slot // 2) % 4) + 4 * (slot // 16) + 2 * ((slot // 8) % 2) + slot % 2  # the kernel's q load
    assert torch.equal(_relabelled(streams.K_SPLIT, streams.K_ORDER), q_byte)
    out_d = 16 * (slot % 8) + 2 * (slot // 16) + (slot // 8) % 2  # the kernel's output store
    assert torch.equal(_relabelled(streams.V_SPLIT, streams.V_ORDER), out_d)
    for perm in (q_byte, out_d):
        assert torch.equal(perm.sort().values, slot)
    # the kernel's reshape/permute constants are these
    def values(*names):
        return [getattr(streams, n).value for n in names]

    assert values("_KS0", "_KS1", "_KS2", "_KS3") == list(streams.K_SPLIT)
    assert values("_KO0", "_KO1", "_KO2", "_KO3") == [2 + i for i in streams.K_ORDER]
    assert values("_VS0", "_VS1", "_VS2") == list(streams.V_SPLIT)
    assert values("_VO0", "_VO1", "_VO2") == [1 + i for i in streams.V_ORDER]


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
    from jetrl.quant.kernels.paged_attention_triton import _streams_apply

    assert streams.supports(*_shapes(**change)) is taken
    assert not _streams_apply(*_shapes(**change))  # CPU tensors: never this kernel


def test_caches_of_other_strides_are_not_taken():
    streams = _streams()
    q, k, v, ks, vs = _shapes()
    assert streams.supports(q, k, v, ks, vs)
    wide = torch.zeros(10, 16, 9, 128, dtype=torch.float8_e4m3fn)[:, :, :8]  # a view of 9 heads
    assert not streams.supports(q, k, wide, ks, vs)  # K and V strides differ
    odd = torch.zeros(10 * 16 * 8 * 128 + 2, dtype=torch.uint8)[2:].view(torch.float8_e4m3fn).view(10, 16, 8, 128)
    assert not streams.supports(q, odd, odd, ks, vs)  # not 16-byte aligned
    assert not streams.supports(q, k, v, ks, torch.zeros(10, 16, 9)[:, :, :8])  # scales' strides differ


@pytest.mark.parametrize("seqs, kv_heads, context, warps, waves, max_splits, want", [
    (256, 8, 768, 1, 8.0, 64, 1),  # 2,048 programs already past 8 per SM of 132
    (64, 8, 768, 1, 8.0, 64, 2),  # a short context aims for half the waves: ceil(528 / 512)
    (64, 8, 4352, 1, 8.0, 64, 3),  # from 4,096 tokens on the full waves: ceil(1056 / 512)
    (64, 8, 4352, 1, 6.0, 64, 2),  # the default waves: ceil(792 / 512)
    (64, 2, 3072, 1, 6.0, 64, 5),  # in between, in proportion: 6 x 0.75 waves, ceil(594 / 128)
    (64, 2, 1280, 1, 6.0, 64, 4),  # 1.5B heads, 64 x (256 + 1,024): 3 waves, ceil(396 / 128)
    (256, 2, 1280, 1, 6.0, 64, 1),  # ... at 256 sequences 512 programs already
    (256, 8, 768, 1, 6.0, 64, 1),
    (16, 8, 4352, 1, 6.0, 64, 7),  # ceil(792 / 128)
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
            knobs.kv_decode_stream_waves, knobs.kv_decode_stream_max_splits,
            knobs.kv_decode_stream_max_registers) == (True, 1, 3, 6.0, 64, 128)
    for name, bad, message in [
        ("kv_decode_streams", 1, "kv_decode_streams must be a bool"),
        ("kv_decode_stream_warps", 3, "power of two in 1..8, got 3"),
        ("kv_decode_stream_warps", 16, "power of two in 1..8, got 16"),
        ("kv_decode_stream_stages", 1, "kv_decode_stream_stages must be an int >= 2"),
        ("kv_decode_stream_stages", 3.0, "kv_decode_stream_stages must be an int >= 2"),
        ("kv_decode_stream_waves", 0.0, "kv_decode_stream_waves must be a positive finite number"),
        ("kv_decode_stream_waves", float("nan"), "kv_decode_stream_waves must be a positive finite number"),
        ("kv_decode_stream_max_splits", 0, "kv_decode_stream_max_splits must be a positive int"),
        ("kv_decode_stream_max_registers", 16, "kv_decode_stream_max_registers must be 0 (the compiler's choice)"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            with tuning.override(**{name: bad}):
                pass
    # the ring must fit in shared memory: 8 warps x 5 slots of 4,224 bytes do, 8 x 6 do not
    assert tuning.STREAM_SLOT_BYTES == 4224
    with tuning.override(kv_decode_stream_warps=8, kv_decode_stream_stages=5):
        pass
    with pytest.raises(ValueError, match="a ring of 6 slots for 8 warps is 202752 bytes"):
        with tuning.override(kv_decode_stream_warps=8, kv_decode_stream_stages=6):
            pass


# ------------------------------------------------------------------------------------------------------------
# CPU: compiled for the H200 (sm_90a)


def _compile(warps: int, stages: int, splits: int, group: int, page: int = 16, wide: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from jetrl.quant.kernels.tuning import COMPILE_OPTIONS

    streams = _streams()
    skip_without_sm90_compiler()
    kernel = streams._paged_decode_streams_kernel
    names = kernel.arg_names
    consts = dict(GROUP=group, PAGE=page, NUM_SPLITS=splits, W=warps, STAGES=stages, WIDE=wide, stride_sh=1)
    ptrs = {"q_ptr": "*bf16", "k_ptr": "*i32", "v_ptr": "*i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32",
            "tables_ptr": "*i32", "ctx_ptr": "*i32", "out_ptr": "*bf16", "part_acc_ptr": "*fp32",
            "part_ml_ptr": "*fp32", "scale_log2": "fp32"}
    # the runtime's specialization at the 8B head shapes: strides in int32 words, ints divisible by 16 marked so
    ints = dict(stride_qs=4096, stride_qh=128, stride_kb=256 * page, stride_kt=256, stride_kh=32,
                stride_sb=8 * page, stride_st=8, stride_ts=48, stride_os=4096, stride_oh=128)
    assert set(names) == set(consts) | set(ptrs) | set(ints), set(names) ^ (set(consts) | set(ptrs) | set(ints))
    signature = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n in ptrs and n != "scale_log2" or ints.get(n, 1) % 16 == 0}
    src = GluonASTSource(fn=kernel, signature=signature,
                         constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, **COMPILE_OPTIONS))


@pytest.mark.parametrize("warps, stages, splits, group, page, wide", [
    (1, 3, 1, 4, 16, False), (2, 2, 3, 8, 16, False), (4, 4, 1, 1, 64, False), (1, 3, 5, 5, 32, True),
    (8, 5, 1, 4, 16, False),  # the largest ring the tuning admits
])
def test_compiles_for_sm90_to_register_operands(warps, stages, splits, group, page, wide):
    compiled = _compile(warps, stages, splits, group, page, wide)
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.shared <= 232448  # an H200 SM's shared memory per block
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
    for warps, stages in ((1, 3), (1, 2), (2, 4), (4, 3), (8, 2)):
        for splits in (None, 0, 1, 3):
            out = streams.paged_decode_streams(q, kd, vd, meta, 128 ** -0.5, ks, vs, num_warps=warps,
                                               stages=stages, waves=8.0, max_splits=64, splits=splits)
            what = (warps, stages, splits)
            assert out.dtype == torch.bfloat16 and torch.isfinite(out).all(), what
            assert rel_err(out, ref) < TOL and rel_err(out, triton_out) < TOL, (what, rel_err(out, ref))


@pytest.mark.gpu
def test_rows_past_the_context_change_nothing():
    """Every pool row no sequence holds is set to NaN bytes (0x7F, 0xFF) and NaN scales, page 0 among them (a tile
    past a sequence's pages reads page 0): those tiles and the rows past a context in a sequence's last page are
    masked in the scores and weighted by 0, so the output's bits do not move."""
    streams = _streams()
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, meta, kd, ks, vd, vs, kq, vq = _case(gen, [1, 20, 1000, 47], 32, 8, 16)
    ref = _reference(q, meta, kq, vq)
    # a pool with one more block in front (block 0, held by no sequence)
    kd, ks, vd, vs = (torch.cat([x[:1], x]) for x in (kd, ks, vd, vs))
    meta = dataclasses.replace(meta, block_tables=torch.where(meta.block_tables >= 0, meta.block_tables + 1, -1))
    clean = streams.paged_decode_streams(q, kd, vd, meta, 128 ** -0.5, ks, vs, num_warps=2, stages=3, waves=8.0,
                                         max_splits=64, splits=3)
    held = torch.zeros(kd.shape[0] * kd.shape[1], dtype=torch.bool, device="cuda")
    for s, ctx in enumerate(meta.context_lens.tolist()):
        pos = torch.arange(ctx, device="cuda")
        held[meta.block_tables[s, pos // 16].long() * 16 + pos % 16] = True
    free = ~held.view(kd.shape[:2])
    assert free[0].all()  # page 0: no sequence's
    for data, code in ((kd, 0x7F), (vd, 0xFF)):
        data.view(torch.uint8)[free] = code
    for scale in (ks, vs):
        scale[free] = float("nan")
    dirty = streams.paged_decode_streams(q, kd, vd, meta, 128 ** -0.5, ks, vs, num_warps=2, stages=3, waves=8.0,
                                         max_splits=64, splits=3)
    assert torch.equal(dirty, clean)
    assert rel_err(clean, ref) < TOL


@pytest.mark.gpu
def test_splits_follow_each_sequences_own_context():
    """A CUDA-graph decode step's metadata gives the longest possible context, not the batch's: each split's share
    comes from the sequence's own length, so the result is the same attention (against the reference) whatever
    ``max_context_len`` says, and every split holds tokens."""
    streams = _streams()
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, meta, kd, ks, vd, vs, kq, vq = _case(gen, [700, 33, 1, 1500], 32, 8, 16)
    ref = _reference(q, meta, kq, vq)
    padded = dataclasses.replace(meta, max_context_len=16384)
    for splits in (None, 4, 64):
        out = streams.paged_decode_streams(q, kd, vd, padded, 128 ** -0.5, ks, vs, num_warps=1, stages=3,
                                           waves=8.0, max_splits=64, splits=splits)
        assert rel_err(out, ref) < TOL, splits


@pytest.mark.gpu
def test_offsets_past_32_bits():
    """Caches of more than 2^31 int32 words (8 GiB each), the sequences' pages at their far end: the kernel takes
    64-bit offsets (32-bit ones would wrap) and attends as over the small pool."""
    from jetrl.quant.kernels.decode_splits import cache_offsets_wide

    streams = _streams()
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, meta, kd, ks, vd, vs, kq, vq = _case(gen, [900, 17, 2500], 32, 8, 16)
    ref = _reference(q, meta, kq, vq)
    used = kd.shape[0]
    far = 2 ** 33 // kd[0].numel() + 16  # the first block past 2^33 bytes (plus a margin)
    big = [torch.empty((far + used,) + x.shape[1:], dtype=x.dtype, device="cuda") for x in (kd, ks, vd, vs)]
    for b, x in zip(big, (kd, ks, vd, vs)):
        b[far:] = x
    meta = dataclasses.replace(meta, block_tables=torch.where(meta.block_tables >= 0, meta.block_tables + far, -1))
    kd, ks, vd, vs = big
    assert cache_offsets_wide(kd.view(torch.int32), vd.view(torch.int32))
    out = streams.paged_decode_streams(q, kd, vd, meta, 128 ** -0.5, ks, vs, num_warps=1, stages=3, waves=8.0,
                                       max_splits=64)
    assert rel_err(out, ref) < TOL
    del big, kd, vd


@pytest.mark.gpu
def test_default_dispatch_and_graph_replay(monkeypatch):
    """``paged_decode`` over an FP8 cache at the 8B shapes calls this kernel at the tuning's launch, and the Triton
    kernel with ``kv_decode_streams`` off or an explicit ``block_n``; a CUDA graph captured on one query replays on
    another and gives that one's eager bits."""
    from jetrl.quant.kernels import paged_attention_gluon, tuning
    from jetrl.quant.kernels.paged_attention_triton import paged_decode

    streams = _streams()
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, meta, kd, ks, vd, vs, _, _ = _case(gen, [300, 1, 2500], 32, 8, 16)
    calls = []
    real = paged_attention_gluon.paged_decode_streams
    monkeypatch.setattr(paged_attention_gluon, "paged_decode_streams",
                        lambda *args, **kw: calls.append(kw) or real(*args, **kw))
    eager = paged_decode(q, kd, vd, meta, 128 ** -0.5, ks, vs)
    knobs = tuning.current()
    assert calls == [dict(num_warps=knobs.kv_decode_stream_warps, stages=knobs.kv_decode_stream_stages,
                          waves=knobs.kv_decode_stream_waves, max_splits=knobs.kv_decode_stream_max_splits,
                          splits=None, max_registers=knobs.kv_decode_stream_max_registers)]
    with tuning.override(kv_decode_streams=False):
        paged_decode(q, kd, vd, meta, 128 ** -0.5, ks, vs)
    paged_decode(q, kd, vd, meta, 128 ** -0.5, ks, vs, block_n=64)
    assert len(calls) == 1  # neither took this kernel
    monkeypatch.undo()
    assert streams.supports(q, kd, vd, ks, vs)
    other = torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype)
    want = paged_decode(other, kd, vd, meta, 128 ** -0.5, ks, vs)
    static_q = q.clone()
    out = torch.empty_like(eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(paged_decode(static_q, kd, vd, meta, 128 ** -0.5, ks, vs))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(paged_decode(static_q, kd, vd, meta, 128 ** -0.5, ks, vs))
    static_q.copy_(other)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and not torch.equal(want, eager)
