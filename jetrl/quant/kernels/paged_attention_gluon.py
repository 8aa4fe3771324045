"""Decode attention over an FP8 paged KV cache in Gluon: each warp an independent stream of 16-token tiles.

The Triton decode kernel (:mod:`jetrl.quant.kernels.paged_attention_triton`) reads an FP8 cache well below copy
bandwidth (BENCHMARKS.md, "Decode attention"): its E4M3 tiles pass through registers (converted) and shared memory (for
the MMA's operand layout), and its softmax reduces across the warps of a program every tile. This kernel removes those
per-tile costs, for the common case (bf16 queries, ``head_dim`` 128, pages of a multiple of 16 tokens, at most 8
query heads per KV head):

* **Warps as streams.** A program of ``W`` warps (1 by default) owns one (sequence, KV head, context split). Warp
  ``w`` takes the 16-token tiles ``w, w + W, w + 2W, ...`` of the split and keeps its own online softmax (``m``,
  ``l`` and the output accumulator); the warps are merged once, at the end. No softmax or accumulator value
  crosses warps in the loop.
* **Copies in flight.** Each tile's K and V bytes and scales go global -> shared memory by ``cp.async`` into a ring
  of ``STAGES`` slots, ``STAGES - 1`` tiles ahead of the math. A thread reads back the K and V words it copied; the
  scales are copied one per lane and read in the MMA's layout, so each slot is read after the block-wide barrier
  the compiler places after the copies' wait (and another before a slot is refilled): at one warp per program,
  the default, those barriers hold up no other warp.
* **Splits per sequence.** A split's share of a sequence's context is computed in the kernel from that sequence's
  own length (``ceil(context / NUM_SPLITS)``, whole tiles), so a CUDA-graph decode step, whose host side knows
  only the longest possible context, still spreads every sequence's tokens over all its splits.
* **Operands straight into the MMA's registers.** A head_dim permutation lets the bit conversion of the E4M3 bytes
  land in ``mma.m16n8k16``'s operand registers with no layout conversion:

  - scores ``S = q K^T`` (16 rows: the group's heads, zero-padded): a thread owns the B-operand k-slots
    ``16c + 2r + {0, 1, 8, 9}`` of its tokens (``r`` its lane mod 4). Slot ``16c + 8j1 + 2r + j0`` reads byte
    ``32r + 4c + 2j1 + j0`` of the token's K row, so each thread reads 32 contiguous bytes per token and every
    32-bit word converts into one B register pair. q is loaded with the same permutation: the dot product over
    head_dim is a sum, so permuting both sides changes only its order;
  - output ``O^T = V^T P^T`` (the product transposed: head_dim as the MMA's 128 rows, the group's heads as its 8
    columns, tokens as the reduction): a thread owns the A-operand rows ``16i + 8h + l/4`` (``l`` its lane) at the
    tokens ``2r, 2r + 1, 2r + 8, 2r + 9``; row ``16i + 8h + q`` holds head_dim ``16q + 2i + h``, so each thread
    reads 16 contiguous bytes of each of its 4 tokens, and one ``prmt`` pairs a byte of token ``t`` with the
    same byte of ``t + 1``. P^T is the score accumulator's first 8 rows, already in the B-operand registers
    (the FlashAttention-2 register reuse). The output is written back to head_dim ``16q + 2i + h``.

  Every relabelling is a reshape/permute whose layout conversion Gluon proves trivial (``assert_trivial``).

**Numerics** are those of the Triton kernel's factored route: the E4M3 bytes become bf16 exactly (the bit
conversion, ``prmt``/``shl``/``and`` and one multiply by ``2^120``), the per-token power-of-two scales act on
the fp32 scores and on ``p`` before its bf16 rounding, fp32 accumulation. So the result is the attention over the
dequantized cache (``jetrl.models.attention.dequantize_kv``) to summation order: the order over head_dim is the
permuted one, over tokens each warp's stream and then the merge.

The launch (warps, ring depth, the context split) is the tuning's ``kv_decode_stream_*`` fields; :func:`supports`
says where this kernel applies, :func:`paged_decode_streams` runs it. Gluon is experimental: this module is
imported only where :func:`jetrl.quant.kernels.quantize_gluon.available` says the installed Triton has it.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from jetrl.quant.formats import E4M3
from jetrl.quant.kernels.decode_splits import (LOG2E, MAX_GRID_Y, cache_offsets_wide, merge_splits, sm_count,
                                               split_partials)
from jetrl.quant.kernels.tuning import COMPILE_OPTIONS

TILE = 16  # tokens per warp per loop trip: one m16n8k16 step of the output product
HEAD_DIM = 128
MAX_GROUP = 8  # query heads per KV head: the output product's 8 columns
T = gl.constexpr(TILE)  # the same constants inside the kernels
D = gl.constexpr(HEAD_DIM)

# The relabellings, as (split, order) of a 128-byte row: reshape the byte index to ``split`` (row-major), permute to
# ``order``, flatten. K: byte 32r + 4c + 2j1 + j0 -> k-slot 16c + 8j1 + 2r + j0 (the scores' B operand registers).
K_SPLIT, K_ORDER = (4, 8, 2, 2), (1, 2, 0, 3)
# V: byte 16q + 2i + h -> A-operand row 16i + 8h + q (the output product's rows)
V_SPLIT, V_ORDER = (8, 8, 2), (1, 2, 0)
# the same as the kernels' constants: the split's sizes, and the order's dimensions behind (w, t) for K, (w) for V
_KS0, _KS1, _KS2, _KS3 = (gl.constexpr(n) for n in K_SPLIT)
_KO0, _KO1, _KO2, _KO3 = (gl.constexpr(2 + i) for i in K_ORDER)
_VS0, _VS1, _VS2 = (gl.constexpr(n) for n in V_SPLIT)
_VO0, _VO1, _VO2 = (gl.constexpr(1 + i) for i in V_ORDER)

# Triton renamed the copy (3.6: async_copy_global_to_shared; later releases: async_load, the old name raising)
_async_copy = async_copy.async_load if "async_load" in async_copy.__all__ else async_copy.async_copy_global_to_shared


@gluon.constexpr_function
def _layouts(W):
    """The MMA layout (a batch of ``W`` independent products, one per warp) and its A and B operand layouts."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    return mma, gl.DotOperandLayout(0, mma, 2), gl.DotOperandLayout(1, mma, 2)


