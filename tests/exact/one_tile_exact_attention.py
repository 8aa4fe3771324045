"""Exact mode's attention kernel as it was before the multi-tile schedule, kept verbatim (its module docstring
aside; its chunk update has since made the row sum an MMA over the rounded probabilities, as the kernel's
specification now says) as the reference the kernel must reproduce bit for bit for every
``exact_attention_tiles_per_program``: one program per (tile of up to 16 query rows at GQA group 4, KV head), one
program per query row in the grid. Test-only; used by test_exact_tiles_interpret.py and test_exact_tiles_gpu.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.quant.kernels.paged_attention_triton import _LOG2E, _load_kv_rows, check_kv_cache
from jetrl.quant.kernels.tuning import COMPILE_OPTIONS, interpreting
from jetrl.quant.reference import EXACT_KV_CHUNK

_INTERPRETED = interpreting()


ROWS_PER_PROGRAM = 64  # MMA rows of every program: query rows x their group's heads (padded to a power of two)


@triton.jit
def _exact_attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, qsl_ptr, ctx_ptr, tile_seq_ptr,
                            tile_start_ptr, out_ptr, scale_log2,
                            stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                            stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                            stride_ts, stride_on, stride_oh,
                            GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                            BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                            FP8: tl.constexpr, WHILE_LOOP: tl.constexpr):
    """One program: up to BLOCK_Q consecutive query rows of one sequence x the GROUP heads of one KV head, as
    BLOCK_Q * GROUP_P2 rows of every ``tl.dot`` (the same shape for a decode row alone and a training tile)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    if seq < 0:  # past the last tile (the grid is an upper bound, fixed without a host sync)
        return
    first = tl.load(tile_start_ptr + tile)
    seq_end = tl.load(qsl_ptr + seq + 1)
    ctx = tl.load(ctx_ptr + seq)
    j = tl.arange(0, BLOCK_Q * GROUP_P2)
    rows = first + j // GROUP_P2  # (R,) query row of each MMA row
    g = j % GROUP_P2
    heads = kv_head * GROUP + g
    row_ok = (rows < seq_end) & (g < GROUP)
    # visible key positions < limit; a padding row attends to position 0 (finite, never stored)
    limit = tl.where(row_ok, ctx - (seq_end - 1 - rows), 1)
    limit = tl.maximum(limit, 1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (R, BLOCK_D)
    m_i = tl.full([BLOCK_Q * GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P2, BLOCK_D], tl.float32)
    table_row = tables_ptr + seq.to(tl.int64) * stride_ts
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    ks_head = ks_ptr + kv_head * stride_ksh  # unused unless FP8
    vs_head = vs_ptr + kv_head * stride_vsh
    end = tl.max(limit, 0)  # the tile's furthest key; chunks past a row's own end leave its state unchanged
    n = tl.arange(0, BLOCK_N)
    if WHILE_LOOP:  # the interpreter cannot iterate a range over loaded values
        t0 = 0
        while t0 < end:
            m_i, l_i, acc = _attend_chunk(q, m_i, l_i, acc, t0 + n, limit, end, d, d_ok, table_row, k_head, v_head,
                                          ks_head, vs_head, scale_log2, stride_kb, stride_kt, stride_vb, stride_vt,
                                          stride_ksb, stride_kst, stride_vsb, stride_vst, PAGE, IEEE, FP8)
            t0 += BLOCK_N
    else:
        for t0 in range(0, end, BLOCK_N):
            m_i, l_i, acc = _attend_chunk(q, m_i, l_i, acc, t0 + n, limit, end, d, d_ok, table_row, k_head, v_head,
                                          ks_head, vs_head, scale_log2, stride_kb, stride_kt, stride_vb, stride_vt,
                                          stride_ksb, stride_kst, stride_vsb, stride_vst, PAGE, IEEE, FP8)
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_on + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _attend_chunk(q, m_i, l_i, acc, t, limit, end, d, d_ok, table_row, k_head, v_head, ks_head, vs_head, scale_log2,
                  stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
                  PAGE: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr):
    """One chunk of key positions ``t`` (BLOCK_N,) for every MMA row: gather K/V through the block table (an FP8
    cache dequantized in registers, exactly), mask each row's invisible keys (``t >= limit``), online-softmax
    update. A fully masked row keeps its state exactly (``exp2(0) = 1``, its probabilities 0), so a row's bits do
    not depend on the tile's other rows."""
    t_ok = t < end
    page = tl.load(table_row + t // PAGE, mask=t_ok, other=0).to(tl.int64)
    slot = t % PAGE
    kv_mask = t_ok[:, None] & d_ok[None, :]
    k = _load_kv_rows(k_head, ks_head, page, slot, t_ok, kv_mask, d, stride_kb, stride_kt, stride_ksb, stride_kst,
                      q.dtype, FP8)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))  # (R, BLOCK_N), fp32 accumulation
    s = tl.where(t[None, :] < limit[:, None], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None]).to(k.dtype)
    v = _load_kv_rows(v_head, vs_head, page, slot, t_ok, kv_mask, d, stride_vb, stride_vt, stride_vsb, stride_vst,
                      q.dtype, FP8)
    ones = tl.full((p.shape[1], 16), 1.0, p.dtype)
    if IEEE:
        row_sum = tl.dot(p, ones, input_precision="ieee")
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        row_sum = tl.dot(p, ones)
        pv = tl.dot(p, v)
    l_i = l_i * alpha + tl.max(row_sum, 1)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


