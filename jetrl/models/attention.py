"""Attention over packed sequences and over a paged KV cache.

Two paths read the same projections of the same weights:

* **Packed** (training, scoring): the sequences of a batch are concatenated into ``N`` rows with
  ``cu_seqlens`` (S+1 cumulative lengths). Attention is block-diagonal causal: a token sees the earlier
  tokens of its own sequence only. :func:`varlen_attention` runs them in one flash-attention launch where it
  can, else one causal ``scaled_dot_product_attention`` per sequence, so no padding is ever computed.
* **Paged** (rollout): K/V of every generated token live in fixed-size blocks of a pool owned by the
  rollout engine (:class:`PagedKVCache`); :class:`PagedAttentionMetadata` says, for one engine step,
  where each sequence's blocks are and where the new tokens' K/V go. :func:`paged_attention_reference`
  is the pure-PyTorch specification; :func:`paged_attention` runs decode steps in a Triton kernel
  (:func:`jetrl.quant.kernels.paged_attention_triton.paged_decode`) where the seam
  (:func:`jetrl.quant.backend.choose_impl`) picks the kernels: CUDA tensors under the CUDA backend.

Softmax runs in fp32 or wider inside SDPA (for BF16 inputs the kernels accumulate in fp32; on the CPU the reference
computes in float64, :func:`reference_dtype`). Every SDPA call on CUDA runs inside :func:`sdpa_backends`, which leaves
out the cuDNN backend: it builds (and caches) a cuDNN graph for every new sequence length, and packed RL and SFT
batches bring new lengths at every step. The context is entered once per attention call (not per sequence): entering
it costs host time.

**Exact mode** (:mod:`jetrl.quant.exact`) replaces all three (prefill, paged decode, the packed training forward)
by ONE function, :func:`exact_attention`: each query row walks the keys of its sequence in fixed chunks of
``EXACT_KV_CHUNK`` logical positions from position 0, with an online softmax in fp32, through a block table.
The packed forward reads its K/V through the same function, as a "cache" of one-token blocks
(:func:`exact_varlen_attention`), so a token's attention output is the same bits whether it was computed in a
decode step, a prefill chunk, after a preemption, or in the trainer's packed batch. Only the forward values
must agree: the packed path's backward is the fast one (SDPA's, recomputed).

**FP8 KV cache** (the run config's ``kv_fp8``): the paged cache stores K (after RoPE) and V as E4M3 with one
power-of-two fp32 scale per token per KV head (:func:`quantize_kv`: from that row's own amax over head_dim when
the token is written, no calibration), so a token costs ``head_dim + 4`` bytes per KV head and K or V instead of
``2 * head_dim``. Attention attends over ``dequantize_kv(data, scale, q.dtype)``, values that are exact in bf16 and
fp32 (:func:`dequantize_kv` says why), which lets each kernel read the cache its own way: exact mode's kernel
dequantizes each chunk in registers (bitwise the same kernel over the dequantized cache), the decode kernel feeds
the E4M3 tiles to its dot products and scales their fp32 results (equal to summation order). Under ``jet`` the
training forward attends over the very same values (``forward_packed(..., kv_fp8=True)``: :func:`fake_quantize_kv`,
the gradient straight through), so the policy that sampled the tokens is the one trained (``fp8-rollout`` with
``kv_fp8`` is the off-policy comparison arm), and exact mode keeps both sides' log-probabilities bitwise equal.

Padding rows (e.g. a CUDA-graph batch padded to a captured size) must still carry a valid slot in
``slot_mapping`` (point them at a scratch block the engine never hands out): :func:`write_kv` runs
without host syncs, so it cannot check. A query row that sees no key (context length 0) attends to
the first slot of its first block instead of producing NaN.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from jetrl.quant.backend import KERNEL_DTYPES, choose_impl
from jetrl.quant.exact import EXACT_KV_CHUNK
from jetrl.quant.formats import E4M3, E4M3_MAX
from jetrl.quant.reference import compute_scale


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V rows (N, Hkv, D) -> E4M3 data (N, Hkv, D) and one fp32 scale per (token, KV head) (N, Hkv).

    ``scale = compute_scale(amax over D, pow2_scale=True)``: ``max(amax, 1e-4) / 448`` (an IEEE division) rounded
    up to a power of two ``2^e`` (UE8M0-style, as DeepSeek-V3's activations); ``data = (x / scale).clamp(-448, 448)``
    rounded to E4M3, all in fp32. At D = 128 this is bitwise ``jetrl.quant.reference.quantize(x.reshape(-1, 128),
    ACT, pow2_scale=True)``, the activation format of the linears with power-of-two scales.

    The scale ``2^e`` has ``-22 <= e <= 120`` for finite inputs (the amax floor, the fp32 range; an infinite amax gives
    ``scale = inf`` and data 0 and NaN, as the reference division does). Dividing by it is exact (the quotient is a
    normal fp32 or below E4M3's rounding range), so the only rounding is the one to E4M3 (the clamp catches the last
    bit of the fp32 quotient ``amax / 448``).
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize_kv needs a floating-point tensor (N, Hkv, D), got {x.dtype} of shape "
                        f"{tuple(x.shape)}")
    xf = x.float()
    scale = compute_scale(xf.abs().amax(dim=-1), pow2_scale=True)  # (N, Hkv)
    data = (xf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return data, scale


def dequantize_kv(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values attention reads from an FP8 cache: ``(data * scale)`` in fp32, rounded to ``dtype`` (the query's).

    With :func:`quantize_kv`'s power-of-two scales ``2^e`` (``-22 <= e <= 120``) the product is EXACT in fp32 and in
    bf16, so the rounding to ``dtype`` does nothing there: a nonzero E4M3 value has at most 4 significant bits and
    magnitude in ``[2^-9, 448]``, so ``|data * 2^e|`` lies in ``[2^-31, 448 * 2^120]``. Both formats have 8 exponent
    bits (smallest normal ``2^-126``) and at least 8 significant bits: no subnormal can arise (``2^-31`` is far above
    ``2^-126``) and no bits are lost. The one exception is overflow: a block whose amax is within 1/32 of the fp32
    limit (``|x| >= 248 * 2^120``, about 3.3e38, where ``x / 2^120`` rounds up to 256) dequantizes to +-inf; such K/V
    have overflowed the model long before. Consequences the kernels build on (with ``s = 2^e``):

    * the E4M3 data themselves convert exactly to bf16, fp16 and fp32 (``data.to(bf16)`` loses nothing);
    * a dot product over a row scaled by ``s`` is ``s`` times the dot product of the unscaled row, to the bit, for
      any fixed summation order: multiplying by ``2^e`` commutes with every fp32 rounding while the results stay
      normal, i.e. barring terms below ``2^-126``, which round away against any term of the same dot product
      that matters (so the difference is far below any summation-order tolerance);
    * likewise ``bf16(p * s) = bf16(p) * s`` for a probability ``p``, unless ``p * s < 2^-126`` (``p < 2^-104``:
      weights that vanish against the row's largest, 1).

    With ``dtype = float16`` (5 exponent bits: normals from ``2^-14``, largest 65504) the rounding does act: small
    values become fp16 subnormals or 0 and values from 65536 overflow, so a float16 query attends over rounded
    values; every kernel then forms exactly this rounding in registers.
    """
    return (data.float() * scale[..., None]).to(dtype)