@gluon.constexpr_function
def _word_layouts(W):
    """Layouts of a tile's int32 words (warp, token, word) as copied and read back.

    K: lane ``(q, r) = (l // 4, l % 4)`` holds tokens ``q`` and ``q + 8`` and words ``8r .. 8r + 7`` (bytes
    ``32r .. 32r + 31``). V: lane ``(q, r)`` holds tokens ``2r, 2r + 1, 2r + 8, 2r + 9`` and words ``4q .. 4q + 3``.
    """
    warps = [[1 << i, 0, 0] for i in range(W.bit_length() - 1)]
    k = gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 8, 0]],
                                   lane_bases=[[0, 0, 8], [0, 0, 16], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                   warp_bases=warps, block_bases=[], shape=[W, 16, 32])
    v = gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 8, 0]],
                                   lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
                                   warp_bases=warps, block_bases=[], shape=[W, 16, 32])
    return k, v


@gluon.jit
def _bytes_to_bf16(w):
    """int32 words of 4 E4M3 bytes -> their 4 bf16 values (b0, b1, b2, b3), exactly: the bit conversion of
    :func:`jetrl.quant.kernels.paged_attention_triton._load_e4m3_bytes`, as one PTX call per word."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 lo, hi, c, z; prmt.b32 lo, $4, 0, 0x9180; prmt.b32 hi, $4, 0, 0xB3A2; "
        "shl.b32 lo, lo, 4; shl.b32 hi, hi, 4; and.b32 lo, lo, 0x87F087F0; and.b32 hi, hi, 0x87F087F0; "
        "mov.b32 c, 0x7B807B80; mov.b32 z, 0x80008000; fma.rn.bf16x2 lo, lo, c, z; fma.rn.bf16x2 hi, hi, c, z; "
        "mov.b32 {$0, $1}, lo; mov.b32 {$2, $3}, hi; }",
        "=h,=h,=h,=h,r", [w], dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)


@gluon.jit
def _byte_pairs_to_bf16(a, b):
    """Words ``a`` of token t and ``b`` of token t + 1 -> 8 bf16 ``(a0, b0, a1, b1, a2, b2, a3, b3)`` (byte i of
    each): :func:`_bytes_to_bf16`'s conversion, with ``prmt`` pairing the same byte of the two tokens."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 r0, r1, r2, r3, c, z; prmt.b32 r0, $8, $9, 0xC480; prmt.b32 r1, $8, $9, 0xD591; "
        "prmt.b32 r2, $8, $9, 0xE6A2; prmt.b32 r3, $8, $9, 0xF7B3; "
        "shl.b32 r0, r0, 4; shl.b32 r1, r1, 4; shl.b32 r2, r2, 4; shl.b32 r3, r3, 4; "
        "and.b32 r0, r0, 0x87F087F0; and.b32 r1, r1, 0x87F087F0; and.b32 r2, r2, 0x87F087F0; "
        "and.b32 r3, r3, 0x87F087F0; mov.b32 c, 0x7B807B80; mov.b32 z, 0x80008000; "
        "fma.rn.bf16x2 r0, r0, c, z; fma.rn.bf16x2 r1, r1, c, z; fma.rn.bf16x2 r2, r2, c, z; "
        "fma.rn.bf16x2 r3, r3, c, z; mov.b32 {$0, $1}, r0; mov.b32 {$2, $3}, r1; mov.b32 {$4, $5}, r2; "
        "mov.b32 {$6, $7}, r3; }",
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [a, b], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)