def one_tile_exact_attention(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor, meta,
                        softmax_scale: float, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q (N, Hq, D) over the paged cache (num_blocks, page, Hkv, D) described by ``meta`` (a
    :class:`~jetrl.models.attention.PagedAttentionMetadata`) -> (N, Hq, D) in q's dtype. No host syncs.

    The cache is in q's dtype, or FP8: ``float8_e4m3fn`` K/V with ``k_scale``/``v_scale`` (num_blocks, page, Hkv)
    fp32 powers of two, each chunk dequantized in registers to ``jetrl.models.attention.dequantize_kv``'s values
    before the same math: bit for bit this function over the dequantized cache."""
    num_rows, num_heads, head_dim = q.shape
    _, page, num_kv_heads, cache_dim = k_cache_layer.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"exact_attention: q {tuple(q.shape)} does not match the cache {tuple(k_cache_layer.shape)}")
    if k_cache_layer.stride(-1) != 1 or v_cache_layer.stride(-1) != 1:
        raise ValueError("exact_attention needs the cache's head_dim to be contiguous")
    fp8 = check_kv_cache("exact_attention", q, k_cache_layer, v_cache_layer, k_scale, v_scale)
    if not fp8:
        k_scale = v_scale = k_cache_layer  # unused by the kernel; any tensor with 3 strides
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    block_q = max(1, ROWS_PER_PROGRAM // group_p2)
    # tiles of block_q consecutive query rows of one sequence, numbered on the device (at most num_rows)
    qsl = meta.query_start_loc.to(torch.long)
    tiles_per_seq = (qsl[1:] - qsl[:-1] + block_q - 1) // block_q  # (S,)
    ends = torch.cumsum(tiles_per_seq, 0)
    tiles = torch.arange(num_rows, device=q.device)
    tile_seq = torch.searchsorted(ends, tiles, right=True)  # (N,) S for tiles past the last
    valid = tile_seq < tiles_per_seq.shape[0]
    seq_c = tile_seq.clamp(max=tiles_per_seq.shape[0] - 1)
    tile_start = qsl[seq_c] + (tiles - (ends[seq_c] - tiles_per_seq[seq_c])) * block_q
    tile_seq = torch.where(valid, seq_c, -1).to(torch.int32)
    tables = meta.block_tables
    _exact_attention_kernel[(num_rows, num_kv_heads)](
        q, k_cache_layer, v_cache_layer, k_scale, v_scale, tables, meta.query_start_loc, meta.context_lens, tile_seq,
        tile_start.to(torch.int32), out, float(softmax_scale) * _LOG2E,
        q.stride(0), q.stride(1), k_cache_layer.stride(0), k_cache_layer.stride(1), k_cache_layer.stride(2),
        v_cache_layer.stride(0), v_cache_layer.stride(1), v_cache_layer.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2), v_scale.stride(0), v_scale.stride(1),
        v_scale.stride(2), tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim, PAGE=page, BLOCK_Q=block_q,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=EXACT_KV_CHUNK, IEEE=q.dtype == torch.float32,
        FP8=fp8, WHILE_LOOP=_INTERPRETED, num_warps=4, num_stages=2, **COMPILE_OPTIONS)
    return out


__all__ = ["one_tile_exact_attention"]