class _FakeQuantizeKV(torch.autograd.Function):
    """``dequantize_kv(quantize_kv(x))`` forward, identity backward (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):
        return dequantize_kv(*quantize_kv(x), x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out


def fake_quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """K or V (N, Hkv, D) as an FP8 cache would give them back (:func:`quantize_kv` then :func:`dequantize_kv`
    to ``x``'s dtype), with the gradient passed straight through to ``x``: the training forward's side of
    the FP8 KV cache."""
    return _FakeQuantizeKV.apply(x)


# SDPA backends jetrl allows (in PyTorch's priority order): every one but cuDNN (see the module doc).
SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def reference_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the reference attention computes in: float64 on the CPU, where it is the only path, so that it sums
    (nearly) exactly and rounds once, and a row's result is the same whether the call holds one query row (a decode
    step) or a whole sequence (the training forward): the CPU's rollout and trainer then differ by nothing but
    what their recipes make differ. Elsewhere q's dtype (the GPU's fused kernels set the order there)."""
    return torch.float64 if q.device.type == "cpu" else q.dtype


def sdpa_backends(x: torch.Tensor):
    """The context for SDPA calls on ``x``'s device: on CUDA, ``sdpa_kernel`` limited to :data:`SDPA_BACKENDS`
    (no per-shape cuDNN graphs); elsewhere nothing (cuDNN is CUDA's only)."""
    return sdpa_kernel(list(SDPA_BACKENDS)) if x.is_cuda else contextlib.nullcontext()


@dataclass
class PagedAttentionMetadata:
    """One engine step over S sequences whose new tokens are packed into N rows."""

    query_start_loc: torch.Tensor  # (S+1,) int32: cumulative new-token counts (row offsets into the packed N)
    context_lens: torch.Tensor  # (S,) int32: tokens in the cache for each seq AFTER this step (cached + new)
    block_tables: torch.Tensor  # (S, max_blocks) int32: physical block ids, -1 where unused
    slot_mapping: torch.Tensor  # (N,) int64: flat slot (block_id * block_size + offset) of each new token
    max_query_len: int
    max_context_len: int
    # exact mode's attention kernel: its program numbering for this step, made once for every layer by
    # plan_exact_attention (None: each call numbers its own; the kernel checks that it fits the call)
    exact_tiles: tuple | None = None

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one new token (decided from the host-side ``max_query_len``)."""
        return self.max_query_len == 1


def _check_kv_scales(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> None:
    """An E4M3 cache comes with both fp32 scale pools, of its shape without head_dim; a cache in the model's dtype
    with none (the bytes alone are not the values: read or written without their scales they would be silently
    wrong)."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("give both k_scale and v_scale (an FP8 cache) or neither")
    if k_scale is None:
        if E4M3 in (k_pool.dtype, v_pool.dtype):
            raise ValueError(f"a {E4M3} cache needs its k_scale and v_scale")
        return
    for data, scale in ((k_pool, k_scale), (v_pool, v_scale)):
        if data.dtype != E4M3 or scale.dtype != torch.float32 or scale.shape != data.shape[:-1]:
            raise ValueError(f"scales go with {E4M3} pools, as fp32 of the pool's shape without head_dim; got "
                             f"{data.dtype} {tuple(data.shape)} and {scale.dtype} {tuple(scale.shape)}")


@dataclass
class PagedKVCache:
    """Per-layer K/V block pools, allocated by the rollout engine: in the model's dtype, or FP8 with scales."""

    k: list[torch.Tensor]  # per layer: (num_blocks, block_size, num_kv_heads, head_dim), model dtype or E4M3
    v: list[torch.Tensor]
    block_size: int
    k_scale: list[torch.Tensor] | None = None  # FP8 only, per layer: (num_blocks, block_size, num_kv_heads) fp32
    v_scale: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        none = [None] * len(self.k)
        for pools in zip(self.k, self.v, self.k_scale or none, self.v_scale or none):
            _check_kv_scales(*pools)

    @staticmethod
    def allocate(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None, kv_fp8: bool = False) -> "PagedKVCache":
        """Zero-filled pools for ``num_layers`` layers in ``dtype`` (the model's); ``kv_fp8``: E4M3 pools and fp32
        scale pools instead (``dtype`` is then unused: attention dequantizes to the query's dtype)."""
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if int(value) <= 0:
                raise ValueError(f"PagedKVCache.allocate: {name} must be positive, got {value}")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)

        def pools(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        if not kv_fp8:
            return PagedKVCache(pools(shape, dtype), pools(shape, dtype), block_size)
        return PagedKVCache(pools(shape, E4M3), pools(shape, E4M3), block_size, pools(shape[:-1], torch.float32),
                            pools(shape[:-1], torch.float32))

    @property
    def is_fp8(self) -> bool:
        """Whether K/V are stored as E4M3 with per-(token, KV head) scales."""
        return self.k_scale is not None

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Layer ``i``'s ``(k, v, k_scale, v_scale)`` (scales None for a cache in the model's dtype)."""
        scales = (None, None) if self.k_scale is None else (self.k_scale[i], self.v_scale[i])
        return self.k[i], self.v[i], *scales

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    def nbytes(self) -> int:
        """Bytes of every pool, scales included."""
        scales = (*self.k_scale, *self.v_scale) if self.k_scale is not None else ()
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *scales))


def write_kv(k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale_layer: torch.Tensor | None = None,
             v_scale_layer: torch.Tensor | None = None, impl: str | None = None) -> None:
    """Store the new tokens' K/V (N, Hkv, D) at their flat slots, in place. No host syncs.

    Without scale pools K and V are copied (cast to the pools' dtype); with them (an FP8 cache) each token is
    quantized (:func:`quantize_kv`) and its data and scales scattered. Where the seam picks the kernels (``impl``:
    ``None``, ``"reference"`` or ``"triton"``) one Triton launch writes K and V, bitwise this reference
    (:mod:`jetrl.quant.kernels.kv_cache_triton`). The copy's kernel takes K, V and pools of one dtype (bf16, fp16,
    fp32) with a contiguous head_dim and contiguous slots: anything else stays on the reference's two
    ``index_copy_``, also inside a block that forces the kernels; ``impl="triton"`` for it is a ``TypeError``."""
    num_kv_heads, head_dim = k_cache_layer.shape[2], k_cache_layer.shape[3]
    k_flat = k_cache_layer.view(-1, num_kv_heads, head_dim)  # (num_blocks * block_size, Hkv, D)
    v_flat = v_cache_layer.view(-1, num_kv_heads, head_dim)
    _check_kv_scales(k_cache_layer, v_cache_layer, k_scale_layer, v_scale_layer)
    if k_scale_layer is None:
        pools = (k, v, k_cache_layer, v_cache_layer)
        copyable = (k.dtype == v.dtype == k_cache_layer.dtype == v_cache_layer.dtype and k.dtype in KERNEL_DTYPES
                    and all(t.stride(-1) == 1 for t in pools) and slot_mapping.is_contiguous())
        if impl == "triton" and not copyable:
            raise TypeError(f"write_kv: the one-launch copy takes K, V and pools of one dtype (bf16/fp16/fp32), a "
                            f"contiguous head_dim and contiguous slots; got {[str(t.dtype) for t in pools]}, "
                            f"head_dim strides {[t.stride(-1) for t in pools]}, slot stride {slot_mapping.stride()}")
        if copyable and choose_impl(k, impl, op="kv_write", eligible=copyable) == "triton":
            from jetrl.quant.kernels.kv_cache_triton import write_kv_copy

            write_kv_copy(k, v, k_cache_layer, v_cache_layer, slot_mapping)
            return
        k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))
        return
    if choose_impl(k, impl, op="kv_write") == "triton":
        from jetrl.quant.kernels.kv_cache_triton import write_kv_fp8

        write_kv_fp8(k, v, k_cache_layer, v_cache_layer, k_scale_layer, v_scale_layer, slot_mapping)
        return
    for x, data_flat, scale_layer in ((k, k_flat, k_scale_layer), (v, v_flat, v_scale_layer)):
        data, scale = quantize_kv(x)
        # the bytes, as uint8: index_copy_ has no float8 kernel on every device
        data_flat.view(torch.uint8).index_copy_(0, slot_mapping, data.view(torch.uint8))
        scale_layer.view(-1, num_kv_heads).index_copy_(0, slot_mapping, scale)


def _row_coordinates(meta: PagedAttentionMetadata, num_rows: int, device: torch.device):
    """For each packed row: its sequence index and its index among that sequence's new tokens; and each
    sequence's number of new tokens (S,)."""
    qsl = meta.query_start_loc.to(device=device, dtype=torch.long)
    rows = torch.arange(num_rows, device=device)
    seq_of_row = torch.searchsorted(qsl[1:], rows, right=True)  # (N,)
    index_in_seq = rows - qsl[seq_of_row]  # (N,)
    return seq_of_row, index_in_seq, qsl[1:] - qsl[:-1]