@gluon.jit
def _scores(kw, k_s, t_ok, q_op, scale_log2, W: gl.constexpr):
    """Scores (W, 16, T) in log2 units of one tile per warp: the group's heads against the tile's K words."""
    mma: gl.constexpr = _layouts(W)[0]
    b_op: gl.constexpr = _layouts(W)[2]
    b0, b1, b2, b3 = _bytes_to_bf16(kw)
    k = gl.join(gl.join(b0, b2), gl.join(b1, b3)).reshape([W, T, D])  # (w, t, byte) in byte order
    # byte -> k-slot (K_SPLIT, K_ORDER): the B operand's registers as they are
    k = k.reshape([W, T, _KS0, _KS1, _KS2, _KS3]).permute(0, 1, _KO0, _KO1, _KO2, _KO3).reshape([W, T, D])
    k = gl.convert_layout(k.permute(0, 2, 1), b_op, assert_trivial=True)
    s = mma_v2(q_op, k, gl.zeros([W, 16, T], gl.float32, mma))
    s = s * gl.expand_dims(k_s * scale_log2, 1)  # exact: k_s is a power of two (the module doc)
    return gl.where(gl.expand_dims(t_ok, 1), s, float("-inf"))


@gluon.jit
def _accumulate(acc, vw, p, W: gl.constexpr):
    """acc (W, 128, 8) += V^T P^T over one tile per warp: ``p`` (W, 16, T) fp32, already times V's scales."""
    a_op: gl.constexpr = _layouts(W)[1]
    b_op: gl.constexpr = _layouts(W)[2]
    p_top, p_pad = p.to(gl.bfloat16).reshape([W, 2, 8, T]).permute(0, 2, 3, 1).split()  # rows 0..7, 8..15
    p_op = gl.convert_layout(p_top.permute(0, 2, 1), b_op, assert_trivial=True)  # (W, T, 8)
    even, odd = vw.reshape([W, T // 2, 2, 32]).permute(0, 1, 3, 2).split()  # words of tokens 2tp, 2tp + 1
    v0, v1, v2, v3, v4, v5, v6, v7 = _byte_pairs_to_bf16(even, odd)
    v = gl.join(gl.join(gl.join(v0, v1), gl.join(v4, v5)), gl.join(gl.join(v2, v3), gl.join(v6, v7)))
    # (w, tp, word, t bit, i1, i0): token 2tp + tbit, byte 4word + 2i1 + i0 -> (w, byte, token)
    v = v.permute(0, 2, 4, 5, 1, 3).reshape([W, D, T])
    # byte -> row (V_SPLIT, V_ORDER): the A operand's registers as they are
    v = v.reshape([W, _VS0, _VS1, _VS2, T]).permute(0, _VO0, _VO1, _VO2, 4).reshape([W, D, T])
    v = gl.convert_layout(v, a_op, assert_trivial=True)
    return mma_v2(v, p_op, acc)


@gluon.jit
def _tile_rows(tile, start, end, table_row, stride_b, stride_t, LAYOUT: gl.constexpr, PAGE: gl.constexpr,
               W: gl.constexpr, WIDE: gl.constexpr):
    """Element offsets (W, T) in ``LAYOUT`` (a 2-D layout) of the rows of warp w's tokens in tile ``tile``:
    ``start + (tile * W + w) * T + 0 .. T-1``, all in one page (``PAGE % T == 0``, splits of whole tiles). A tile
    past the context reads page 0 (any valid page: its tokens are masked in the scores, and a converted E4M3
    byte is always finite)."""
    w = gl.arange(0, W, layout=gl.SliceLayout(1, LAYOUT))
    t = gl.arange(0, T, layout=gl.SliceLayout(0, LAYOUT))
    t0 = start + (tile * W + w) * T
    page = gl.load(table_row + t0 // PAGE, mask=t0 < end, other=0)
    if WIDE:
        page = page.to(gl.int64)
    return gl.expand_dims(page * stride_b + (t0 % PAGE) * stride_t, 1) + gl.expand_dims(t, 0) * stride_t


@gluon.jit
def _copy_tile(tile, slot, start, end, table_row, k_head, v_head, ks_head, vs_head, k_ring, v_ring, ks_ring,
               vs_ring, stride_kb, stride_kt, stride_sb, stride_st, PAGE: gl.constexpr, W: gl.constexpr,
               WIDE: gl.constexpr):
    """Start copying tile ``tile`` of every warp into ring slot ``slot``: K and V words, each in the layout its
    reader uses (a thread reads back what it copied), and both scales."""
    lk: gl.constexpr = _word_layouts(W)[0]
    lv: gl.constexpr = _word_layouts(W)[1]
    ls: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [W, 1], [1, 0])  # (W, T): lane j < T copies token j
    word_k = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(0, lk)))
    rows = _tile_rows(tile, start, end, table_row, stride_kb, stride_kt, gl.SliceLayout(2, lk), PAGE, W, WIDE)
    _async_copy(k_ring.index(slot), k_head + gl.expand_dims(rows, 2) + gl.expand_dims(gl.expand_dims(word_k, 0), 0))
    word_v = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(0, lv)))
    rows = _tile_rows(tile, start, end, table_row, stride_kb, stride_kt, gl.SliceLayout(2, lv), PAGE, W, WIDE)
    _async_copy(v_ring.index(slot), v_head + gl.expand_dims(rows, 2) + gl.expand_dims(gl.expand_dims(word_v, 0), 0))
    rows = _tile_rows(tile, start, end, table_row, stride_sb, stride_st, ls, PAGE, W, WIDE)
    _async_copy(ks_ring.index(slot), ks_head + rows)
    _async_copy(vs_ring.index(slot), vs_head + rows)


