"""Exact mode's attention forward in Triton: one kernel for prefill, paged decode and the packed training forward.

The kernel of :func:`jetrl.models.attention.exact_attention` (specification:
:func:`~jetrl.models.attention.exact_attention_reference`). One program per (tile, KV head): a tile is up to
``BLOCK_Q`` consecutive query rows of one sequence (one row in a decode step), and the program's ``tl.dot`` rows
are those query rows x the ``G = Hq / Hkv`` heads sharing the KV head, always :data:`ROWS_PER_PROGRAM` of them
(padding rows masked), so K/V are read once per tile and every token runs the same MMA shape whether it came
alone or with neighbours. The program walks key positions from 0 in chunks of ``EXACT_KV_CHUNK``, gathered
through the block table, with an online softmax in fp32, up to its furthest row's last key; for a row whose keys
end earlier the remaining chunks are fully masked and leave its state bitwise unchanged (``exp2(0) = 1``, zero
probabilities). No context split: a token's bits depend on its own keys only, in a decode step, a prefill chunk
or the trainer's packed forward (a "cache" of one-token pages, :func:`jetrl.models.attention.packed_as_paged`).
The tiles are numbered on the device (no host sync; :func:`_number_tiles`, the grid an upper bound from shapes
alone), so decode steps stay capturable in CUDA graphs.

**The chunk update** (:func:`_scores_update`, :func:`_acc_update`): scores ``q @ k^T`` (fp32 accumulation),
masked, ``m' = max(m, rowmax(s))``, ``p = exp2(s - m')`` rounded to the values' dtype, then ``l = l * alpha +
rowsum(p)`` and ``acc = acc * alpha + p @ v``, both sums MMAs (the row sum as ``p @ ones``). Every reduction is
thus an MMA or a maximum, never a ``tl.sum`` whose order follows the register layout, which is what lets the
decode schedule below compute the same bits.

**Swapped decode** (:func:`_exact_decode_kernel`): a step with at
most one query row per sequence on average runs one program per (query row, KV head) with the MMA's operands
swapped: ``K @ q^T`` with the chunk's 64 keys as the MMA's rows and the group's heads as its columns (padded to
:data:`DECODE_MIN_COLS`), ``ones @ p^T`` and ``V^T @ p^T``. A Hopper MMA computes each element from the same
products, summed in the same K order, whichever operand holds the rows (the FP8 GEMMs' decode kernel relies on the
same property), so each row gets the tile kernel's bits while a decode token pays for a 64 x 16 product per chunk
instead of the tile's 64 x 64. The GPU tests check it against the packed training forward; the CPU tests check
that it compiles to Hopper MMAs only (a ``mma.sync`` would accumulate differently).

An FP8 cache (E4M3 K/V with power-of-two per-(token, KV head) scales) is dequantized chunk by chunk in registers
exactly like ``jetrl.models.attention.dequantize_kv`` (the fp32 product rounded to q's dtype, a rounding that with a
bf16 or fp32 query changes nothing), and the unchanged math follows: the rollout reading its FP8 cache and the
trainer attending over the fake-quantized K/V (one-token pages of the same values) get the same bits.
Unlike the decode kernel (:mod:`~jetrl.quant.kernels.paged_attention_triton`), this one does NOT apply the scales
to the dots' results: that is equal only to summation order in general (the two dots are different MMA inputs,
and ``bf16(p * 2^e) == bf16(p) * 2^e`` fails for probabilities below ``2^-104``), and this kernel's contract is bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.quant.kernels import tuning
from jetrl.quant.kernels.decode_splits import LOG2E
from jetrl.quant.kernels.paged_attention_triton import _load_kv_rows, _sequence_and_head, check_kv_cache
from jetrl.quant.reference import EXACT_KV_CHUNK
from jetrl.quant.kernels.tuning import COMPILE_OPTIONS

_INTERPRETED = tuning.interpreting()


ROWS_PER_PROGRAM = 64  # MMA rows of every program: query rows x their group's heads (padded to a power of two)
ROW_SUM_COLS = tl.constexpr(16)  # columns of the ones the row sums multiply (the narrowest Hopper MMA of 64 rows)
DECODE_MIN_COLS = 16  # the swapped decode kernel's MMA columns: its query heads, padded to at least this many
DECODE_STAGES = 1  # the swapped decode kernel's pipeline stages (a schedule: any count gives the same bits)
_MMA_ROWS = tl.constexpr(ROWS_PER_PROGRAM)


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
    rows, heads, row_ok, limit = _tile_rows(first, seq_end, ctx, kv_head, GROUP, GROUP_P2, BLOCK_Q)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (R, BLOCK_D)
    m_i = tl.full([BLOCK_Q * GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P2, BLOCK_D], tl.float32)
    table_row, k_head, v_head, ks_head, vs_head = _sequence_and_head(
        tables_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, seq, kv_head, stride_ts, stride_kh, stride_vh, stride_ksh, stride_vsh)
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
def _exact_decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, qsl_ptr, ctx_ptr, tile_seq_ptr,
                         tile_start_ptr, out_ptr, scale_log2,
                         stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                         stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                         stride_ts, stride_on, stride_oh,
                         GROUP: tl.constexpr, COLS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
                         WHILE_LOOP: tl.constexpr):
    """One program: ONE query row x the GROUP heads of one KV head, with the MMAs' operands swapped (the module
    doc's swapped decode): the same elementwise steps as :func:`_scores_update` and :func:`_acc_update`, transposed."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + pid)
    if seq < 0:  # past the last row (the grid is an upper bound, fixed without a host sync)
        return
    row = tl.load(tile_start_ptr + pid)
    seq_end = tl.load(qsl_ptr + seq + 1)
    ctx = tl.load(ctx_ptr + seq)
    limit = tl.maximum(ctx - (seq_end - 1 - row), 1)  # the row's visible keys: positions < limit
    c = tl.arange(0, COLS)
    c_ok = c < GROUP
    heads = kv_head * GROUP + c
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    qt = tl.load(q_ptr + row.to(tl.int64) * stride_qn + heads[None, :] * stride_qh + d[:, None],
                 mask=c_ok[None, :] & d_ok[:, None], other=0.0)  # (BLOCK_D, COLS)
    m_i = tl.full([COLS], float("-inf"), tl.float32)
    l_i = tl.zeros([COLS], tl.float32)
    acc = tl.zeros([BLOCK_D, COLS], tl.float32)
    table_row, k_head, v_head, ks_head, vs_head = _sequence_and_head(
        tables_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, seq, kv_head, stride_ts, stride_kh, stride_vh, stride_ksh, stride_vsh)
    n = tl.arange(0, BLOCK_N)
    if WHILE_LOOP:  # the interpreter cannot iterate a range over loaded values
        t0 = 0
        while t0 < limit:
            m_i, l_i, acc = _decode_chunk(qt, m_i, l_i, acc, t0 + n, limit, d, d_ok, table_row, k_head, v_head,
                                          ks_head, vs_head, scale_log2, stride_kb, stride_kt, stride_vb, stride_vt,
                                          stride_ksb, stride_kst, stride_vsb, stride_vst, PAGE, IEEE, FP8)
            t0 += BLOCK_N
    else:
        for t0 in range(0, limit, BLOCK_N):
            m_i, l_i, acc = _decode_chunk(qt, m_i, l_i, acc, t0 + n, limit, d, d_ok, table_row, k_head, v_head,
                                          ks_head, vs_head, scale_log2, stride_kb, stride_kt, stride_vb, stride_vt,
                                          stride_ksb, stride_kst, stride_vsb, stride_vst, PAGE, IEEE, FP8)
    out = acc / l_i[None, :]
    tl.store(out_ptr + row.to(tl.int64) * stride_on + heads[None, :] * stride_oh + d[:, None],
             out.to(out_ptr.dtype.element_ty), mask=c_ok[None, :] & d_ok[:, None])


