"""Split-K FP8 GEMM for decode-sized inputs (M <= 256 rows against a 128x128-block weight).

At decode sizes the GEMM is bound by the weight's bytes: the kernel streams the weight once, split along K
over enough programs to keep every SM busy, and reduces the partials deterministically in the kernel.
Operands and scales are laid out as for :func:`jetrl.quant.triton_kernels.blockwise_fp8_gemm`.
Imported lazily by the CUDA backend, like every Triton module of jetrl.

Tuning knobs (:class:`DecodeGemmConfig`): weight rows per program, K splits, warps, pipeline stages, K blocks
per loop iteration, TMA (tensor-descriptor) loads, and row tiles for M > 64. :data:`DECODE_POLICIES` turns
them into the default config per row count, :data:`DECODE_SHAPE_CONFIGS` overrides it for measured shapes;
``bench/kernels.py --sections decode-sweep`` measures them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

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
    KB_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, B_SCALE_ROWS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    M_TILES: tl.constexpr, K_UNROLL: tl.constexpr, USE_TMA: tl.constexpr,
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
    """
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
    if not USE_TMA:
        acc = _decode_k_loop(acc, a_ptr, b_ptr, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, m0, row0, kb0, K,
                             stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn,
                             stride_bsk, KB_PER_SPLIT, K_UNROLL, B_SCALE_ROWS, USE_TMA, BLOCK_M, BLOCK_N)
    elif NUM_GROUPS == 1:
        acc = _decode_k_loop(acc, a_ptr, b0_ptr, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, m0, row0, kb0, K,
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


@dataclass(frozen=True)
class DecodeGemmConfig:
    """Tiles of the split-K decode GEMM.

    ``block_n`` weight rows per program (16-256, a power of two); the K range split in ``split_k`` parts
    (rounded so that every split holds whole loop iterations; none is empty); ``k_unroll`` 128-wide K blocks
    (scale blocks) per loop iteration (1, 2 or 4: 2 loads 256 K at once); ``tma`` loads weight and input tiles
    through TMA descriptors where the layouts allow it (K a multiple of 16, rows contiguous, 16-byte aligned;
    pointer loads otherwise); ``block_m`` tokens per row tile (0: one tile covers M, the next power of two of
    at least 16; smaller tiles give M > 64 more programs, each re-reading its weight block from L2).
    """

    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 0
    k_unroll: int = 1
    tma: bool = False

    def __post_init__(self) -> None:
        pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
        if not (pow2(self.block_n) and 16 <= self.block_n <= 256):
            raise ValueError(f"DecodeGemmConfig.block_n must be a power of two in 16..256, got {self.block_n}")
        if self.block_m and not (pow2(self.block_m) and 16 <= self.block_m <= DECODE_GEMM_MAX_M):
            raise ValueError(f"DecodeGemmConfig.block_m must be 0 or a power of two in 16..256, got {self.block_m}")
        if self.k_unroll not in (1, 2, 4):
            raise ValueError(f"DecodeGemmConfig.k_unroll must be 1, 2 or 4, got {self.k_unroll}")
        if self.split_k < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"DecodeGemmConfig: split_k >= 1, num_warps in 1..16 (a power of two) and "
                             f"num_stages >= 1 needed, got {self}")

    @property
    def name(self) -> str:
        """Short label, e.g. ``n64k4s3w4`` (+ ``m128`` row tiles, ``u2`` unroll, ``tma``)."""
        tag = f"n{self.block_n}k{self.split_k}s{self.num_stages}w{self.num_warps}"
        return (tag + (f"m{self.block_m}" if self.block_m else "") + (f"u{self.k_unroll}" if self.k_unroll > 1 else "")
                + ("tma" if self.tma else ""))


DECODE_GEMM_MAX_M = 256  # one kernel launch handles up to this many rows; the backend decides which M come here


