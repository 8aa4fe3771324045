"""Split-K FP8 GEMM for decode-sized inputs (M <= 256 rows against a 128x128-block weight).

At decode sizes the GEMM is bound by the weight's bytes: the kernel streams the weight once, split along K
over enough programs to keep every SM busy, and reduces the partials deterministically in the kernel.
Operands and scales are laid out as for :func:`jetrl.quant.kernels.gemm_triton.blockwise_fp8_gemm`.

**Programmatic dependent launch.** On a Hopper or later GPU the kernel is launched as a programmatic dependent of
the kernel before it (``tuning.decode_gemm_pdl``, :func:`~jetrl.quant.kernels.tuning.early_dependents`), and so are
the kernels around it in a decode step (the activation quantizer, RoPE, and the fused norm and SwiGLU where they
quantize for an FP8 GEMM: :func:`~jetrl.quant.kernels.tuning.pdl_args`): each one's first
instruction waits (``griddepcontrol.wait``) until the kernel before it has finished and its writes are visible,
then lets its own dependents launch (RoPE only waits), so the next kernel's programs are placed and set up while it
runs. Nothing is read or written before the wait, so the result is the same bits.

The launch is a :class:`~jetrl.quant.kernels.tuning.DecodeGemmConfig`: by default from the tuning object's per-M
policies and per-shape configs, which ``bench/kernels.py --sections decode-sweep`` measures.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from jetrl.quant.kernels import tuning
from jetrl.quant.kernels.decode_splits import sm_count
from jetrl.quant.kernels.quantize_triton import BLOCK, _cdiv, cast_rne
from jetrl.quant.kernels.tuning import COMPILE_OPTIONS, DECODE_GEMM_MAX_M, DecodeGemmConfig


@triton.jit  # M stays specialized: the rollout replays it at the CUDA graphs' sizes, multiples of 16 from 16 on
def _fp8_decode_gemm_kernel(
    a_ptr, c_ptr, as_ptr, ws_ptr, lock_ptr,
    b0_ptr, bs0_ptr, bias0_ptr, N0, b1_ptr, bs1_ptr, bias1_ptr, N1, b2_ptr, bs2_ptr, bias2_ptr, N2,
    M, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    KB_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, B_SCALE_ROWS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    M_TILES: tl.constexpr, K_UNROLL: tl.constexpr, USE_TMA: tl.constexpr,
    PDL: tl.constexpr,
):
    """C = A @ B^T for a small M (decode): weight-bandwidth bound, so the kernel is built around streaming B.

    "Swap AB": each program computes the transposed tile ``C^T[n-tile, m-tile] = B[n-tile, k-range] @
    A[m-tile, k-range]^T``, so the weight rows form the MMA's large dimension and the few tokens its small
    one. One row tile (``M_TILES == 1``) normally covers all of M; the row tiles of one column tile are
    neighbours in the grid, so they read the same weight block at about the same time (once from HBM).
    The K range is split over ``SPLIT_K`` programs per output tile so that enough programs stream the
    weight at once; each writes an fp32 partial, and the last of them to finish (an atomic counter per
    output tile) sums all partials in split order: deterministic, and independent of which finished last.

    Up to three weights (``NUM_GROUPS``) that share the input A (q/k/v, gate/up) run in one launch: their
    column tiles follow one another and their outputs lie side by side in C. With ``HAS_BIAS`` the BF16
    result gets the bias added after rounding, as ``F.linear``-style ``y + bias`` would. With ``USE_TMA``
    the ``b*_ptr`` and ``a_ptr`` arguments are tensor descriptors (TMA loads, zero-filled out of bounds).
    ``PDL``: launched as a programmatic dependent (module doc).
    """
    if PDL:
        gdc_wait()  # the kernel before has finished: its writes (A, A's scales) are visible from here on
        gdc_launch_dependents()  # the kernel after (a norm, SwiGLU, RoPE) may launch now: it waits for this one
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = pid // M_TILES
    pid_m = pid % M_TILES
    b_ptr = b0_ptr
    bs_ptr = bs0_ptr
    bias_ptr = bias0_ptr
    N = N0
    tile_n = pid_n
    col0 = 0
    group = 0
    if NUM_GROUPS > 1:
        t0 = tl.cdiv(N0, BLOCK_N)
        if pid_n >= t0:
            if not USE_TMA:  # descriptors are chosen below, by branch (never merged as values)
                b_ptr = b1_ptr
            bs_ptr = bs1_ptr
            bias_ptr = bias1_ptr
            N = N1
            tile_n = pid_n - t0
            col0 = N0
            group = 1
        if NUM_GROUPS > 2:
            t1 = t0 + tl.cdiv(N1, BLOCK_N)
            if pid_n >= t1:
                if not USE_TMA:
                    b_ptr = b2_ptr
                bs_ptr = bs2_ptr
                bias_ptr = bias2_ptr
                N = N2
                tile_n = pid_n - t1
                col0 = N0 + N1
                group = 2
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    m0 = pid_m * BLOCK_M  # first token and first (group-local) weight row of this tile: TMA block origins
    row0 = tile_n * BLOCK_N
    kb0 = pid_k * KB_PER_SPLIT
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if not USE_TMA or NUM_GROUPS == 1:  # b_ptr: the group's pointer, or the one descriptor
        acc = _decode_k_loop(acc, a_ptr, b_ptr, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, m0, row0, kb0, K,
                             stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn,
                             stride_bsk, KB_PER_SPLIT, K_UNROLL, B_SCALE_ROWS, USE_TMA, BLOCK_M, BLOCK_N)
    else:  # one branch per descriptor: each loop reads one fixed descriptor
        if group == 0:
            acc = _decode_k_loop(acc, a_ptr, b0_ptr, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, m0, row0, kb0, K,
                                 stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn,
                                 stride_bsk, KB_PER_SPLIT, K_UNROLL, B_SCALE_ROWS, USE_TMA, BLOCK_M, BLOCK_N)
        elif group == 1:
            acc = _decode_k_loop(acc, a_ptr, b1_ptr, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, m0, row0, kb0, K,
                                 stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn,
                                 stride_bsk, KB_PER_SPLIT, K_UNROLL, B_SCALE_ROWS, USE_TMA, BLOCK_M, BLOCK_N)
        else:
            acc = _decode_k_loop(acc, a_ptr, b2_ptr, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, m0, row0, kb0, K,
                                 stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn,
                                 stride_bsk, KB_PER_SPLIT, K_UNROLL, B_SCALE_ROWS, USE_TMA, BLOCK_M, BLOCK_N)
    c_ptrs = c_ptr + rm[None, :].to(tl.int64) * stride_cm + (col0 + rn)[:, None] * stride_cn
    c_mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K == 1:
        _store_decode_tile(c_ptrs, acc, c_mask, bias_ptr, rn, n_ok, HAS_BIAS)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # (BLOCK_N, BLOCK_M)
        ws_tile = ws_ptr + pid.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
        tl.store(ws_tile + pid_k * (BLOCK_N * BLOCK_M) + tile, acc)
        done = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel")  # orders the store above before the count
        if done == SPLIT_K - 1:  # the last split of this output tile: sum the partials in split order
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(0, SPLIT_K):
                total += tl.load(ws_tile + s * (BLOCK_N * BLOCK_M) + tile, cache_modifier=".cg")
            _store_decode_tile(c_ptrs, total, c_mask, bias_ptr, rn, n_ok, HAS_BIAS)
            tl.atomic_xchg(lock_ptr + pid, 0)  # ready for the next call (and the next graph replay)


@triton.jit
def _decode_k_loop(acc, a_ptr, b_ptr, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, m0, row0, kb0, K,
                   stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn, stride_bsk,
                   KB_PER_SPLIT: tl.constexpr, K_UNROLL: tl.constexpr, B_SCALE_ROWS: tl.constexpr,
                   USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``acc += sum over this split's 128-wide K blocks of (B_blk @ A_blk^T) * (scale_b x scale_a)``, in K
    order, ``K_UNROLL`` blocks per loop iteration (the same sums in the same order for every unroll)."""
    rk = tl.arange(0, 128)
    a_ptrs = a_ptr
    b_ptrs = b_ptr
    if not USE_TMA:
        a_ptrs = a_ptr + rm[None, :].to(tl.int64) * stride_am + (kb0 * 128 + rk)[:, None] * stride_ak  # (128, BM)
        b_ptrs = b_ptr + rn[:, None].to(tl.int64) * stride_bn + (kb0 * 128 + rk)[None, :] * stride_bk  # (BN, 128)
    as_ptrs = as_ptr + rm * stride_asm + kb0 * stride_ask
    bs_ptrs = bs_ptr + (rn // B_SCALE_ROWS) * stride_bsn + kb0 * stride_bsk
    for i in range(0, KB_PER_SPLIT // K_UNROLL):
        for j in tl.static_range(K_UNROLL):
            kb = kb0 + i * K_UNROLL + j
            k_rem = K - kb * 128
            if USE_TMA:
                b = b_ptr.load([row0, kb * 128])  # (BLOCK_N, 128)
                a = tl.trans(a_ptr.load([m0, kb * 128]))  # (128, BLOCK_M)
            else:
                k_ok = rk < k_rem
                b = tl.load(b_ptrs + j * 128 * stride_bk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                a = tl.load(a_ptrs + j * 128 * stride_ak, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            # (block tensors in the masks: a scalar mask term trips some interpreters)
            sb = tl.load(bs_ptrs + j * stride_bsk, mask=n_ok & (rn * 0 + k_rem > 0), other=0.0)
            sa = tl.load(as_ptrs + j * stride_ask, mask=m_ok & (rm * 0 + k_rem > 0), other=0.0)
            acc += tl.dot(b, a) * (sb[:, None] * sa[None, :])
        if not USE_TMA:
            a_ptrs += K_UNROLL * 128 * stride_ak
            b_ptrs += K_UNROLL * 128 * stride_bk
        as_ptrs += K_UNROLL * stride_ask
        bs_ptrs += K_UNROLL * stride_bsk
    return acc


@triton.jit
def _store_decode_tile(c_ptrs, acc, c_mask, bias_ptr, rn, n_ok, HAS_BIAS: tl.constexpr):
    c = cast_rne(acc, c_ptrs.dtype.element_ty)
    if HAS_BIAS:  # round the product first, then add: the unfused ``gemm(...) + bias``
        bias = tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        c = cast_rne(c.to(tl.float32) + bias[:, None], c_ptrs.dtype.element_ty)
    tl.store(c_ptrs, c, mask=c_mask)


def split_blocks(num_kb: int, split_k: int, k_unroll: int) -> tuple[int, int]:
    """(128-wide K blocks per split, splits) of a K of ``num_kb`` blocks asked to split ``split_k`` ways: every split
    whole loop trips of ``k_unroll`` blocks (the last one the rest), none empty."""
    split = max(1, min(split_k, num_kb))
    kb_per_split = _cdiv(_cdiv(num_kb, split), k_unroll) * k_unroll
    return kb_per_split, _cdiv(num_kb, kb_per_split)


_LOCKS: dict[tuple[str, int | None], torch.Tensor] = {}
_LOCK_SLOTS = 1 << 14


def _sm_count(device: torch.device) -> int:
    """The SMs the default configs aim at: the GPU's, an H200's 132 off the GPU (the interpreter)."""
    return sm_count(device) if device.type == "cuda" else 132


def default_decode_config(m: int, n: int, k: int, device: torch.device, grouped: bool = False) -> DecodeGemmConfig:
    """The default config for an (m, n, k) decode GEMM (``n``: total width of a grouped launch, ``grouped``:
    whether it is one) on ``device``, from the tuning object (:meth:`KernelTuning.decode_config`)."""
    return tuning.current().decode_config(m, n, k, _sm_count(device), grouped)


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
    must not run concurrently on different streams (they share the per-tile counters).
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


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a row-major 2-D tile source: unit column stride, 16-byte aligned rows and base."""
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 \
        and t.data_ptr() % 16 == 0 and t.shape[0] > 0 and t.shape[1] > 0


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
    cfg = config or default_decode_config(m, n_total, k, a_data.device, grouped=len(weights) > 1)
    block_m = max(16, 1 << (m - 1).bit_length())
    m_tiles = 1
    if 0 < cfg.block_m < m:
        block_m, m_tiles = cfg.block_m, _cdiv(m, cfg.block_m)
    tiles = sum(_cdiv(n, cfg.block_n) for n in ns) * m_tiles
    kb_per_split, split = split_blocks(_cdiv(k, BLOCK), cfg.split_k, cfg.k_unroll)
    if split > 1:
        if tiles > _LOCK_SLOTS:
            raise ValueError(f"fp8_decode_gemm: {tiles} output tiles exceed the {_LOCK_SLOTS} counters")
        ws = torch.empty(tiles * split * cfg.block_n * block_m, dtype=torch.float32, device=a_data.device)
        locks = _locks(a_data.device)
    else:
        ws = locks = out  # unused
    use_tma = cfg.tma and _tma_ok(a_data) and all(_tma_ok(w) for w, _, _ in weights)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
    a_arg = TensorDescriptor.from_tensor(a_data, [block_m, 128]) if use_tma else a_data
    w_args = [TensorDescriptor.from_tensor(w, [cfg.block_n, 128]) if use_tma else w for w, _, _ in weights]
    groups = []
    for i in range(3):  # absent groups repeat the first (never read: their width is 0)
        j = i if i < len(weights) else 0
        _, sc, bias = weights[j]
        groups += [w_args[j], sc, bias if has_bias else out, ns[i] if i < len(weights) else 0]
    _fp8_decode_gemm_kernel[(tiles, split)](
        a_arg, out, a_scale, ws, locks, *groups, m, k, *a_data.stride(), *b0.stride(), *out.stride(), *a_scale.stride(),
        *bs0.stride(), KB_PER_SPLIT=kb_per_split, SPLIT_K=split, B_SCALE_ROWS=b_scale_rows, NUM_GROUPS=len(weights),
        HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=cfg.block_n, M_TILES=m_tiles, K_UNROLL=cfg.k_unroll,
        USE_TMA=use_tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **COMPILE_OPTIONS,
        **tuning.pdl_args(a_data.device))
    return out