@triton.jit
def _decode_chunk(qt, m_i, l_i, acc, t, limit, d, d_ok, table_row, k_head, v_head, ks_head, vs_head, scale_log2,
                  stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
                  PAGE: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr):
    """:func:`_attend_chunk` for one query row, transposed: scores ``K @ q^T`` (BLOCK_N, COLS), the row sum
    ``ones @ p^T`` and ``V^T @ p^T``."""
    t_ok = t < limit
    page = tl.load(table_row + t // PAGE, mask=t_ok, other=0).to(tl.int64)
    slot = t % PAGE
    kv_mask = t_ok[:, None] & d_ok[None, :]
    k = _load_kv_rows(k_head, ks_head, page, slot, t_ok, kv_mask, d, stride_kb, stride_kt, stride_ksb, stride_kst,
                      qt.dtype, FP8)
    st = tl.dot(k, qt, input_precision="ieee" if IEEE else None)  # (BLOCK_N, COLS), fp32 accumulation
    st = tl.where(t[:, None] < limit, st * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, 0))
    alpha = tl.exp2(m_i - m_new)
    pt = tl.exp2(st - m_new[None, :]).to(k.dtype)  # (BLOCK_N, COLS)
    v = _load_kv_rows(v_head, vs_head, page, slot, t_ok, kv_mask, d, stride_vb, stride_vt, stride_vsb, stride_vst,
                      qt.dtype, FP8)
    ones = tl.full((_MMA_ROWS, pt.shape[0]), 1.0, pt.dtype)
    row_sum = tl.dot(ones, pt, input_precision="ieee" if IEEE else None)
    pv = tl.dot(tl.trans(v), pt, input_precision="ieee" if IEEE else None)  # (BLOCK_D, COLS)
    l_i = l_i * alpha + tl.max(row_sum, 0)  # every row is the column sum
    acc = acc * alpha[None, :] + pv
    return m_new, l_i, acc


