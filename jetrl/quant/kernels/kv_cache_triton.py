"""Triton writes of new tokens' K and V into a paged cache, K and V in one launch of one kernel: scattered to the
slots as they are (:func:`write_kv_copy`, a BF16/fp16/fp32 cache), or quantized per (token, KV head)
(:func:`write_kv_fp8`).

A copy is bit for bit two ``index_copy_`` calls of the same dtype, one launch instead of two.

The FP8 write is the kernel of :func:`jetrl.models.attention.write_kv` when the cache is FP8 (specification:
:func:`jetrl.models.attention.quantize_kv` followed by an ``index_copy_`` of data and scales). One program per new
token quantizes that token's K and V rows, ``(Hkv, D)`` each, with one power-of-two fp32 scale per KV head (a 1 x
head_dim block), bit for bit the reference's arithmetic (the shared helpers of
:mod:`~jetrl.quant.kernels.quantize_triton`), and stores data and scales at the token's flat slot
(``block * block_size + offset``) of the pools. One launch for K and V, no host synchronisation (the grid is the
number of new tokens), so a decode step using it can be captured in a CUDA graph. Like every slot write, a padding
row must carry a valid (scratch) slot: nothing is checked on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.quant.backend import KERNEL_DTYPES
from jetrl.quant.formats import E4M3
from jetrl.quant.kernels.quantize_triton import _block_scale, _quantize_e4m3
from jetrl.quant.kernels.tuning import COMPILE_OPTIONS


@triton.jit
def _store_rows(x_row, stride_xh, data_slot, stride_dh, scale_slot, stride_sh, h, d, h_ok, mask, QUANT: tl.constexpr):
    """One token's K or V (BLOCK_H heads, BLOCK_D) from ``x_row`` to the slot's pointers: copied as it is, or with
    ``QUANT`` quantized with one scale per head (data and scales stored; masked lanes load 0 and change no head's
    amax)."""
    x = tl.load(x_row + h[:, None] * stride_xh + d[None, :], mask=mask, other=0.0)
    if QUANT:
        x = x.to(tl.float32)
        scale = _block_scale(tl.max(tl.abs(x), axis=1), True)  # (BLOCK_H,) powers of two
        tl.store(scale_slot + h * stride_sh, scale, mask=h_ok)
        x = _quantize_e4m3(x, scale[:, None], True)
    tl.store(data_slot + h[:, None] * stride_dh + d[None, :], x, mask=mask)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                     stride_kn, stride_kh, stride_vn, stride_vh,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                     stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
    """One new token: its K and V rows stored at its slot of the pools, with ``QUANT`` quantized per KV head (the
    scale pools ``ks_ptr``/``vs_ptr`` are written only then)."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // PAGE
    offset = slot % PAGE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < NUM_KV_HEADS
    mask = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    row = token.to(tl.int64)
    _store_rows(k_ptr + row * stride_kn, stride_kh, kc_ptr + block * stride_kcb + offset * stride_kct, stride_kch,
                ks_ptr + block * stride_ksb + offset * stride_kst, stride_ksh, h, d, h_ok, mask, QUANT)
    _store_rows(v_ptr + row * stride_vn, stride_vh, vc_ptr + block * stride_vcb + offset * stride_vct, stride_vch,
                vs_ptr + block * stride_vsb + offset * stride_vst, stride_vsh, h, d, h_ok, mask, QUANT)


def _check(fn, k, v, k_cache, v_cache, slot_mapping, scales=()) -> None:
    """The checks both writes share (``fn``: the caller's name for the messages); ``scales``: the FP8 write's."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"{fn}: k and v must be (N, Hkv, D) of one shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.dtype not in KERNEL_DTYPES or v.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{fn}: k and v must be bfloat16/float16/float32, got {k.dtype} and {v.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{fn}: the caches must be (num_blocks, block_size, Hkv, D) of one shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if scales and (k_cache.dtype != E4M3 or v_cache.dtype != E4M3):
        raise ValueError(f"{fn}: the caches must be {E4M3}, got {k_cache.dtype} and {v_cache.dtype}")
    if not scales and not k.dtype == v.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"{fn}: k, v and the caches must have one dtype (a copy), got {k.dtype}, {v.dtype}, "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"{fn}: k {tuple(k.shape)} does not match the cache {tuple(k_cache.shape)} (Hkv, D)")
    want = tuple(k_cache.shape[:3])
    for name, scale in zip(("k_scale", "v_scale"), scales):
        if scale.dtype != torch.float32 or tuple(scale.shape) != want:
            raise ValueError(f"{fn}: {name} must be float32 of shape {want} (num_blocks, block_size, Hkv), "
                             f"got {scale.dtype} {tuple(scale.shape)}")
    if (slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0] or not slot_mapping.is_contiguous()
            or slot_mapping.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{fn}: slot_mapping must be contiguous int32/int64 of shape ({k.shape[0]},), got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)} with stride {slot_mapping.stride()}")
    devices = {t.device for t in (k, v, k_cache, v_cache, *scales, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"{fn}: all tensors must be on one device, got {sorted(map(str, devices))}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name}'s head_dim must be contiguous")


def _launch(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    """The kernel over the N new tokens; without scale pools (``None``) a copy, whose scale arguments are never read
    (the K pool and zero strides stand in for them)."""
    quant = k_scale is not None
    scales = (k_scale, v_scale, *k_scale.stride(), *v_scale.stride()) if quant else (k_cache, v_cache) + (0,) * 6
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        k, v, slot_mapping, k_cache, v_cache, *scales[:2],
        *k.stride()[:2], *v.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], *scales[2:],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
        QUANT=quant, num_warps=4 if block_h * block_d >= 1024 else 1, **COMPILE_OPTIONS)


def write_kv_copy(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K and V (N, Hkv, D) at their flat slots of the pools ``k_cache``/``v_cache``
    (num_blocks, block_size, Hkv, D) of the same dtype, in place, ``slot_mapping`` (N,) int: bit for bit
    ``index_copy_`` of each (:func:`jetrl.models.attention.write_kv`'s reference path), in one launch, no host
    syncs."""
    _check("write_kv_copy", k, v, k_cache, v_cache, slot_mapping)
    _launch(k, v, k_cache, v_cache, None, None, slot_mapping)


def write_kv_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize the new tokens' K and V (N, Hkv, D) per (token, KV head) to E4M3 and store data and power-of-two
    fp32 scales at their flat slots of the FP8 pools, in place: ``k_cache``/``v_cache`` (num_blocks, block_size,
    Hkv, D) ``float8_e4m3fn``, ``k_scale``/``v_scale`` (num_blocks, block_size, Hkv) fp32, ``slot_mapping`` (N,)
    int.

    Bit for bit ``data, scale = quantize_kv(x)`` then ``index_copy_`` of both at the slots
    (:func:`jetrl.models.attention.write_kv`'s reference path). One launch, no host syncs.
    """
    _check("write_kv_fp8", k, v, k_cache, v_cache, slot_mapping, (k_scale, v_scale))
    _launch(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)


__all__ = ["write_kv_copy", "write_kv_fp8"]
