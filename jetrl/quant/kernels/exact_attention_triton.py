"""Exact mode's attention forward in Triton: one kernel for prefill, paged decode and the packed training forward.

The kernel of :func:`jetrl.models.attention.exact_attention` (specification:
:func:`~jetrl.models.attention.exact_attention_reference`). One program per (query row, KV head) loads the
``G = Hq / Hkv`` query heads sharing the KV head (padded to 16 rows for ``tl.dot``) and walks its sequence's
key positions from 0 in tiles of ``EXACT_KV_CHUNK``, gathered through the block table, with an online softmax
in fp32 (the tile step of the decode kernel, :func:`~jetrl.quant.kernels.paged_attention_triton._attend_tile`).
No context split, no dependence on the other rows: a row's loop, tile shapes and reduction order are fixed by
its own position, so a token gets the same bits in a decode step, a prefill chunk or the trainer's packed
forward (a "cache" of one-token pages, :func:`jetrl.models.attention.packed_as_paged`). The row-to-sequence
map is computed on the device (no host sync), so decode steps stay capturable in CUDA graphs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from jetrl.quant.kernels.paged_attention_triton import _LOG2E, _attend_tile
from jetrl.quant.reference import EXACT_KV_CHUNK

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit(do_not_specialize=["num_rows"])
def _exact_attention_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, seq_ptr, limit_ptr, out_ptr, scale_log2, num_rows,
                            stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                            stride_ts, stride_on, stride_oh,
                            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                            WHILE_LOOP: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_G, BLOCK_D)
    seq = tl.load(seq_ptr + row)
    end = tl.maximum(tl.load(limit_ptr + row), 1)  # visible key positions < end (an empty row sees position 0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = tables_ptr + seq.to(tl.int64) * stride_ts
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    if WHILE_LOOP:  # the interpreter cannot iterate a range over loaded values
        t0 = 0
        while t0 < end:
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, t0 + n, end, d, d_ok, table_row, k_head, v_head, scale_log2,
                                         stride_kb, stride_kt, stride_vb, stride_vt, PAGE, IEEE)
            t0 += BLOCK_N
    else:
        for t0 in range(0, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, t0 + n, end, d, d_ok, table_row, k_head, v_head, scale_log2,
                                         stride_kb, stride_kt, stride_vb, stride_vt, PAGE, IEEE)
    out = acc / l_i[:, None]
    tl.store(out_ptr + row * stride_on + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


def exact_attention_fwd(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor, meta,
                        softmax_scale: float) -> torch.Tensor:
    """q (N, Hq, D) over the paged cache (num_blocks, page, Hkv, D) described by ``meta`` (a
    :class:`~jetrl.models.attention.PagedAttentionMetadata`) -> (N, Hq, D) in q's dtype. No host syncs."""
    num_rows, num_heads, head_dim = q.shape
    _, page, num_kv_heads, cache_dim = k_cache_layer.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"exact_attention: q {tuple(q.shape)} does not match the cache {tuple(k_cache_layer.shape)}")
    if k_cache_layer.stride(-1) != 1 or v_cache_layer.stride(-1) != 1:
        raise ValueError("exact_attention needs the cache's head_dim to be contiguous")
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    qsl = meta.query_start_loc.to(torch.long)
    rows = torch.arange(num_rows, device=q.device)
    seq_of_row = torch.searchsorted(qsl[1:], rows, right=True)  # (N,)
    q_len = qsl[1:] - qsl[:-1]
    limit = meta.context_lens.to(torch.long)[seq_of_row] - (q_len[seq_of_row] - 1 - (rows - qsl[seq_of_row]))
    group = num_heads // num_kv_heads
    tables = meta.block_tables
    _exact_attention_kernel[(num_rows, num_kv_heads)](
        q, k_cache_layer, v_cache_layer, tables, seq_of_row.to(torch.int32), limit.to(torch.int32), out,
        float(softmax_scale) * _LOG2E, num_rows,
        q.stride(0), q.stride(1), k_cache_layer.stride(0), k_cache_layer.stride(1), k_cache_layer.stride(2),
        v_cache_layer.stride(0), v_cache_layer.stride(1), v_cache_layer.stride(2), tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=EXACT_KV_CHUNK, IEEE=q.dtype == torch.float32,
        WHILE_LOOP=_INTERPRETED, num_warps=4, num_stages=2)
    return out


__all__ = ["exact_attention_fwd"]