def _seq_lengths(cu_seqlens: list[int], num_rows: int | None = None) -> list[int]:
    """The sequence lengths of S+1 host offsets; with ``num_rows``, checked to rise from 0 to it (S >= 1)."""
    lengths = [end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    if num_rows is not None and (not lengths or min(lengths) < 0 or cu_seqlens[0] != 0 or cu_seqlens[-1] != num_rows):
        raise ValueError(f"cu_seqlens must rise from 0 to the number of rows ({num_rows}), got {cu_seqlens}")
    return lengths


def _paged_dims(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    """``(num_rows, num_heads, head_dim, block_size, num_kv_heads)`` of attention over a paged cache, checked."""
    _check_kv_scales(k_cache_layer, v_cache_layer, k_scale, v_scale)
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache_layer.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    return num_rows, num_heads, head_dim, block_size, num_kv_heads


def paged_attention_reference(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor,
                              meta: PagedAttentionMetadata, softmax_scale: float,
                              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of N new query rows (N, Hq, D) over a paged cache that already holds this step's K/V.

    New token ``i`` (0-based among the ``q_len`` new tokens) of sequence ``s`` attends to cache positions
    ``< context_lens[s] - (q_len - 1 - i)``. GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``.
    Pure tensor ops on the given tensors (no host syncs, shapes fixed by ``max_query_len`` and the block
    table width), so it runs on CPU and inside a CUDA graph. Returns (N, Hq, D) in ``q``'s dtype.
    ``k_scale``/``v_scale`` (num_blocks, block_size, Hkv): an FP8 cache, whose gathered keys and values are
    dequantized to ``q``'s dtype (:func:`dequantize_kv`) before the same math.
    """
    num_rows, num_heads, head_dim, block_size, num_kv_heads = _paged_dims(q, k_cache_layer, v_cache_layer, k_scale,
                                                                          v_scale)
    device = q.device
    num_seqs, max_blocks = meta.block_tables.shape
    max_q = int(meta.max_query_len)
    num_keys = max_blocks * block_size

    tables = meta.block_tables.to(device=device, dtype=torch.long).clamp(min=0)  # (S, max_blocks)
    keys = k_cache_layer[tables].reshape(num_seqs, num_keys, num_kv_heads, head_dim)  # (S, L, Hkv, D)
    values = v_cache_layer[tables].reshape(num_seqs, num_keys, num_kv_heads, head_dim)
    if k_scale is not None:
        keys = dequantize_kv(keys, k_scale[tables].reshape(num_seqs, num_keys, num_kv_heads), q.dtype)
        values = dequantize_kv(values, v_scale[tables].reshape(num_seqs, num_keys, num_kv_heads), q.dtype)
    group = num_heads // num_kv_heads
    dtype = reference_dtype(q)
    if q.is_cuda:  # each query head's own copy of its KV head: (S, Hq, L, D)
        keys = keys.transpose(1, 2).repeat_interleave(group, dim=1)
        values = values.transpose(1, 2).repeat_interleave(group, dim=1)
    else:  # (S, Hkv, L, D), widened once into a contiguous copy; SDPA shares a KV head among its group: the same
        # numbers as repeating the heads, without the copies that made most of a CPU rollout's attention time
        keys = keys.permute(0, 2, 1, 3).to(dtype, memory_format=torch.contiguous_format)
        values = values.permute(0, 2, 1, 3).to(dtype, memory_format=torch.contiguous_format)

    if max_q == 1 and num_rows == num_seqs:  # decode: row s is sequence s
        q_pad = q.view(num_seqs, 1, num_heads, head_dim)
        q_len = torch.ones(num_seqs, dtype=torch.long, device=device)
        seq_of_row = index_in_seq = None
    else:
        seq_of_row, index_in_seq, q_len = _row_coordinates(meta, num_rows, device)
        q_pad = q.new_zeros(num_seqs, max_q, num_heads, head_dim)
        q_pad[seq_of_row, index_in_seq] = q
    q_pad = q_pad.transpose(1, 2)  # (S, Hq, max_q, D)

    ctx = meta.context_lens.to(device=device, dtype=torch.long)  # (S,)
    i = torch.arange(max_q, device=device)
    key_pos = torch.arange(num_keys, device=device)
    limit = ctx[:, None] - (q_len[:, None] - 1 - i[None, :])  # (S, max_q): visible keys are < limit
    mask = key_pos[None, None, :] < limit[:, :, None]  # (S, max_q, L)
    mask = mask | (key_pos == 0)[None, None, :] & (limit <= 0)[:, :, None]  # keep empty rows finite
    with sdpa_backends(q):
        out = F.scaled_dot_product_attention(q_pad.to(dtype), keys.to(dtype), values.to(dtype), attn_mask=mask[:, None],
                                             scale=softmax_scale, enable_gqa=not q.is_cuda and group > 1)
    out = out.to(q.dtype).transpose(1, 2)  # (S, max_q, Hq, D)
    if seq_of_row is None:
        return out.reshape(num_rows, num_heads, head_dim)
    return out[seq_of_row, index_in_seq]


def paged_attention(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor,
                    meta: PagedAttentionMetadata, softmax_scale: float, impl: str | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention: decode steps in the Triton kernel where the seam picks the kernels (``impl``: ``None``
    for the automatic choice, or ``"reference"`` / ``"triton"``), everything else in the reference.
    ``k_scale``/``v_scale``: the scale pools of an FP8 cache (None: a cache in the model's dtype)."""
    if meta.is_decode and choose_impl(q, impl, op="paged_decode") == "triton":
        from jetrl.quant.kernels.paged_attention_triton import paged_decode

        return paged_decode(q, k_cache_layer, v_cache_layer, meta, softmax_scale, k_scale=k_scale, v_scale=v_scale)
    return paged_attention_reference(q, k_cache_layer, v_cache_layer, meta, softmax_scale, k_scale, v_scale)


def flash_varlen_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the flash-attention kernels run packed rows of this dtype and head size on ``device``: CUDA of
    compute capability 8.0 or later, bf16 or fp16, a head size that is a multiple of 8 up to 256."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head_dim % 8 == 0
            and head_dim <= 256 and torch.cuda.get_device_capability(device)[0] >= 8)


def flash_varlen_eligible(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`varlen_attention` runs the packed rows in one flash-attention launch
    (:func:`flash_varlen_supported` for q, and k/v of q's dtype)."""
    return k.dtype == q.dtype and flash_varlen_supported(q.device, q.dtype, q.shape[-1])


class _FlashVarlen(torch.autograd.Function):
    """Block-diagonal causal attention over packed rows in one launch each way: the flash-attention kernels
    PyTorch ships (``aten::_flash_attention_forward`` / ``_backward``, the kernels behind SDPA's flash backend and
    ``torch.nn.attention.varlen``), over the (S+1,) int32 offsets ``cu``. Query heads share their KV head in
    the kernel (GQA), so K and V are never expanded."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int, softmax_scale: float):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len, ctx.softmax_scale = max_len, softmax_scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, seed, offset,
            scale=ctx.softmax_scale)
        return dq, dk, dv, None, None, None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                     softmax_scale: float, cu_seqlens_device: torch.Tensor | None = None) -> torch.Tensor:
    """Block-diagonal causal attention over packed rows: q (N, Hq, D), k/v (N, Hkv, D) -> (N, Hq, D).

    ``cu_seqlens`` is a host list (S+1 offsets; the caller syncs once per forward, not per layer). Where
    :func:`flash_varlen_eligible` holds, all sequences run in one flash-attention launch (forward and backward:
    :class:`_FlashVarlen`) over ``cu_seqlens_device``, the same offsets as an int32 tensor on q's device (made
    here when not given; a caller attending several layers makes it once). Elsewhere, and as its reference,
    each sequence runs one causal SDPA on its own rows. Either way the cost is sum(len^2), never N^2, and
    nothing is padded.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    lengths = _seq_lengths(cu_seqlens, q.shape[0])
    if q.shape[0] and flash_varlen_eligible(q, k):
        if cu_seqlens_device is None:
            cu_seqlens_device = torch.tensor(cu_seqlens, dtype=torch.int32, device=q.device)
        return _FlashVarlen.apply(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_device, max(lengths),
                                  float(softmax_scale))
    return varlen_attention_reference(q, k, v, cu_seqlens, softmax_scale)


def varlen_attention_on_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                               max_seqlen: int, softmax_scale: float) -> torch.Tensor:
    """:func:`varlen_attention` without reading the offsets on the host, so a CUDA graph can capture it:
    ``cu_seqlens`` (S+1,) int32 on q's device (zero-length sequences allowed, e.g. a padded batch's tail) and
    ``max_seqlen`` an upper bound of the sequence lengths (the flash kernel's grid; a loose bound only launches
    programs that exit at once). Flash-attention only (:func:`flash_varlen_eligible`); elsewhere a ValueError."""
    if not flash_varlen_eligible(q, k):
        raise ValueError("varlen_attention_on_device needs the flash-attention path (CUDA, compute capability 8.0+, "
                         f"bf16/fp16, head size a multiple of 8 up to 256); got {q.dtype} q of head size "
                         f"{q.shape[-1]} on {q.device}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be int32 on {q.device}, got {cu_seqlens.dtype} on {cu_seqlens.device}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    return _FlashVarlen.apply(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, int(max_seqlen),
                              float(softmax_scale))


def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                               softmax_scale: float) -> torch.Tensor:
    """:func:`varlen_attention` as one causal SDPA per sequence (any device and dtype): its reference."""
    lengths = _seq_lengths(cu_seqlens)
    gqa = q.shape[1] != k.shape[1]
    out_dtype, dtype = q.dtype, reference_dtype(q)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with sdpa_backends(q):
        if len(set(lengths)) == 1:  # equal lengths (the plain (B, T) batch): one batched SDPA
            num_seqs, seq_len = len(lengths), lengths[0]
            qb, kb, vb = (t.reshape(num_seqs, seq_len, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=softmax_scale, enable_gqa=gqa)
            return out.transpose(1, 2).reshape(q.shape).to(out_dtype)
        outs = []
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            if end == start:
                continue
            qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))  # (1, H, L, D)
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=softmax_scale, enable_gqa=gqa)
            outs.append(out[0].transpose(0, 1))  # (L, Hq, D)
    return torch.cat(outs, dim=0).to(out_dtype)


