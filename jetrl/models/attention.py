"""Attention over packed sequences and over a paged KV cache.

Two paths read the same projections of the same weights:

* **Packed** (training, scoring): the sequences of a batch are concatenated into ``N`` rows with
  ``cu_seqlens`` (S+1 cumulative lengths). Attention is block-diagonal causal: a token sees the earlier
  tokens of its own sequence only. :func:`varlen_attention` runs one causal ``scaled_dot_product_attention``
  per sequence (flash / memory-efficient kernels on CUDA), so no padding is ever computed.
* **Paged** (rollout): K/V of every generated token live in fixed-size blocks of a pool owned by the
  rollout engine (:class:`PagedKVCache`); :class:`PagedAttentionMetadata` says, for one engine step,
  where each sequence's blocks are and where the new tokens' K/V go. :func:`paged_attention_reference`
  is the pure-PyTorch specification; :func:`paged_attention` runs decode steps in a Triton kernel
  (:func:`jetrl.quant.kernels.paged_attention_triton.paged_decode`) where the seam
  (:func:`jetrl.quant.backend.choose_impl`) picks the kernels: CUDA tensors under the CUDA backend.

Softmax always runs in fp32 inside SDPA (for BF16 inputs the kernels accumulate in fp32). Every SDPA call
goes through :func:`sdpa`, which leaves out the cuDNN backend: PyTorch may prefer it on Hopper, and it
builds (and caches) a cuDNN graph for every new sequence length, which is a large cost per new length.
Packed RL and SFT batches bring new lengths at every step, so that cost never goes away. Flash attention
(first choice, GQA included) and the other backends need no per-shape setup.

**Exact mode** (:mod:`jetrl.quant.exact`) replaces all three (prefill, paged decode, the packed training forward)
by ONE function, :func:`exact_attention`: each query row walks the keys of its sequence in fixed chunks of
``EXACT_KV_CHUNK`` logical positions from position 0, with an online softmax in fp32, through a block table.
The packed forward reads its K/V through the same function, as a "cache" of one-token blocks
(:func:`exact_varlen_attention`), so a token's attention output is the same bits whether it was computed in a
decode step, a prefill chunk, after a preemption, or in the trainer's packed batch. Only the forward values
must agree: the packed path's backward is the fast one (SDPA's, recomputed).

Padding rows (e.g. a CUDA-graph batch padded to a captured size) must still carry a valid slot in
``slot_mapping`` (point them at a scratch block the engine never hands out): :func:`write_kv` runs
without host syncs, so it cannot check. A query row that sees no key (context length 0) attends to
the first slot of its first block instead of producing NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torch.nn.attention import SDPBackend, sdpa_kernel

from jetrl.quant.backend import choose_impl
from jetrl.quant.exact import EXACT_KV_CHUNK


# SDPA backends jetrl allows (in PyTorch's priority order): every one but cuDNN (see the module doc).
SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` restricted to :data:`SDPA_BACKENDS` (no per-shape cuDNN graphs)."""
    with sdpa_kernel(list(SDPA_BACKENDS)):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


@dataclass
class PagedAttentionMetadata:
    """One engine step over S sequences whose new tokens are packed into N rows."""

    query_start_loc: torch.Tensor  # (S+1,) int32: cumulative new-token counts (row offsets into the packed N)
    context_lens: torch.Tensor  # (S,) int32: tokens in the cache for each seq AFTER this step (cached + new)
    block_tables: torch.Tensor  # (S, max_blocks) int32: physical block ids, -1 where unused
    slot_mapping: torch.Tensor  # (N,) int64: flat slot (block_id * block_size + offset) of each new token
    max_query_len: int
    max_context_len: int

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one new token (decided from the host-side ``max_query_len``)."""
        return self.max_query_len == 1

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]


@dataclass
class PagedKVCache:
    """Per-layer K/V block pools, allocated by the rollout engine."""

    k: list[torch.Tensor]  # per layer: (num_blocks, block_size, num_kv_heads, head_dim), model dtype
    v: list[torch.Tensor]
    block_size: int

    @staticmethod
    def allocate(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None) -> "PagedKVCache":
        """Zero-filled pools for ``num_layers`` layers."""
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if int(value) <= 0:
                raise ValueError(f"PagedKVCache.allocate: {name} must be positive, got {value}")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return PagedKVCache(k=k, v=v, block_size=block_size)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


def write_kv(k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V (N, Hkv, D) at their flat slots, in place. No host syncs."""
    num_kv_heads, head_dim = k_cache_layer.shape[2], k_cache_layer.shape[3]
    k_flat = k_cache_layer.view(-1, num_kv_heads, head_dim)  # (num_blocks * block_size, Hkv, D)
    v_flat = v_cache_layer.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))