@triton.jit
def _attend_chunk(q, m_i, l_i, acc, t, limit, end, d, d_ok, table_row, k_head, v_head, ks_head, vs_head, scale_log2,
                  stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
                  PAGE: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr):
    """One chunk of key positions ``t`` (BLOCK_N,) for every MMA row: gather K/V through the block table (an FP8
    cache dequantized in registers, exactly), mask each row's invisible keys (``t >= limit``), online-softmax
    update (a fully masked row keeps its state exactly, the module doc)."""
    t_ok = t < end
    page = tl.load(table_row + t // PAGE, mask=t_ok, other=0).to(tl.int64)
    slot = t % PAGE
    kv_mask = t_ok[:, None] & d_ok[None, :]
    k = _load_kv_rows(k_head, ks_head, page, slot, t_ok, kv_mask, d, stride_kb, stride_kt, stride_ksb, stride_kst,
                      q.dtype, FP8)
    m_new, alpha, p = _scores_update(q, m_i, k, t, limit, scale_log2, IEEE)
    v = _load_kv_rows(v_head, vs_head, page, slot, t_ok, kv_mask, d, stride_vb, stride_vt, stride_vsb, stride_vst,
                      q.dtype, FP8)
    l_i, acc = _acc_update(l_i, acc, alpha, p, v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _tile_rows(first, seq_end, ctx, kv_head, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr):
    """The MMA rows of the tile whose first query row is ``first``: (query row, head, valid, key limit) each."""
    j = tl.arange(0, BLOCK_Q * GROUP_P2)
    rows = first + j // GROUP_P2  # (R,) query row of each MMA row
    g = j % GROUP_P2
    heads = kv_head * GROUP + g
    row_ok = (rows < seq_end) & (g < GROUP)
    # visible key positions < limit; a padding row attends to position 0 (finite, never stored)
    limit = tl.where(row_ok, ctx - (seq_end - 1 - rows), 1)
    limit = tl.maximum(limit, 1)
    return rows, heads, row_ok, limit


@triton.jit
def _scores_update(q, m_i, k, t, limit, scale_log2, IEEE: tl.constexpr):
    """Scores of one chunk (keys ``t >= limit`` masked to -inf) and the online softmax's new maximum: returns
    (m_new, alpha = exp2(m - m_new), p = exp2(s - m_new) rounded to the values' dtype)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee" if IEEE else None)  # (R, BLOCK_N), fp32 accumulation
    s = tl.where(t[None, :] < limit[:, None], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None]).to(k.dtype)
    return m_new, alpha, p


@triton.jit
def _acc_update(l_i, acc, alpha, p, v, IEEE: tl.constexpr):
    """``l = l * alpha + rowsum(p)``, ``acc = acc * alpha + p @ v``: both MMAs (the module doc's chunk update)."""
    ones = tl.full((p.shape[1], ROW_SUM_COLS), 1.0, p.dtype)
    row_sum = tl.dot(p, ones, input_precision="ieee" if IEEE else None)
    pv = tl.dot(p, v, input_precision="ieee" if IEEE else None)
    l_i = l_i * alpha + tl.max(row_sum, 1)  # every column is the row sum
    acc = acc * alpha[:, None] + pv
    return l_i, acc


def exact_attention_fwd(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor, meta,
                        softmax_scale: float, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, *, decode_stages: int = DECODE_STAGES) -> torch.Tensor:
    """q (N, Hq, D) over the paged cache (num_blocks, page, Hkv, D) described by ``meta`` (a
    :class:`~jetrl.models.attention.PagedAttentionMetadata`) -> (N, Hq, D) in q's dtype. No host syncs.

    The cache is in q's dtype, or FP8: ``float8_e4m3fn`` K/V with ``k_scale``/``v_scale`` (num_blocks, page, Hkv)
    fp32 powers of two, each chunk dequantized in registers to ``jetrl.models.attention.dequantize_kv``'s values
    before the same math: bit for bit this function over the dequantized cache. ``decode_stages``: the swapped
    decode kernel's pipeline stages (the same bits)."""
    num_rows, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache_layer.shape
    fp8 = check_kv_cache("exact_attention", q, k_cache_layer, v_cache_layer, k_scale, v_scale)
    if not fp8:
        k_scale = v_scale = k_cache_layer  # unused by the kernel; any tensor with 3 strides
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    block_q, swapped = _schedule(meta, num_rows, num_heads, num_kv_heads)
    if meta.exact_tiles is not None and tuple(meta.exact_tiles[:2]) == (block_q, num_rows):
        tile_seq, tile_start = meta.exact_tiles[2:]  # numbered once for every layer (number_tiles)
    else:
        tile_seq, tile_start = _number_tiles(meta.query_start_loc, num_rows, block_q)
    tables = meta.block_tables
    args = (q, k_cache_layer, v_cache_layer, k_scale, v_scale, tables, meta.query_start_loc, meta.context_lens,
            tile_seq, tile_start, out, float(softmax_scale) * LOG2E, *q.stride()[:2], *k_cache_layer.stride()[:3],
            *v_cache_layer.stride()[:3], *k_scale.stride()[:3], *v_scale.stride()[:3], tables.stride(0),
            *out.stride()[:2])
    grid = (tile_seq.shape[0], num_kv_heads)
    common = dict(GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_D=triton.next_power_of_2(head_dim),
                  BLOCK_N=EXACT_KV_CHUNK, IEEE=q.dtype == torch.float32, FP8=fp8, WHILE_LOOP=_INTERPRETED,
                  num_warps=4)
    if swapped:  # one query row per program, the MMAs' operands swapped
        _exact_decode_kernel[grid](*args, **common, COLS=max(DECODE_MIN_COLS, group_p2),
                                   num_stages=decode_stages, **COMPILE_OPTIONS)
        return out
    _exact_attention_kernel[grid](*args, **common, GROUP_P2=group_p2, BLOCK_Q=block_q, num_stages=2, **COMPILE_OPTIONS)
    return out


def _schedule(meta, num_rows: int, num_heads: int, num_kv_heads: int) -> tuple[int, bool]:
    """(query rows per program, swapped) of the kernel for this step. A step of at most one row per sequence on
    average (a decode step) runs the swapped decode kernel, one row per program; otherwise a tile holds
    :data:`ROWS_PER_PROGRAM` rows x heads of a KV head's group."""
    if num_rows <= meta.query_start_loc.shape[0] - 1:
        return 1, True
    return max(1, ROWS_PER_PROGRAM // triton.next_power_of_2(num_heads // num_kv_heads)), False


def number_tiles(meta, num_rows: int, num_heads: int, num_kv_heads: int) -> tuple:
    """The kernel's program numbering for a step of ``num_rows`` query rows over ``meta``, as the
    ``exact_tiles`` of :class:`~jetrl.models.attention.PagedAttentionMetadata`: (rows per program, ``num_rows``,
    sequence per program, first row per program). Numbered once per forward, it saves every layer the dozen small
    kernels of :func:`_number_tiles` (no host sync either way)."""
    rows_per_program, _ = _schedule(meta, num_rows, num_heads, num_kv_heads)
    return (rows_per_program, num_rows, *_number_tiles(meta.query_start_loc, num_rows, rows_per_program))


def _number_tiles(query_start_loc: torch.Tensor, num_rows: int, rows_per_program: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Programs of up to ``rows_per_program`` consecutive query rows of one sequence, numbered on the device (no
    host sync): (sequence, first query row) per program, int32, sequence -1 for the programs past the last.

    The count is an upper bound known from shapes alone: ``sum_s ceil(L_s / R) <= min(N, N // R + S)`` for S
    sequences of N rows in all (each ceil adds less than one to ``L_s / R``; each sequence with a program has a
    row), so the grid does not launch one program per row when the tiles are larger than a row."""
    num_seqs = query_start_loc.shape[0] - 1
    count = max(1, min(num_rows, num_rows // rows_per_program + num_seqs))
    qsl = query_start_loc.to(torch.long)
    per_seq = (qsl[1:] - qsl[:-1] + rows_per_program - 1) // rows_per_program  # (S,)
    ends = torch.cumsum(per_seq, 0)
    programs = torch.arange(count, device=query_start_loc.device)
    seq = torch.searchsorted(ends, programs, right=True)  # S for the programs past the last
    valid = seq < num_seqs
    seq_c = seq.clamp(max=num_seqs - 1)
    start = qsl[seq_c] + (programs - (ends[seq_c] - per_seq[seq_c])) * rows_per_program
    return torch.where(valid, seq_c, -1).to(torch.int32), start.to(torch.int32)


__all__ = ["exact_attention_fwd", "number_tiles", "ROWS_PER_PROGRAM"]