def exact_attention_reference(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor,
                              meta: PagedAttentionMetadata, softmax_scale: float,
                              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Exact mode's attention (the specification of its kernel): q (N, Hq, D) over a paged cache -> (N, Hq, D).

    Same visibility rule as :func:`paged_attention_reference`. Each row walks its sequence's logical key
    positions ``0, 1, ...`` in chunks of ``EXACT_KV_CHUNK`` (the last chunk padded, every chunk the same
    shape), with an online softmax in fp32: per chunk, scores ``sum_d(q * k) * scale`` (masked ones
    ``-inf``), ``m' = max(m, max(s))``, probabilities ``p = exp(s - m')`` rounded to q's dtype, ``l = l * exp(m -
    m') + sum(p)``, ``acc = acc * exp(m - m') + sum(p * v)``; the output is ``acc / l`` in q's dtype. (The kernel
    computes both sums as MMAs, so that its decode schedule, with the MMA's operands swapped, gets the same bits.)
    A masked position contributes exact zeros and a chunk past a row's last key leaves its state unchanged
    (``exp(0) = 1``), so the result depends on the row's own keys only: not on the batch, the other rows, the table
    width or the block size. Each sum reduces the innermost, contiguous dimension (on the CPU such a reduction
    computes every output on its own, whatever the number of rows or threads). No host syncs.
    An FP8 cache (``k_scale``/``v_scale`` given): each chunk's keys and values are dequantized to ``q``'s dtype
    first (:func:`dequantize_kv`), so the result is bitwise this function over the dequantized cache.
    """
    num_rows, num_heads, head_dim, block_size, num_kv_heads = _paged_dims(q, k_cache_layer, v_cache_layer, k_scale,
                                                                          v_scale)
    device = q.device
    seq_of_row, index_in_seq, q_len = _row_coordinates(meta, num_rows, device)
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
        k, v = k_flat[slots], v_flat[slots]  # (N, C, Hkv, D)
        if k_scale is not None:
            k = dequantize_kv(k, k_scale.reshape(-1, num_kv_heads)[slots], q.dtype)
            v = dequantize_kv(v, v_scale.reshape(-1, num_kv_heads)[slots], q.dtype)
        k = k.float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # (N, Hq, C, D)
        # (N, Hq, D, C) contiguous: the sum over the chunk's keys below is then an inner reduction, which computes each
        # output on its own. Over (N, Hq, C, D) it would be an outer one, whose CPU kernel sums a column in another
        # order depending on where it falls among the columns its thread is given (blocks of a few vectors, then
        # single vectors), and the threads' split of the columns depends on N: not batch-invariant
        v = v.float().repeat_interleave(group, dim=2).permute(0, 2, 3, 1).contiguous()
        s = (q32 * k).sum(-1) * softmax_scale  # (N, Hq, C)
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None]).to(q.dtype).float()  # masked positions: exactly 0
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + (p[:, :, None, :] * v).sum(-1)
        m = m_new
    return (acc / l[..., None]).to(q.dtype)


def exact_attention(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor,
                    meta: PagedAttentionMetadata, softmax_scale: float, impl: str | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Exact mode's attention for prefill and decode steps alike (see :func:`exact_attention_reference`): the
    Triton kernel (:mod:`jetrl.quant.kernels.exact_attention_triton`) where the seam picks the kernels, else
    the reference. Each implementation is batch-invariant on its own; the two agree to fp32 rounding.
    ``k_scale``/``v_scale``: the scale pools of an FP8 cache (None: a cache in the model's dtype)."""
    if choose_impl(q, impl, op="exact_attention") == "triton":
        from jetrl.quant.kernels.exact_attention_triton import exact_attention_fwd

        return exact_attention_fwd(q, k_cache_layer, v_cache_layer, meta, softmax_scale, k_scale=k_scale,
                                   v_scale=v_scale)
    return exact_attention_reference(q, k_cache_layer, v_cache_layer, meta, softmax_scale, k_scale, v_scale)


