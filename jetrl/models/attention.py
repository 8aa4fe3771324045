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

Softmax always runs in fp32 inside SDPA (for BF16 inputs the kernels accumulate in fp32).

Padding rows (e.g. a CUDA-graph batch padded to a captured size) must still carry a valid slot in
``slot_mapping`` (point them at a scratch block the engine never hands out): :func:`write_kv` runs
without host syncs, so it cannot check. A query row that sees no key (context length 0) attends to
the first slot of its first block instead of producing NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jetrl.quant.backend import choose_impl


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
    out = F.scaled_dot_product_attention(q_pad, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None],
                                         scale=softmax_scale)  # (S, Hq, max_q, D)
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
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=softmax_scale, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(q.shape)
    outs = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if end == start:
            continue
        qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))  # (1, H, L, D)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=softmax_scale, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))  # (L, Hq, D)
    return torch.cat(outs, dim=0)

__all__ = [
    "PagedAttentionMetadata", "PagedKVCache", "write_kv", "paged_attention_reference", "paged_attention",
    "varlen_attention",
]
