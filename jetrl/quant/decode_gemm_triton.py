"""Split-K FP8 GEMM for decode-sized inputs (M <= 256 rows against a 128x128-block weight).

At decode sizes the GEMM is bound by the weight's bytes: the kernel streams the weight once, split along K
over enough programs to keep every SM busy, and reduces the partials deterministically in the kernel.
Operands and scales are laid out as for :func:`jetrl.quant.triton_kernels.blockwise_fp8_gemm`.
Imported lazily by the CUDA backend, like every Triton module of jetrl.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jetrl.quant.triton_kernels import BLOCK, _cdiv, cast_rne

@triton.jit
def _fp8_decode_gemm_kernel(
    a_ptr, c_ptr, as_ptr, ws_ptr, lock_ptr,
    b0_ptr, bs0_ptr, bias0_ptr, N0, b1_ptr, bs1_ptr, bias1_ptr, N1, b2_ptr, bs2_ptr, bias2_ptr, N2,
    M, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    NUM_KB: tl.constexpr, KB_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, B_SCALE_ROWS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """C = A @ B^T for a small M (decode): weight-bandwidth bound, so the kernel is built around streaming B.

    "Swap AB": each program computes the transposed tile ``C^T[n-tile, :] = B[n-tile, k-range] @ A^T``, so
    the weight rows form the MMA's large dimension and the few tokens its small one. BLOCK_M covers all of
    M. The K range is split over ``SPLIT_K`` programs per column tile so that enough programs stream the
    weight at once; each writes an fp32 partial, and the last of them to finish (an atomic counter per
    column tile) sums all partials in split order: deterministic, and independent of which finished last.

    Up to three weights (``NUM_GROUPS``) that share the input A (q/k/v, gate/up) run in one launch: their
    column tiles follow one another and their outputs lie side by side in C. With ``HAS_BIAS`` the BF16
    result gets the bias added after rounding, as ``F.linear``-style ``y + bias`` would.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    b_ptr = b0_ptr
    bs_ptr = bs0_ptr
    bias_ptr = bias0_ptr
    N = N0
    tile_n = pid_n
    col0 = 0
    if NUM_GROUPS > 1:
        t0 = tl.cdiv(N0, BLOCK_N)
        if pid_n >= t0:
            b_ptr = b1_ptr
            bs_ptr = bs1_ptr
            bias_ptr = bias1_ptr
            N = N1
            tile_n = pid_n - t0
            col0 = N0
        if NUM_GROUPS > 2:
            t1 = t0 + tl.cdiv(N1, BLOCK_N)
            if pid_n >= t1:
                b_ptr = b2_ptr
                bs_ptr = bs2_ptr
                bias_ptr = bias2_ptr
                N = N2
                tile_n = pid_n - t1
                col0 = N0 + N1
    rm = tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 128)
    m_ok = rm < M
    n_ok = rn < N
    kb0 = pid_k * KB_PER_SPLIT
    a_ptrs = a_ptr + rm[None, :].to(tl.int64) * stride_am + (kb0 * 128 + rk)[:, None] * stride_ak  # (128, BLOCK_M)
    b_ptrs = b_ptr + rn[:, None].to(tl.int64) * stride_bn + (kb0 * 128 + rk)[None, :] * stride_bk  # (BLOCK_N, 128)
    as_ptrs = as_ptr + rm * stride_asm + kb0 * stride_ask
    bs_ptrs = bs_ptr + (rn // B_SCALE_ROWS) * stride_bsn + kb0 * stride_bsk
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(0, KB_PER_SPLIT):
        k_rem = K - (kb0 + i) * 128
        k_ok = rk < k_rem
        b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        sb = tl.load(bs_ptrs, mask=n_ok & (rn * 0 + k_rem > 0), other=0.0)  # (block tensors: a scalar
        sa = tl.load(as_ptrs, mask=m_ok & (rm * 0 + k_rem > 0), other=0.0)  # mask trips some interpreters)
        acc += tl.dot(b, a) * (sb[:, None] * sa[None, :])
        a_ptrs += 128 * stride_ak
        b_ptrs += 128 * stride_bk
        as_ptrs += stride_ask
        bs_ptrs += stride_bsk
    c_ptrs = c_ptr + rm[None, :].to(tl.int64) * stride_cm + (col0 + rn)[:, None] * stride_cn
    c_mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K == 1:
        _store_decode_tile(c_ptrs, acc, c_mask, bias_ptr, rn, n_ok, HAS_BIAS)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rm[None, :]  # (BLOCK_N, BLOCK_M)
        ws_tile = ws_ptr + pid_n.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
        tl.store(ws_tile + pid_k * (BLOCK_N * BLOCK_M) + tile, acc)
        done = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")  # orders the store above before the count
        if done == SPLIT_K - 1:  # the last split of this column tile: sum the partials in split order
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(0, SPLIT_K):
                total += tl.load(ws_tile + s * (BLOCK_N * BLOCK_M) + tile, cache_modifier=".cg")
            _store_decode_tile(c_ptrs, total, c_mask, bias_ptr, rn, n_ok, HAS_BIAS)
            tl.atomic_xchg(lock_ptr + pid_n, 0)  # ready for the next call (and the next graph replay)


@triton.jit
def _store_decode_tile(c_ptrs, acc, c_mask, bias_ptr, rn, n_ok, HAS_BIAS: tl.constexpr):
    c = cast_rne(acc, c_ptrs.dtype.element_ty)
    if HAS_BIAS:  # round the product first, then add: the unfused ``gemm(...) + bias``
        bias = tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        c = cast_rne(c.to(tl.float32) + bias[:, None], c_ptrs.dtype.element_ty)
    tl.store(c_ptrs, c, mask=c_mask)


@dataclass(frozen=True)
class DecodeGemmConfig:
    """Tiles of the split-K decode GEMM: BLOCK_N weight rows per program, K split in ``split_k`` ranges."""

    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


DECODE_GEMM_MAX_M = 256  # one tile row covers M; the backend sends only M <= 64 here by default
_LOCKS: dict[tuple[str, int | None], torch.Tensor] = {}
_LOCK_SLOTS = 1 << 14


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_decode_config(m: int, n: int, k: int, device: torch.device) -> DecodeGemmConfig:
    """64-row weight tiles, K split (a power of two, at most 16) until about three programs per SM run for
    M <= 32, about 1.5 for larger M (whose programs do more MMA work per weight byte). Chosen from a sweep
    on the H200 at Llama-8B shapes (BENCHMARKS.md, decode GEMMs)."""
    block_n = 64
    tiles = _cdiv(n, block_n)
    per_sm = 3.0 if m <= 32 else 1.5
    want = max(1, -(-int(per_sm * _sm_count(device)) // tiles))
    split = 1 << (want - 1).bit_length()
    split = max(1, min(split, 16, max(1, _cdiv(k, BLOCK) // 4)))
    return DecodeGemmConfig(block_n=block_n, split_k=split, num_stages=3)


def _locks(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    locks = _LOCKS.get(key)
    if locks is None:  # zeroed once; every use leaves it zeroed again
        locks = _LOCKS[key] = torch.zeros(_LOCK_SLOTS, dtype=torch.int32, device=device)
    return locks


def fp8_decode_gemm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
                    b_scale_rows: int, out_dtype: torch.dtype = torch.bfloat16,
                    config: DecodeGemmConfig | None = None) -> torch.Tensor:
    """``a @ b.T`` for a decode-sized ``a`` (M <= 256 rows), operands as in :func:`blockwise_fp8_gemm`.

    Split-K over the weight with a deterministic in-kernel reduction (see the kernel). Calls on one device
    must not run concurrently on different streams (they share the per-column-tile counters).
    """
    return _decode_gemm(a_data, a_scale, [(b_data, b_scale, None)], b_scale_rows, out_dtype, config)


def fp8_decode_gemm_grouped(a_data: torch.Tensor, a_scale: torch.Tensor,
                            weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
                            out_dtype: torch.dtype = torch.bfloat16,
                            config: DecodeGemmConfig | None = None) -> torch.Tensor:
    """``cat([a @ w_i.T + bias_i], dim=1)`` for up to three 128x128-block weights sharing the input ``a``
    (M <= 256), in one launch: (M, sum N_i). Each output slice equals :func:`fp8_decode_gemm` of its weight
    run with the same config (plus its bias, added after rounding to ``out_dtype``); the default config is
    chosen for the total width, so its K split may differ from a lone call's."""
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"fp8_decode_gemm_grouped takes 1 to 3 weights, got {len(weights)}")
    return _decode_gemm(a_data, a_scale, weights, 128, out_dtype, config)


def _decode_gemm(a_data, a_scale, weights, b_scale_rows, out_dtype, config):
    m, k = a_data.shape
    if m > DECODE_GEMM_MAX_M:
        raise ValueError(f"fp8_decode_gemm handles at most {DECODE_GEMM_MAX_M} rows, got {m}")
    ns = [w.shape[0] for w, _, _ in weights]
    b0, bs0, _ = weights[0]
    for w, sc, bias in weights:
        if w.shape[1] != k or w.stride() != b0.stride() or sc.stride() != bs0.stride():
            raise ValueError("fp8_decode_gemm: grouped weights need the input's K and equal layouts")
    biases = [bias for _, _, bias in weights]
    has_bias = any(b is not None for b in biases)
    if has_bias and (any(b is None for b in biases) or len({b.dtype for b in biases}) != 1):
        raise ValueError("fp8_decode_gemm: give a bias for every grouped weight (one dtype) or for none")
    n_total = sum(ns)
    out = torch.empty((m, n_total), dtype=out_dtype, device=a_data.device)
    if m == 0 or n_total == 0:
        return out
    if k == 0:
        out.zero_()
        return out + torch.cat(biases).to(out_dtype) if has_bias else out
    block_n = (config or DecodeGemmConfig()).block_n
    tiles = sum(_cdiv(n, block_n) for n in ns)
    cfg = config or default_decode_config(m, n_total, k, a_data.device)
    num_kb = _cdiv(k, BLOCK)
    split = max(1, min(cfg.split_k, num_kb))
    kb_per_split = _cdiv(num_kb, split)
    split = _cdiv(num_kb, kb_per_split)  # no empty split
    block_m = max(16, 1 << (m - 1).bit_length())
    if split > 1:
        if tiles > _LOCK_SLOTS:
            raise ValueError(f"fp8_decode_gemm: {tiles} column tiles exceed the {_LOCK_SLOTS} counters")
        ws = torch.empty(tiles * split * cfg.block_n * block_m, dtype=torch.float32, device=a_data.device)
        locks = _locks(a_data.device)
    else:
        ws = locks = out  # unused
    groups = []
    for i in range(3):
        w, sc, bias = weights[i] if i < len(weights) else weights[0]
        groups += [w, sc, bias if has_bias else out, ns[i] if i < len(weights) else 0]
    _fp8_decode_gemm_kernel[(tiles, split)](
        a_data, out, a_scale, ws, locks, *groups, m, k,
        a_data.stride(0), a_data.stride(1), b0.stride(0), b0.stride(1), out.stride(0), out.stride(1),
        a_scale.stride(0), a_scale.stride(1), bs0.stride(0), bs0.stride(1),
        NUM_KB=num_kb, KB_PER_SPLIT=kb_per_split, SPLIT_K=split, B_SCALE_ROWS=b_scale_rows,
        NUM_GROUPS=len(weights), HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