def plan_exact_attention(meta: PagedAttentionMetadata, q_like: torch.Tensor, num_heads: int,
                         num_kv_heads: int) -> PagedAttentionMetadata:
    """``meta`` with exact mode's attention kernel's program numbering for ``q_like.shape[0]`` query rows (and
    ``num_heads`` query heads over ``num_kv_heads`` KV heads) made once, for every layer of a forward to read,
    where :func:`exact_attention` runs the kernel on tensors like ``q_like``; ``meta`` itself otherwise. A
    schedule: the kernel computes the same numbering per call without it."""
    if choose_impl(q_like, None, op="exact_attention") != "triton" or q_like.shape[0] == 0:
        return meta
    from jetrl.quant.kernels.exact_attention_triton import number_tiles

    return dataclasses.replace(meta, exact_tiles=number_tiles(meta, q_like.shape[0], num_heads, num_kv_heads))


def packed_as_paged(cu_seqlens: list[int], device: torch.device | str) -> PagedAttentionMetadata:
    """Packed sequences (``cu_seqlens``: S+1 host offsets) as paged metadata over a cache of one-token blocks:
    the packed K (N, Hkv, D) viewed as (N, 1, Hkv, D), sequence s's position j in block ``cu[s] + j``."""
    lengths = _seq_lengths(cu_seqlens)
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
    def forward(ctx, q, k, v, cu_seqlens, softmax_scale, meta):
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
        return (*grads, None, None, None)


def exact_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                           softmax_scale: float, meta: PagedAttentionMetadata | None = None) -> torch.Tensor:
    """:func:`varlen_attention`'s inputs and result, computed by :func:`exact_attention` (the rollout's function
    and order) over the packed rows; differentiable, with SDPA's backward. ``meta``: ``packed_as_paged(cu_seqlens,
    q.device)`` made once by a caller that attends over the same packing in every layer (None: made here)."""
    _seq_lengths(cu_seqlens, q.shape[0])
    if q.shape[0] == 0:
        return q.new_zeros(q.shape)
    if meta is None:
        meta = packed_as_paged(cu_seqlens, q.device)
    return _ExactVarlenAttention.apply(q, k, v, list(cu_seqlens), softmax_scale, meta)


__all__ = [
    "quantize_kv", "dequantize_kv", "fake_quantize_kv", "PagedAttentionMetadata", "PagedKVCache", "write_kv",
    "paged_attention_reference", "paged_attention", "varlen_attention", "varlen_attention_on_device",
    "flash_varlen_supported", "sdpa_backends", "SDPA_BACKENDS", "exact_attention",
    "exact_attention_reference", "exact_varlen_attention", "packed_as_paged", "plan_exact_attention",
]
