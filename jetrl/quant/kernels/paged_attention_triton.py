"""Triton paged-attention decode: one new query token per sequence against its paged K/V (GQA).

Same semantics as :func:`jetrl.models.attention.paged_attention_reference` for decode steps (each
sequence's single query sees cache positions ``< context_lens[s]``), read directly from the block pool:

* one program per (sequence, KV head, context split) loads the ``G = Hq / Hkv`` query heads that share
  the KV head (padded to 16 rows for ``tl.dot``), so every K/V byte is read once for its whole group;
* it walks the sequence's tokens ``BLOCK_N`` at a time, gathering each token's row through the block
  table (one contiguous ``head_dim`` row per token), with an online (flash) softmax in fp32;
* when the batch alone cannot fill the GPU, the context is split across programs (flash-decoding) and a
  second small kernel merges the partial results by their log-sum-exp
  (:func:`jetrl.quant.kernels.decode_splits.merge_splits_kernel`).

Over an FP8 cache, :func:`paged_decode` hands the step to the Gluon kernel of
:mod:`jetrl.quant.kernels.paged_attention_gluon` wherever that one applies (the tuning's ``kv_decode_streams``): this
kernel reads an FP8 cache well below copy bandwidth (BENCHMARKS.md, "Decode attention"), that one near it.
Everything below is this kernel.

**An FP8 cache** (E4M3 K/V, one power-of-two fp32 scale ``2^e`` per token and KV head, written by
``jetrl.models.attention.quantize_kv``) is read without dequantizing it. Each E4M3 tile becomes q's dtype exactly
(every E4M3 value is a bf16 and fp32 value) by integer bit operations (:func:`_load_e4m3_bytes`, no conversion
instruction: Triton's own conversion, compiled for sm_90, goes through fp16 on the slow conversion pipe and reads
the V tile from shared memory a byte at a time, as 8-bit operands have no transposing ``ldmatrix`` on Hopper) and
goes straight into ``tl.dot``. The per-token scales act on the dots' fp32 sides instead:

* scores: ``s = dot(q, k8^T) * (k_scale * softmax_scale * log2(e))`` per key column, which is bitwise
  ``(dot(q, k8^T) * k_scale) * softmax_scale * log2(e)`` (``k_scale`` is a power of two) and equals
  ``dot(q, (k8 * k_scale)^T)``, the scores over the dequantized keys, for any fixed summation order: multiplying by
  ``2^e`` commutes with fp32 rounding while results stay normal (``jetrl.models.attention.dequantize_kv`` gives
  the ranges; only terms below ``2^-126`` could differ, and they vanish in the sum);
* values: ``acc += dot((p * v_scale).to(q.dtype), v8)`` per key row: ``bf16(p * 2^e) = bf16(p) * 2^e`` while
  ``p * 2^e >= 2^-126``, so the products are those of ``dot(bf16(p), v8 * v_scale)``, the BF16-cache kernel's over
  the dequantized values; only probabilities below ``2^-104`` (weights that vanish against the row's largest, 1)
  may round differently. An fp32 query is the same with no rounding of ``p``.

So the FP8 kernel is the BF16-cache kernel over ``dequantize_kv(cache)`` to summation order: bit for bit where
both run one dot implementation at one tile size and no term falls below ``2^-126`` (fp32 under the interpreter);
on the GPU the two score dots see different operands, so the MMA's accumulation may round them apart. A float16
query cannot take this route (fp16's 5 exponent bits do not hold ``p * 2^e``): its K/V tiles are dequantized in
registers to ``dequantize_kv(data, scale, float16)`` (:func:`_load_kv_rows`), bitwise the kernel over that cache.
An FP8 tile holds :data:`FP8_BLOCK_N` = 128 tokens, a tile in q's dtype :data:`BLOCK_N` = 64: the same bytes per
tile, half the loop trips. The factored route is the tuning's ``kv_decode_factored``; off, every FP8 tile is
dequantized in registers as for an fp16 query. The launch over an FP8 cache is the tuning's ``kv_decode_*`` fields
(:func:`launch_config`), swept by ``bench/attention.py``; a cache in q's dtype keeps :data:`BF16_LAUNCH`.

The launch over an FP8 cache puts the KV heads of a sequence on neighbouring programs (a head-major grid, up to
65,535 sequences), so that a 32-byte sector of scales (8 heads of one token) and a block-table row are read from
DRAM once while the heads that share them run. Neither that order nor the register cap
(``kv_decode_max_registers``) changes a bit.

No host synchronisation: the grid depends only on tensor shapes and the host-side ``max_context_len``,
so a decode step using it can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jetrl.quant.formats import E4M3
from jetrl.quant.kernels import tuning
from jetrl.quant.kernels.decode_splits import (LOG2E, MAX_GRID_Y, cache_offsets_wide, merge_splits, sm_count,
                                               split_partials)
from jetrl.quant.kernels.quantize_triton import cast_rne
from jetrl.quant.kernels.tuning import COMPILE_OPTIONS

_INTERPRETED = tuning.interpreting()


BLOCK_N = 64  # tokens per tile over a cache in q's dtype
FP8_BLOCK_N = 128  # tokens per tile over an FP8 cache read as E4M3 tiles: the same bytes per tile


@triton.jit
def _load_kv_rows(head_ptr, scale_head_ptr, page, row, t_ok, kv_mask, d, stride_b, stride_t, stride_sb, stride_st,
                  OUT_DTYPE: tl.constexpr, FP8: tl.constexpr):
    """K or V rows (BLOCK_N, BLOCK_D) of tokens at (``page``, ``row``), masked lanes 0. With ``FP8`` the cache holds
    E4M3 and ``scale_head_ptr`` one fp32 scale per (token, KV head): the rows are dequantized in registers exactly
    like ``jetrl.models.attention.dequantize_kv``, ``(data.float() * scale).to(OUT_DTYPE)`` (RNE), so the math
    that follows sees the values of the dequantized cache bit for bit (with power-of-two scales and a bf16 or fp32
    ``OUT_DTYPE`` the rounding is exact; in fp16 it rounds)."""
    x = tl.load(head_ptr + page[:, None] * stride_b + row[:, None] * stride_t + d[None, :], mask=kv_mask, other=0.0)
    if FP8:
        s = tl.load(scale_head_ptr + page * stride_sb + row * stride_st, mask=t_ok, other=0.0)  # (BLOCK_N,)
        x = cast_rne(x.to(tl.float32) * s[:, None], OUT_DTYPE)
    return x


@triton.jit
def _load_e4m3_bytes(head_ptr, off, t_ok, d, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr, PTX: tl.constexpr):
    """E4M3 rows (BLOCK_N, BLOCK_D) of tokens at element offsets ``off`` (BLOCK_N,) from ``head_ptr`` -> ``DTYPE``
    (bfloat16 or float32) exactly, with no conversion instruction: integer bit operations and one multiply (masked
    lanes 0; any cache layout).

    Each E4M3 byte's sign, exponent and mantissa bits are placed into a ``DTYPE`` word whose exponent bias is 127, not
    E4M3's 7, so the word reads ``x * 2^-120`` (E4M3 subnormals land on ``DTYPE`` subnormals, zero on zero);
    multiplying by ``2^120`` restores ``x`` exactly. In bfloat16 the inline PTX takes 4 bytes per call (one 32-bit
    register: per pair one ``prmt``, ``shl``, ``and`` and ``fma.rn.bf16x2`` by ``2^120`` with ``-0`` added, signed
    zeros kept) and returns two bf16x2 registers in byte order, so the result needs no join or reshape. It is
    declared impure on purpose: Triton then keeps the conversion in the load's layout and stops there when it sizes
    the dots' operands, so both dots run bf16 operands of ``kWidth`` 2 as over a BF16 cache (``ldmatrix``,
    transposing for V). A pure call is seen through: Triton then converts V in the dot's layout, a byte at a time
    from shared memory. The interpreter and an fp32 ``DTYPE`` convert with Triton's integer ops (the same values)."""
    b = tl.load(head_ptr + off[:, None] + d[None, :], mask=t_ok[:, None] & (d < HEAD_DIM)[None, :],
                other=0.0).to(tl.uint8, bitcast=True)
    if PTX and DTYPE == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 c, z; prmt.b32 $0, $2, 0, 0x9180; prmt.b32 $1, $2, 0, 0xB3A2; "
            "shl.b32 $0, $0, 4; shl.b32 $1, $1, 4; and.b32 $0, $0, 0x87F087F0; and.b32 $1, $1, 0x87F087F0; "
            "mov.b32 c, 0x7B807B80; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $0, c, z; fma.rn.bf16x2 $1, $1, c, z; }",
            "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=False, pack=4)
    else:
        b = b.to(tl.int32)
        x = (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)
        return (x * tl.full([], 2.0 ** 120, tl.float32)).to(DTYPE)  # exact