def _row_coordinates(meta: PagedAttentionMetadata, num_rows: int, device: torch.device):
    """For each packed row: its sequence index and its index among that sequence's new tokens."""
    qsl = meta.query_start_loc.to(device=device, dtype=torch.long)
    rows = torch.arange(num_rows, device=device)
    seq_of_row = torch.searchsorted(qsl[1:], rows, right=True)  # (N,)
    index_in_seq = rows - qsl[seq_of_row]  # (N,)
    return seq_of_row, index_in_seq, qsl


def paged_attention_reference(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor,
                              meta: PagedAttentionMetadata, softmax_scale: float) -> torch.Tensor:
    """Causal attention of N new query rows (N, Hq, D) over a paged cache that already holds this step's K/V.

    New token ``i`` (0-based among the ``q_len`` new tokens) of sequence ``s`` attends to cache positions
    ``< context_lens[s] - (q_len - 1 - i)``. GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``.
    Pure tensor ops on the given tensors (no host syncs, shapes fixed by ``max_query_len`` and the block
    table width), so it runs on CPU and inside a CUDA graph. Returns (N, Hq, D) in ``q``'s dtype.
    """
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache_layer.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    device = q.device
    num_seqs, max_blocks = meta.block_tables.shape
    max_q = int(meta.max_query_len)
    num_keys = max_blocks * block_size

    tables = meta.block_tables.to(device=device, dtype=torch.long).clamp(min=0)  # (S, max_blocks)
    keys = k_cache_layer[tables].reshape(num_seqs, num_keys, num_kv_heads, head_dim)  # (S, L, Hkv, D)
    values = v_cache_layer[tables].reshape(num_seqs, num_keys, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    keys = keys.transpose(1, 2).repeat_interleave(group, dim=1)  # (S, Hq, L, D)
    values = values.transpose(1, 2).repeat_interleave(group, dim=1)

    if max_q == 1 and num_rows == num_seqs:  # decode: row s is sequence s
        q_pad = q.view(num_seqs, 1, num_heads, head_dim)
        q_len = torch.ones(num_seqs, dtype=torch.long, device=device)
        seq_of_row = index_in_seq = None
    else:
        seq_of_row, index_in_seq, qsl = _row_coordinates(meta, num_rows, device)
        q_len = qsl[1:] - qsl[:-1]  # (S,)
        q_pad = q.new_zeros(num_seqs, max_q, num_heads, head_dim)
        q_pad[seq_of_row, index_in_seq] = q
    q_pad = q_pad.transpose(1, 2)  # (S, Hq, max_q, D)

    ctx = meta.context_lens.to(device=device, dtype=torch.long)  # (S,)
    i = torch.arange(max_q, device=device)
    key_pos = torch.arange(num_keys, device=device)
    limit = ctx[:, None] - (q_len[:, None] - 1 - i[None, :])  # (S, max_q): visible keys are < limit
    mask = key_pos[None, None, :] < limit[:, :, None]  # (S, max_q, L)
    mask = mask | (key_pos == 0)[None, None, :] & (limit <= 0)[:, :, None]  # keep empty rows finite
    out = sdpa(q_pad, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None], scale=softmax_scale)  # (S, Hq, max_q, D)
    out = out.transpose(1, 2)  # (S, max_q, Hq, D)
    if seq_of_row is None:
        return out.reshape(num_rows, num_heads, head_dim)
    return out[seq_of_row, index_in_seq]