@gluon.jit
def _paged_decode_streams_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, ctx_ptr, out_ptr, part_acc_ptr,
                                 part_ml_ptr, scale_log2, stride_qs, stride_qh, stride_kb,
                                 stride_kt, stride_kh, stride_sb, stride_st, stride_sh, stride_ts, stride_os,
                                 stride_oh, GROUP: gl.constexpr, PAGE: gl.constexpr, NUM_SPLITS: gl.constexpr,
                                 W: gl.constexpr, STAGES: gl.constexpr, WIDE: gl.constexpr):
    """One program per (KV head, sequence, split): the split's 16-token tiles round-robin over ``W`` warp streams,
    ``STAGES - 1`` tiles in flight per warp, the streams merged at the end. ``k_ptr``/``v_ptr`` are the caches as
    int32 words (their strides in words); the scales' strides in elements. Writes the normalized output, or with
    splits the partials (acc, m, l) of ``decode_splits.merge_splits``."""
    kv_head = gl.program_id(0)
    seq = gl.program_id(1)
    split = gl.program_id(2)
    num_kv_heads = gl.num_programs(0)
    mma: gl.constexpr = _layouts(W)[0]
    a_op: gl.constexpr = _layouts(W)[1]
    s_row: gl.constexpr = gl.SliceLayout(2, mma)  # (W, 16): per warp, a value per score row (head)
    s_col: gl.constexpr = gl.SliceLayout(1, mma)  # (W, T) per score column (token); (W, 8) per output column
    lk: gl.constexpr = _word_layouts(W)[0]
    lv: gl.constexpr = _word_layouts(W)[1]

    ctx = gl.load(ctx_ptr + seq)
    per_split = gl.cdiv(gl.cdiv(ctx, NUM_SPLITS), T) * T  # this sequence's share, whole tiles (each in one page)
    start = split * per_split
    end = gl.minimum(ctx, start + per_split)  # a split past the context runs no tile and writes l = 0
    table_row = tables_ptr + seq * stride_ts
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_kh
    ks_head = ks_ptr + kv_head * stride_sh
    vs_head = vs_ptr + kv_head * stride_sh

    # q (W, 16, 128): the group's heads (rows past GROUP zero), head_dim in the K operand's permuted order
    ql: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [W, 1, 1], [2, 1, 0])
    g = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, ql)))
    slot_k = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(0, ql)))
    byte = 32 * ((slot_k // 2) % 4) + 4 * (slot_k // 16) + 2 * ((slot_k // 8) % 2) + slot_k % 2  # K_SPLIT, K_ORDER
    wq = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, ql)))
    g3 = gl.expand_dims(gl.expand_dims(g, 0), 2) + gl.expand_dims(gl.expand_dims(wq * 0, 1), 2)  # (W, 16, 1)
    q = gl.load(q_ptr + seq * stride_qs + (kv_head * GROUP + g3) * stride_qh
                + gl.expand_dims(gl.expand_dims(byte, 0), 0), mask=g3 < GROUP, other=0.0)
    q_op = gl.convert_layout(q, a_op)

    words: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, order=[2, 1, 0])  # 16-byte chunks xor the token
    k_ring = gl.allocate_shared_memory(gl.int32, [STAGES, W, T, 32], words)
    v_ring = gl.allocate_shared_memory(gl.int32, [STAGES, W, T, 32], words)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    ks_ring = gl.allocate_shared_memory(gl.float32, [STAGES, W, T], flat)
    vs_ring = gl.allocate_shared_memory(gl.float32, [STAGES, W, T], flat)
    for tile in gl.static_range(STAGES - 1):
        _copy_tile(tile, tile, start, end, table_row, k_head, v_head, ks_head, vs_head, k_ring, v_ring, ks_ring,
                   vs_ring, stride_kb, stride_kt, stride_sb, stride_st, PAGE, W, WIDE)
        async_copy.commit_group()

    ws = gl.arange(0, W, layout=gl.SliceLayout(1, s_col))
    ts = gl.arange(0, T, layout=gl.SliceLayout(0, s_col))
    # a finite floor, not -inf: a warp whose tiles all lie past the context keeps m at it, alpha at 1 and l at 0
    m_i = gl.full([W, 16], -1.0e30, gl.float32, s_row)
    l_i = gl.zeros([W, 16], gl.float32, s_row)
    acc = gl.zeros([W, D, 8], gl.float32, mma)
    for i in range(gl.cdiv(gl.cdiv(end - start, T), W)):
        ahead = i + STAGES - 1
        _copy_tile(ahead, ahead % STAGES, start, end, table_row, k_head, v_head, ks_head, vs_head, k_ring, v_ring,
                   ks_ring, vs_ring, stride_kb, stride_kt, stride_sb, stride_st, PAGE, W, WIDE)
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)  # tile i has landed
        slot = i % STAGES
        kw = k_ring.index(slot).load(lk)
        vw = v_ring.index(slot).load(lv)
        k_s = ks_ring.index(slot).load(s_col)
        v_s = vs_ring.index(slot).load(s_col)
        t_ok = start + gl.expand_dims((i * W + ws) * T, 1) + gl.expand_dims(ts, 0) < end
        s = _scores(kw, k_s, t_ok, q_op, scale_log2, W)
        v_s = gl.where(t_ok, v_s, 0.0)  # a row past the context may hold any bits (a NaN scale): p * 0 there
        m_new = gl.maximum(m_i, gl.max(s, 2))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 2))
        l_i = l_i * alpha + gl.sum(p, 2)
        m_i = m_new
        alpha_top, alpha_pad = alpha.reshape([W, 2, 8]).permute(0, 2, 1).split()
        acc = acc * gl.expand_dims(gl.convert_layout(alpha_top, s_col), 1)
        acc = _accumulate(acc, vw, p * gl.expand_dims(v_s, 1), W)  # exact: v_s = 2^e (the module doc)
    async_copy.wait_group(0)

    # merge the warps' streams
    m_top, m_pad = m_i.reshape([W, 2, 8]).permute(0, 2, 1).split()
    l_top, l_pad = l_i.reshape([W, 2, 8]).permute(0, 2, 1).split()
    m_w = gl.convert_layout(m_top, s_col)
    m_all = gl.max(m_w, 0)
    weight = gl.exp2(m_w - gl.expand_dims(m_all, 0))
    l_all = gl.sum(gl.convert_layout(l_top, s_col) * weight, 0)
    o = gl.sum(acc * gl.expand_dims(weight, 1), 0)  # (128, 8): (row, head)
    ol: gl.constexpr = gl.SliceLayout(0, mma)
    row = gl.arange(0, D, layout=gl.SliceLayout(1, ol))
    d = 16 * (row % 8) + 2 * (row // 16) + (row // 8) % 2  # the head_dim of each output row: V_SPLIT, V_ORDER
    head = gl.arange(0, 8, layout=gl.SliceLayout(0, ol))
    heads = kv_head * GROUP + head
    l_all = gl.convert_layout(l_all, gl.SliceLayout(0, ol))
    m_all = gl.convert_layout(m_all, gl.SliceLayout(0, ol))
    if NUM_SPLITS == 1:
        out = o / gl.expand_dims(gl.where(l_all > 0, l_all, 1.0), 0)
        gl.store(out_ptr + seq * stride_os + gl.expand_dims(heads, 0) * stride_oh + gl.expand_dims(d, 1),
                 out.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(head < GROUP, 0))
    else:  # partials: acc (S, Hq, NUM_SPLITS, 128) and (m, l) (S, Hq, NUM_SPLITS, 2), fp32, contiguous
        base = (seq * num_kv_heads * GROUP + heads) * NUM_SPLITS + split
        gl.store(part_acc_ptr + gl.expand_dims(base, 0) * D + gl.expand_dims(d, 1), o,
                 mask=gl.expand_dims(head < GROUP, 0))
        gl.store(part_ml_ptr + base * 2, gl.where(l_all > 0, m_all, float("-inf")), mask=head < GROUP)
        gl.store(part_ml_ptr + base * 2 + 1, l_all, mask=head < GROUP)


def supports(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor, k_scale: torch.Tensor,
             v_scale: torch.Tensor) -> bool:
    """The shapes this kernel takes (on CUDA tensors): a bf16 query with ``head_dim`` 128 and at most
    :data:`MAX_GROUP` query heads per KV head, over an FP8 cache (``float8_e4m3fn`` K and V of the same strides,
    pages of a multiple of 16 tokens, rows of whole 4-byte words, 16-byte aligned) with scales of the same strides,
    at most 65,535 sequences. The caller has checked the cache (``check_kv_cache``)."""
    num_seqs, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache_layer.shape
    return (q.dtype == torch.bfloat16 and head_dim == HEAD_DIM and k_cache_layer.dtype == E4M3
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP and page % TILE == 0
            and 0 < num_seqs <= MAX_GRID_Y and k_cache_layer.stride() == v_cache_layer.stride()
            and k_scale.stride() == v_scale.stride() and k_cache_layer.stride(-1) == 1
            and all(s % 4 == 0 for s in k_cache_layer.stride()[:3])
            and k_cache_layer.data_ptr() % 16 == 0 and v_cache_layer.data_ptr() % 16 == 0)


# The context from which a split aims for the tuning's full ``waves``; shorter contexts aim for fewer programs, down
# to half of them (see num_splits).
FULL_WAVES_CONTEXT = 4096


def num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, sm_count: int, num_warps: int, waves: float,
               max_splits: int) -> int:
    """Context splits per sequence: enough programs for ``waves`` programs per SM (``ceil(waves * SMs)`` over the
    ``num_seqs * num_kv_heads`` programs of one split, rounded up), at most ``max_splits``, and never more splits
    than the longest context has rounds of ``num_warps`` tiles.

    ``waves`` holds from :data:`FULL_WAVES_CONTEXT` tokens of context on and shrinks in proportion below it, to
    half at most: a short context's programs are short, so the merge launch and each program's set-up weigh more
    against the parallelism a further split buys (BENCHMARKS.md, "Decode attention"). In the rollout's CUDA
    graphs ``max_context_len`` is the engine's longest context, so the split follows the setting, not the step."""
    programs = max(num_seqs * num_kv_heads, 1)
    waves *= min(1.0, max(0.5, max_context_len / FULL_WAVES_CONTEXT))
    want = -(-math.ceil(waves * sm_count) // programs)
    rounds = max(-(-max(max_context_len, 1) // (num_warps * TILE)), 1)
    return int(max(1, min(want, max_splits, rounds)))


def paged_decode_streams(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor, meta,
                         softmax_scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor, *, num_warps: int,
                         stages: int, waves: float, max_splits: int, splits: int | None = None,
                         max_registers: int = 0) -> torch.Tensor:
    """Decode attention of q (S, Hq, 128) bf16 over the FP8 paged cache -> (S, Hq, 128) bf16, where
    :func:`supports` holds: ``num_warps`` warp streams per program, ``stages`` ring slots (>= 2), ``splits`` context
    splits per sequence (None or 0: :func:`num_splits`), at most ``max_registers`` registers per thread (0: the
    compiler's choice). No host synchronisation (the grid depends on shapes and
    ``meta.max_context_len``): a decode step using it can be captured in a CUDA graph."""
    num_seqs, num_heads, _ = q.shape
    num_kv_heads = k_cache_layer.shape[2]
    group = num_heads // num_kv_heads
    if not splits:
        splits = num_splits(num_seqs, num_kv_heads, int(meta.max_context_len), sm_count(q.device), num_warps,
                            waves, max_splits)
    elif splits < 0:
        raise ValueError(f"paged_decode_streams: splits must be positive (or None/0: the default), got {splits}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    part_acc, part_ml = split_partials(out, splits, HEAD_DIM)
    k_words, v_words, tables = k_cache_layer.view(torch.int32), v_cache_layer.view(torch.int32), meta.block_tables
    _paged_decode_streams_kernel[(num_kv_heads, num_seqs, splits)](
        q, k_words, v_words, k_scale, v_scale, tables, meta.context_lens, out, part_acc, part_ml,
        float(softmax_scale) * LOG2E, *q.stride()[:2], *k_words.stride()[:3], *k_scale.stride()[:3], tables.stride(0),
        *out.stride()[:2], GROUP=group, PAGE=k_cache_layer.shape[1], NUM_SPLITS=splits, W=num_warps,
        STAGES=stages, WIDE=cache_offsets_wide(k_words, v_words, k_scale, v_scale), num_warps=num_warps,
        maxnreg=max_registers or None, **COMPILE_OPTIONS)
    merge_splits(part_acc, part_ml, out, splits, HEAD_DIM)
    return out


__all__ = ["paged_decode_streams", "supports", "num_splits", "TILE", "HEAD_DIM", "MAX_GROUP", "FULL_WAVES_CONTEXT"]