@dataclass(frozen=True)
class DecodePolicy:
    """How the default :class:`DecodeGemmConfig` is derived for row counts up to ``max_m``.

    The K split is the power of two that brings the program count nearest ``programs_per_sm`` per SM from
    below (``round_up=False``) or above (``round_up=True``), at most ``max_split`` and at least
    ``min_kb_per_split`` 128-wide K blocks per split; the other fields are copied into the config.
    """

    max_m: int
    programs_per_sm: float = 1.5
    round_up: bool = True
    max_split: int = 16
    min_kb_per_split: int = 4
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 0
    k_unroll: int = 1
    tma: bool = False

    def config(self, m: int, n: int, k: int, sm_count: int) -> DecodeGemmConfig:
        """The config for an (m, n, k) GEMM (n: total width of a grouped launch) on ``sm_count`` SMs."""
        tiles = _cdiv(n, self.block_n) * (_cdiv(m, self.block_m) if 0 < self.block_m < m else 1)
        programs = int(self.programs_per_sm * sm_count)
        if self.round_up:
            split = 1 << (max(1, -(-programs // tiles)) - 1).bit_length()
        else:
            split = 1 << max(0, (programs // tiles).bit_length() - 1)
        split = max(1, min(split, self.max_split, max(1, _cdiv(k, BLOCK) // self.min_kb_per_split)))
        return DecodeGemmConfig(block_n=self.block_n, split_k=split, num_warps=self.num_warps,
                                num_stages=self.num_stages, block_m=self.block_m, k_unroll=self.k_unroll,
                                tma=self.tma)

    def literal(self) -> str:
        """Python source of this policy, differences from the defaults only (to paste into DECODE_POLICIES)."""
        default = DecodePolicy(max_m=self.max_m)
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if f.name == "max_m" or getattr(self, f.name) != getattr(default, f.name)]
        return f"DecodePolicy({', '.join(parts)})"


# Default configs by row count, first match wins, from the decode sweep on the H200 at Llama-8B shapes
# (BENCHMARKS.md, "Decode GEMM sweep"): M <= 32 about three programs per SM, M <= 64 about 1.5 (more MMA
# work per weight byte); M <= 128 about one program per SM, rounded down, 8 warps; M <= 256 128 x 128 tiles
# of weight rows x tokens with TMA loads. (TMA and K unrolling won single shapes at M <= 64, not the set.)
DECODE_POLICIES: tuple[DecodePolicy, ...] = (
    DecodePolicy(max_m=32, programs_per_sm=3.0),
    DecodePolicy(max_m=64, programs_per_sm=1.5),
    DecodePolicy(max_m=128, programs_per_sm=1.0, round_up=False, num_warps=8),
    DecodePolicy(max_m=DECODE_GEMM_MAX_M, programs_per_sm=1.0, round_up=False, block_n=128, num_warps=8,
                 block_m=128, tma=True),
)
_LOCKS: dict[tuple[str, int | None], torch.Tensor] = {}
_LOCK_SLOTS = 1 << 14


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_policy(m: int) -> DecodePolicy:
    """The :data:`DECODE_POLICIES` entry for ``m`` rows."""
    for policy in DECODE_POLICIES:
        if m <= policy.max_m:
            return policy
    raise ValueError(f"no decode policy for {m} rows (the decode GEMM handles at most {DECODE_GEMM_MAX_M})")


# Shapes whose best config in the decode sweep beat the per-M policy by more than 3%: (largest M, total N, K,
# grouped launch) -> config. Bucket "32" covers M = 1-32 (the same config won at 16 and 32), "64" M = 33-64,
# "128" M = 65-128, "256" M = 129-256. Llama-8B linears: run G (M = 16, 32, 64); the rollout benchmark's 1.5B
# model (Qwen2-1.5B: hidden 1536, MLP 8960, q/k/v 1536 + 256 + 256): `bench/kernels.py --sections decode-sweep
# --sweep-shape 1.5b` (M = 32, 64, 128, 256), both on the H200.
DECODE_SHAPE_CONFIGS: dict[tuple[int, int, int, bool], DecodeGemmConfig] = {
    (32, 6144, 4096, True): DecodeGemmConfig(block_n=64, split_k=4, tma=True),  # q/k/v: 10.9 vs 12.4 us
    (32, 6144, 4096, False): DecodeGemmConfig(block_n=64, split_k=4, tma=True),
    (32, 4096, 4096, False): DecodeGemmConfig(block_n=64, split_k=4, tma=True),  # o: 9.3 vs 9.9 us
    (32, 28672, 4096, False): DecodeGemmConfig(block_n=64, split_k=1, num_stages=4, tma=True),
    (32, 4096, 14336, False): DecodeGemmConfig(block_n=64, split_k=8, num_stages=4, tma=True),  # 20.5 vs 22.1
    (64, 28672, 4096, False): DecodeGemmConfig(block_n=64, split_k=1, tma=True),  # gate_up: 36.2 vs 38.5 us
    (64, 4096, 14336, False): DecodeGemmConfig(block_n=64, split_k=4, k_unroll=2, tma=True),  # 26.1 vs 28.3
    # 1.5B shape
    (32, 1536, 1536, False): DecodeGemmConfig(block_n=64, split_k=3, num_stages=4, tma=True),  # o: 5.4 vs 6.1
    (32, 1536, 8960, False): DecodeGemmConfig(block_n=64, split_k=16, num_warps=8, tma=True),  # down: 10.1 vs 11.2
    (128, 1536, 8960, False): DecodeGemmConfig(block_n=64, split_k=4, num_warps=8, k_unroll=2, tma=True),  # 14.3/17.6
    (256, 1536, 8960, False): DecodeGemmConfig(block_n=128, split_k=4, num_warps=8, block_m=128, k_unroll=2,
                                               tma=True),  # down: 21.4 vs 22.9 us
    (32, 2048, 1536, True): DecodeGemmConfig(block_n=64, split_k=3, k_unroll=2),  # q/k/v: 5.7 vs 6.3 us
    (128, 2048, 1536, True): DecodeGemmConfig(block_n=64, split_k=2, block_m=64, tma=True),  # 7.5 vs 9.6 us
    (256, 2048, 1536, True): DecodeGemmConfig(block_n=128, split_k=2, block_m=64, tma=True),  # 9.4 vs 11.4 us
    (32, 17920, 1536, True): DecodeGemmConfig(block_n=64, split_k=1, tma=True),  # gate/up: 10.9 vs 13.5 us
}


def default_decode_config(m: int, n: int, k: int, device: torch.device, grouped: bool = False) -> DecodeGemmConfig:
    """The default config for an (m, n, k) decode GEMM (``n``: total width of a grouped launch, ``grouped``:
    whether it is one): the measured per-shape entry of :data:`DECODE_SHAPE_CONFIGS` where there is one,
    else the per-M policy of :data:`DECODE_POLICIES`."""
    bucket = 32 if m <= 32 else 64 if m <= 64 else 128 if m <= 128 else 256
    tuned = DECODE_SHAPE_CONFIGS.get((bucket, n, k, bool(grouped)))
    if tuned is not None:
        return tuned
    return decode_policy(m).config(m, n, k, _sm_count(device))


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
    num_kb = _cdiv(k, BLOCK)
    split = max(1, min(cfg.split_k, num_kb))
    kb_per_split = _cdiv(_cdiv(num_kb, split), cfg.k_unroll) * cfg.k_unroll  # whole loop iterations per split
    split = _cdiv(num_kb, kb_per_split)  # no empty split
    if split > 1:
        if tiles > _LOCK_SLOTS:
            raise ValueError(f"fp8_decode_gemm: {tiles} output tiles exceed the {_LOCK_SLOTS} counters")
        ws = torch.empty(tiles * split * cfg.block_n * block_m, dtype=torch.float32, device=a_data.device)
        locks = _locks(a_data.device)
    else:
        ws = locks = out  # unused
    use_tma = cfg.tma and _tma_ok(a_data) and all(_tma_ok(w) for w, _, _ in weights)
    a_arg = a_data
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_arg = TensorDescriptor.from_tensor(a_data, [block_m, 128])
    w_args = [TensorDescriptor.from_tensor(w, [cfg.block_n, 128]) if use_tma else w for w, _, _ in weights]
    groups = []
    for i in range(3):  # absent groups repeat the first (never read: their width is 0)
        j = i if i < len(weights) else 0
        _, sc, bias = weights[j]
        groups += [w_args[j], sc, bias if has_bias else out, ns[i] if i < len(weights) else 0]
    _fp8_decode_gemm_kernel[(tiles, split)](
        a_arg, out, a_scale, ws, locks, *groups, m, k,
        a_data.stride(0), a_data.stride(1), b0.stride(0), b0.stride(1), out.stride(0), out.stride(1),
        a_scale.stride(0), a_scale.stride(1), bs0.stride(0), bs0.stride(1),
        KB_PER_SPLIT=kb_per_split, SPLIT_K=split, B_SCALE_ROWS=b_scale_rows,
        NUM_GROUPS=len(weights), HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        M_TILES=m_tiles, K_UNROLL=cfg.k_unroll, USE_TMA=use_tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