@triton.jit
def _attend_tile(q, m_i, l_i, acc, t, end, d, d_ok, table_row, k_head, v_head, ks_head, vs_head, scale_log2,
                 stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
                 PAGE: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, FACTORED: tl.constexpr,
                 SHARED_OFFSETS: tl.constexpr, WIDE_OFFSETS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 WHILE_LOOP: tl.constexpr):
    """One tile of tokens ``t`` (BLOCK_N,): gather K/V rows through the block table, online softmax update.

    ``FACTORED`` (an FP8 cache, q bf16 or fp32): the E4M3 tiles go to the dots through the bit conversion
    (:func:`_load_e4m3_bytes`) and the scales multiply the dots' fp32 sides (the module doc says why that is the
    attention over the dequantized cache). Its address arithmetic is also trimmed: page and row by unsigned division
    (``t >= 0``), offsets in 32 bits unless ``WIDE_OFFSETS`` (an offset into a cache or scale tensor may pass
    ``2^31 - 1``), and one offset per token for K and V (and one for their scales) when they share their strides
    (``SHARED_OFFSETS``). Otherwise the tiles are in q's dtype, or (``FP8``, q fp16) dequantized in registers."""
    t_ok = t < end
    if FACTORED:
        tp = (t.to(tl.uint32, bitcast=True) // PAGE).to(tl.int32, bitcast=True)
        page = tl.load(table_row + tp, mask=t_ok, other=0)
        row = t - tp * PAGE
        if WIDE_OFFSETS:
            page = page.to(tl.int64)
        k_off = page * stride_kb + row * stride_kt
        ks_off = page * stride_ksb + row * stride_kst
        if SHARED_OFFSETS:
            v_off = k_off
            vs_off = ks_off
        else:
            v_off = page * stride_vb + row * stride_vt
            vs_off = page * stride_vsb + row * stride_vst
        k = _load_e4m3_bytes(k_head, k_off, t_ok, d, HEAD_DIM, q.dtype, not WHILE_LOOP)
        k_s = tl.load(ks_head + ks_off, mask=t_ok, other=0.0)  # (BLOCK_N,)
    else:
        page = tl.load(table_row + t // PAGE, mask=t_ok, other=0).to(tl.int64)
        row = t % PAGE
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = _load_kv_rows(k_head, ks_head, page, row, t_ok, kv_mask, d, stride_kb, stride_kt, stride_ksb, stride_kst,
                          q.dtype, FP8)  # (BLOCK_N, BLOCK_D)
    s = tl.dot(q, tl.trans(k), input_precision="ieee" if IEEE else None)  # (BLOCK_G, BLOCK_N), fp32 accumulation
    if FACTORED:
        s = s * (k_s * scale_log2)[None, :]  # k_s * scale_log2 is exact (k_s = 2^e)
    else:
        s = s * scale_log2
    s = tl.where(t_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FACTORED:
        v = _load_e4m3_bytes(v_head, v_off, t_ok, d, HEAD_DIM, q.dtype, not WHILE_LOOP)
        v_s = tl.load(vs_head + vs_off, mask=t_ok, other=0.0)
        p = p * v_s[None, :]  # exact (v_s = 2^e) unless below 2^-126
    else:
        v = _load_kv_rows(v_head, vs_head, page, row, t_ok, kv_mask, d, stride_vb, stride_vt, stride_vsb, stride_vst,
                          q.dtype, FP8)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee" if IEEE else None)
    return m_new, l_i, acc


@triton.jit
def _sequence_and_head(tables_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, seq, kv_head, stride_ts, stride_kh, stride_vh,
                       stride_ksh, stride_vsh):
    """The block-table row of sequence ``seq`` and the K, V (and, for an FP8 cache, their scales') pointers of
    KV head ``kv_head``: (table row, k, v, k scale, v scale)."""
    return (tables_ptr + seq.to(tl.int64) * stride_ts, k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh,
            ks_ptr + kv_head * stride_ksh, vs_ptr + kv_head * stride_vsh)


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, ctx_ptr, out_ptr, part_acc_ptr,
                         part_ml_ptr, scale_log2, tokens_per_split,
                         stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                         stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                         stride_ts, stride_os, stride_oh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                         FP8: tl.constexpr, FACTORED: tl.constexpr, SHARED_OFFSETS: tl.constexpr,
                         WIDE_OFFSETS: tl.constexpr, HEAD_MAJOR: tl.constexpr, WHILE_LOOP: tl.constexpr):
    if HEAD_MAJOR:  # grid (Hkv, S, splits): the KV heads of a sequence are neighbouring programs
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:  # grid (S, Hkv, splits)
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    split = tl.program_id(2)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g  # (BLOCK_G,) query heads of this KV head

    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_G, BLOCK_D)

    ctx = tl.load(ctx_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(ctx, start + tokens_per_split)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row, k_head, v_head, ks_head, vs_head = _sequence_and_head(  # scale pointers: unused unless FP8
        tables_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, seq, kv_head, stride_ts, stride_kh, stride_vh, stride_ksh, stride_vsh)
    if WHILE_LOOP:  # the interpreter cannot iterate a range over loaded values
        t0 = start
        while t0 < end:
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, t0 + n, end, d, d_ok, table_row, k_head, v_head, ks_head,
                                         vs_head, scale_log2, stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb,
                                         stride_kst, stride_vsb, stride_vst, PAGE, IEEE, FP8, FACTORED,
                                         SHARED_OFFSETS, WIDE_OFFSETS, HEAD_DIM, WHILE_LOOP)
            t0 += BLOCK_N
    else:
        for t0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, t0 + n, end, d, d_ok, table_row, k_head, v_head, ks_head,
                                         vs_head, scale_log2, stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb,
                                         stride_kst, stride_vsb, stride_vst, PAGE, IEEE, FP8, FACTORED,
                                         SHARED_OFFSETS, WIDE_OFFSETS, HEAD_DIM, WHILE_LOOP)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        # partials: acc (S, Hq, NUM_SPLITS, BLOCK_D) and (m, l) (S, Hq, NUM_SPLITS, 2), fp32, contiguous
        base = (seq * num_kv_heads * GROUP + heads) * NUM_SPLITS + split  # (BLOCK_G,)
        tl.store(part_acc_ptr + base[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])
        tl.store(part_ml_ptr + base * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=g_ok)