def paged_attention(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor,
                    meta: PagedAttentionMetadata, softmax_scale: float, impl: str | None = None) -> torch.Tensor:
    """Paged attention: decode steps in the Triton kernel where the seam picks the kernels (``impl``: ``None``
    for the automatic choice, or ``"reference"`` / ``"triton"``), everything else in the reference."""
    if meta.is_decode and choose_impl(q, impl, op="paged_decode") == "triton":
        from jetrl.quant.kernels.paged_attention_triton import paged_decode

        return paged_decode(q, k_cache_layer, v_cache_layer, meta, softmax_scale)
    return paged_attention_reference(q, k_cache_layer, v_cache_layer, meta, softmax_scale)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                     softmax_scale: float) -> torch.Tensor:
    """Block-diagonal causal attention over packed rows: q (N, Hq, D), k/v (N, Hkv, D) -> (N, Hq, D).

    ``cu_seqlens`` is a host list (S+1 offsets; the caller syncs once per forward, not per layer). Each
    sequence runs one causal SDPA on its own rows, so the cost is sum(len^2), never N^2, and nothing is
    padded.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    lengths = [end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    if any(n < 0 for n in lengths) or cu_seqlens[0] != 0 or cu_seqlens[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens must rise from 0 to the number of rows ({q.shape[0]}), got {cu_seqlens}")
    gqa = num_heads != num_kv_heads
    if len(set(lengths)) == 1:  # equal lengths (the plain (B, T) batch): one batched SDPA
        num_seqs, seq_len = len(lengths), lengths[0]
        qb, kb, vb = (t.reshape(num_seqs, seq_len, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        out = sdpa(qb, kb, vb, is_causal=True, scale=softmax_scale, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(q.shape)
    outs = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if end == start:
            continue
        qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))  # (1, H, L, D)
        out = sdpa(qs, ks, vs, is_causal=True, scale=softmax_scale, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))  # (L, Hq, D)
    return torch.cat(outs, dim=0)

def exact_attention_reference(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor,
                              meta: PagedAttentionMetadata, softmax_scale: float) -> torch.Tensor:
    """Exact mode's attention (the specification of its kernel): q (N, Hq, D) over a paged cache -> (N, Hq, D).

    Same visibility rule as :func:`paged_attention_reference`. Each row walks its sequence's logical key
    positions ``0, 1, ...`` in chunks of ``EXACT_KV_CHUNK`` (the last chunk padded, every chunk the same
    shape), with an online softmax in fp32: per chunk, scores ``sum_d(q * k) * scale`` (masked ones
    ``-inf``), ``m' = max(m, max(s))``, ``l = l * exp(m - m') + sum(exp(s - m'))``, ``acc = acc * exp(m - m') +
    sum(exp(s - m') * v)``; the output is ``acc / l`` in q's dtype. A masked position contributes exact zeros
    and a chunk past a row's last key leaves its state unchanged (``exp(0) = 1``), so the result depends on the
    row's own keys only: not on the batch, the other rows, the table width or the block size. No host syncs.
    """
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache_layer.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    device = q.device
    seq_of_row, index_in_seq, qsl = _row_coordinates(meta, num_rows, device)
    q_len = qsl[1:] - qsl[:-1]  # (S,)
    ctx = meta.context_lens.to(device=device, dtype=torch.long)
    limit = ctx[seq_of_row] - (q_len[seq_of_row] - 1 - index_in_seq)  # (N,): visible key positions < limit
    tables = meta.block_tables.to(device=device, dtype=torch.long).clamp(min=0)[seq_of_row]  # (N, width)
    num_keys = tables.shape[1] * block_size
    k_flat = k_cache_layer.reshape(-1, num_kv_heads, head_dim)
    v_flat = v_cache_layer.reshape(-1, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    q32 = q.float()[:, :, None, :]  # (N, Hq, 1, D)
    m = torch.full((num_rows, num_heads), float("-inf"), device=device)
    l = torch.zeros((num_rows, num_heads), device=device)
    acc = torch.zeros((num_rows, num_heads, head_dim), device=device)
    chunk = EXACT_KV_CHUNK
    for start in range(0, num_keys, chunk):
        pos = torch.arange(start, start + chunk, device=device)  # (C,) logical positions
        in_table = pos < num_keys
        pos_c = pos.clamp(max=num_keys - 1)
        slots = tables[:, pos_c // block_size] * block_size + pos_c % block_size  # (N, C)
        visible = (pos[None, :] < limit[:, None]) & in_table[None, :]
        visible = visible | ((pos == 0)[None, :] & (limit <= 0)[:, None])  # keep empty rows finite
        k = k_flat[slots].float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # (N, Hq, C, D)
        v = v_flat[slots].float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
        s = (q32 * k).sum(-1) * softmax_scale  # (N, Hq, C)
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])  # masked positions: exactly 0
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + (p[..., None] * v).sum(-2)
        m = m_new
    return (acc / l[..., None]).to(q.dtype)


def exact_attention(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor,
                    meta: PagedAttentionMetadata, softmax_scale: float, impl: str | None = None) -> torch.Tensor:
    """Exact mode's attention for prefill and decode steps alike (see :func:`exact_attention_reference`): the
    Triton kernel (:mod:`jetrl.quant.kernels.exact_attention_triton`) where the seam picks the kernels, else
    the reference. Each implementation is batch-invariant on its own; the two agree to fp32 rounding."""
    if choose_impl(q, impl, op="exact_attention") == "triton":
        from jetrl.quant.kernels.exact_attention_triton import exact_attention_fwd

        return exact_attention_fwd(q, k_cache_layer, v_cache_layer, meta, softmax_scale)
    return exact_attention_reference(q, k_cache_layer, v_cache_layer, meta, softmax_scale)


def packed_as_paged(cu_seqlens: list[int], device: torch.device | str) -> PagedAttentionMetadata:
    """Packed sequences (``cu_seqlens``: S+1 host offsets) as paged metadata over a cache of one-token blocks:
    the packed K (N, Hkv, D) viewed as (N, 1, Hkv, D), sequence s's position j in block ``cu[s] + j``."""
    lengths = [end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    width = max(1, max(lengths))
    starts = torch.tensor(cu_seqlens[:-1], dtype=torch.int64)
    cols = torch.arange(width, dtype=torch.int64)
    lens = torch.tensor(lengths, dtype=torch.int64)
    tables = torch.where(cols[None, :] < lens[:, None], starts[:, None] + cols[None, :], -1).to(torch.int32)
    return PagedAttentionMetadata(
        query_start_loc=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
        context_lens=lens.to(device=device, dtype=torch.int32), block_tables=tables.to(device),
        slot_mapping=torch.arange(cu_seqlens[-1], dtype=torch.int64, device=device), max_query_len=width,
        max_context_len=width)


class _ExactVarlenAttention(torch.autograd.Function):
    """Forward: :func:`exact_attention` over the packed K/V; backward: SDPA's (only forward values must match
    the rollout's), through a recomputation of :func:`varlen_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, softmax_scale):
        meta = packed_as_paged(cu_seqlens, q.device)
        out = exact_attention(q, k[:, None], v[:, None], meta, softmax_scale)
        ctx.save_for_backward(q, k, v)
        ctx.cu_seqlens, ctx.softmax_scale = cu_seqlens, softmax_scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(True) for t in (q, k, v)]
            out = varlen_attention(*inputs, ctx.cu_seqlens, ctx.softmax_scale)
            grads = torch.autograd.grad(out, inputs, grad_out)
        return (*grads, None, None)


def exact_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                           softmax_scale: float) -> torch.Tensor:
    """:func:`varlen_attention`'s inputs and result, computed by :func:`exact_attention` (the rollout's function
    and order) over the packed rows; differentiable, with SDPA's backward."""
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != q.shape[0] or any(b < a for a, b in zip(cu_seqlens, cu_seqlens[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the number of rows ({q.shape[0]}), got {cu_seqlens}")
    if q.shape[0] == 0:
        return q.new_zeros(q.shape)
    return _ExactVarlenAttention.apply(q, k, v, list(cu_seqlens), softmax_scale)


__all__ = [
    "PagedAttentionMetadata", "PagedKVCache", "write_kv", "paged_attention_reference", "paged_attention",
    "varlen_attention", "sdpa", "SDPA_BACKENDS", "exact_attention", "exact_attention_reference", "exact_varlen_attention", "packed_as_paged",
]