def check_kv_cache(what: str, q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor,
                   k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Check q (N, Hq, D) and a paged K/V cache layer (num_blocks, block_size, Hkv, D, head_dim contiguous) for the
    attention kernels; returns whether the cache is FP8.

    A cache in the model's dtype comes without scales. An FP8 cache is ``float8_e4m3fn`` K and V with ``k_scale`` and
    ``v_scale``: fp32 (num_blocks, block_size, Hkv), one scale per (token, KV head), on the cache's device.
    """
    if k_cache_layer.shape[3] != q.shape[2] or q.shape[1] % k_cache_layer.shape[2]:
        raise ValueError(f"{what}: q {tuple(q.shape)} does not match the cache {tuple(k_cache_layer.shape)}")
    if k_cache_layer.stride(-1) != 1 or v_cache_layer.stride(-1) != 1:
        raise ValueError(f"{what} needs the cache's head_dim to be contiguous")
    if k_cache_layer.shape != v_cache_layer.shape or k_cache_layer.dtype != v_cache_layer.dtype:
        raise ValueError(f"{what}: K and V caches differ: {tuple(k_cache_layer.shape)} {k_cache_layer.dtype} vs "
                         f"{tuple(v_cache_layer.shape)} {v_cache_layer.dtype}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"{what}: give both k_scale and v_scale (an FP8 cache) or neither (a {q.dtype} cache)")
    fp8 = k_cache_layer.dtype == E4M3
    if not fp8:
        if k_scale is not None:
            raise ValueError(f"{what}: k_scale/v_scale given but the cache is {k_cache_layer.dtype}, not {E4M3}")
        return False
    if k_scale is None:
        raise ValueError(f"{what}: the cache is {E4M3} but no k_scale/v_scale were given (one fp32 scale per "
                         "token and KV head)")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: q must be bfloat16/float16/float32 to attend over an FP8 cache, got {q.dtype}")
    want = tuple(k_cache_layer.shape[:3])
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale.dtype != torch.float32 or tuple(scale.shape) != want:
            raise ValueError(f"{what}: {name} must be float32 of shape {want} (num_blocks, block_size, Hkv), got "
                             f"{scale.dtype} {tuple(scale.shape)}")
        if scale.device != k_cache_layer.device:
            raise ValueError(f"{what}: {name} is on {scale.device}, the cache on {k_cache_layer.device}")
    return True


def _streams_apply(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor, k_scale: torch.Tensor,
                   v_scale: torch.Tensor) -> bool:
    """Whether the Gluon kernel (:mod:`jetrl.quant.kernels.paged_attention_gluon`) takes this FP8-cache decode step:
    a CUDA query, the installed Triton has Gluon and the kernel supports the shapes (imported only then)."""
    from jetrl.quant.kernels.quantize_gluon import available

    if not (q.is_cuda and available()):
        return False
    from jetrl.quant.kernels.paged_attention_gluon import supports

    return supports(q, k_cache_layer, v_cache_layer, k_scale, v_scale)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device,
                      block_n: int = BLOCK_N, waves: float = 2.0, max_splits: int = 16) -> int:
    """Context splits per sequence: enough programs for about ``waves`` waves on the GPU (``ceil(waves * SMs)``
    programs over the ``num_seqs * num_kv_heads`` of one split, rounded up), at most ``max_splits``, and never more
    splits than ``block_n``-token tiles in the longest context. The defaults are the BF16-cache kernel's; over an
    FP8 cache :func:`paged_decode` passes the tuning's ``kv_decode_split_waves`` and ``kv_decode_max_splits``."""
    programs = max(num_seqs * num_kv_heads, 1)
    want = -(-math.ceil(waves * sm_count(device)) // programs)
    tiles = max(-(-max(max_context_len, 1) // block_n), 1)
    return int(max(1, min(want, max_splits, tiles)))


@dataclass(frozen=True)
class DecodeLaunch:
    """The decode kernel's launch: tokens per tile, Triton warps and pipeline stages, the context-split policy
    (:func:`choose_num_splits`'s ``waves`` and ``max_splits``) and a cap on registers per thread (``maxnreg``; 0: the
    compiler's choice)."""

    block_n: int
    num_warps: int
    num_stages: int
    split_waves: float
    max_splits: int
    max_registers: int = 0


BF16_LAUNCH = DecodeLaunch(block_n=BLOCK_N, num_warps=4, num_stages=2, split_waves=2.0, max_splits=16)


def launch_config(fp8: bool, factored: bool) -> DecodeLaunch:
    """The launch :func:`paged_decode` uses by default (no ``block_n``/``num_splits`` given) under the tuning in force:
    a cache in q's dtype :data:`BF16_LAUNCH`; an FP8 cache the tuning's ``kv_decode_*`` fields, whose
    ``kv_decode_block_n`` 0 means :data:`FP8_BLOCK_N` on the factored route and :data:`BLOCK_N` in registers."""
    if not fp8:
        return BF16_LAUNCH
    knobs = tuning.current()
    return DecodeLaunch(block_n=knobs.kv_decode_block_n or (FP8_BLOCK_N if factored else BLOCK_N),
                        num_warps=knobs.kv_decode_num_warps, num_stages=knobs.kv_decode_num_stages,
                        split_waves=knobs.kv_decode_split_waves, max_splits=knobs.kv_decode_max_splits,
                        max_registers=knobs.kv_decode_max_registers)


def paged_decode(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor, meta,
                 softmax_scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, *,
                 num_splits: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Decode attention: q (S, Hq, D) (one row per sequence) over the paged cache -> (S, Hq, D) in q's dtype.

    ``meta`` is a :class:`~jetrl.models.attention.PagedAttentionMetadata` with ``max_query_len == 1``;
    ``num_splits`` overrides the context split and ``block_n`` the tokens per tile (a power of two >= 16); by default
    both come from :func:`launch_config`. The cache is in q's dtype, or FP8: ``float8_e4m3fn`` K/V with
    ``k_scale``/``v_scale`` (num_blocks, block_size, Hkv) fp32 powers of two (as ``jetrl.models.attention.quantize_kv``
    writes them): with a bf16 or fp32 query equal to this function over the dequantized cache
    (``jetrl.models.attention.dequantize_kv``) to summation order, within ``2^-126`` terms; with an fp16 query bit for
    bit (the module doc). Where the tuning's ``kv_decode_streams`` is on and
    :func:`jetrl.quant.kernels.paged_attention_gluon.supports` holds, an FP8-cache step runs on that Gluon kernel
    instead (``num_splits`` kept; an explicit ``block_n``, a tile of this kernel, keeps this kernel).
    """
    if meta.max_query_len != 1:
        raise ValueError("paged_decode handles decode steps only (one new token per sequence)")
    num_seqs, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache_layer.shape
    if meta.block_tables.shape[0] != num_seqs:
        raise ValueError(f"paged_decode: {num_seqs} query rows but {meta.block_tables.shape[0]} sequences")
    fp8 = check_kv_cache("paged_decode", q, k_cache_layer, v_cache_layer, k_scale, v_scale)
    knobs = tuning.current()
    if fp8 and block_n is None and knobs.kv_decode_streams and _streams_apply(q, k_cache_layer, v_cache_layer,
                                                                             k_scale, v_scale):
        from jetrl.quant.kernels.paged_attention_gluon import paged_decode_streams

        return paged_decode_streams(q, k_cache_layer, v_cache_layer, meta, softmax_scale, k_scale, v_scale,
                                    num_warps=knobs.kv_decode_stream_warps, stages=knobs.kv_decode_stream_stages,
                                    waves=knobs.kv_decode_stream_waves,
                                    max_splits=knobs.kv_decode_stream_max_splits, splits=num_splits,
                                    max_registers=knobs.kv_decode_stream_max_registers)
    # fp16 cannot hold p * 2^e (see the module doc): an fp16 query dequantizes in registers
    factored = fp8 and q.dtype != torch.float16 and knobs.kv_decode_factored
    head_major = fp8 and num_seqs <= MAX_GRID_Y  # a sequence's KV heads as neighbours (the module doc)
    launch = launch_config(fp8, factored)
    if not fp8:
        k_scale = v_scale = k_cache_layer  # unused by the kernel; any tensor with 3 strides
    # the factored route's offsets: one for K and V (and their scales) where the strides agree, 32 bits where they fit
    shared_offsets = k_cache_layer.stride() == v_cache_layer.stride() and k_scale.stride() == v_scale.stride()
    wide_offsets = cache_offsets_wide(k_cache_layer, v_cache_layer, k_scale, v_scale)
    if block_n is None:
        block_n = launch.block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"paged_decode: block_n must be a power of two >= 16, got {block_n}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = num_heads // num_kv_heads
    splits = num_splits or choose_num_splits(num_seqs, num_kv_heads, meta.max_context_len, q.device, block_n,
                                             launch.split_waves, launch.max_splits)
    tokens_per_split = -(-max(int(meta.max_context_len), 1) // splits)
    tokens_per_split = -(-tokens_per_split // block_n) * block_n
    block_d = triton.next_power_of_2(head_dim)
    block_g = max(16, triton.next_power_of_2(group))
    tables, ctx = meta.block_tables, meta.context_lens
    out = torch.empty_like(q)
    part_acc, part_ml = split_partials(out, splits, block_d)
    grid = (num_kv_heads, num_seqs, splits) if head_major else (num_seqs, num_kv_heads, splits)
    _paged_decode_kernel[grid](
        q, k_cache_layer, v_cache_layer, k_scale, v_scale, tables, ctx, out, part_acc, part_ml,
        float(softmax_scale) * LOG2E, tokens_per_split, *q.stride()[:2], *k_cache_layer.stride()[:3],
        *v_cache_layer.stride()[:3], *k_scale.stride()[:3], *v_scale.stride()[:3], tables.stride(0), *out.stride()[:2],
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, NUM_SPLITS=splits, BLOCK_G=block_g, BLOCK_D=block_d,
        BLOCK_N=block_n, IEEE=q.dtype == torch.float32, FP8=fp8, FACTORED=factored, SHARED_OFFSETS=shared_offsets,
        WIDE_OFFSETS=wide_offsets, HEAD_MAJOR=head_major, WHILE_LOOP=_INTERPRETED,
        num_warps=launch.num_warps, num_stages=launch.num_stages, maxnreg=launch.max_registers or None,
        **COMPILE_OPTIONS)
    merge_splits(part_acc, part_ml, out, splits, block_d)
    return out


__all__ = ["paged_decode", "choose_num_splits", "check_kv_cache", "launch_config", "DecodeLaunch", "BF16_LAUNCH",
           "BLOCK_N", "FP8_BLOCK_N"]
