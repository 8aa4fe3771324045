"""Every setting of the kernels in one frozen object, :class:`KernelTuning`, made of four families, each a small
frozen dataclass whose fields declare a one-line meaning and a rule: which path each GEMM runs
(:class:`GemmRouting`, with the decode GEMM's configs), the quantizers and FP8 weights (:class:`Quantizers`), exact
mode's K split and schedules (:class:`ExactSchedule`) and the FP8-cache decode attention's launch
(:class:`DecodeAttention`).

Nothing here changes a result's bits except the GEMM path (``gemm``, the routing bounds and the decode GEMM's
configs, whose K split sets a summation order: they pick between GEMMs that agree to output rounding), exact mode's
K split (``exact_split_k``: a different split is a different summation order, the same for every M) and the fast
decode attention over an FP8 cache (``kv_decode_factored``, ``kv_decode_streams`` and the tile and split fields of
both kernels: summation order, within the bounds of each kernel's doc; exact mode's attention never reads them).
The Gluon/Triton choice of the 128x1 kernels and exact mode's schedules give the same bytes. The measured reasons
for the defaults are in BENCHMARKS.md and docs/benchmark-history.md; this file keeps the values only.

The launch parameters of one kernel that no run sets (tiles, warps, stages) are not settings: they are constants
beside their kernel, and its launcher takes others as keyword arguments (the tests check that other values give the
same bits, ``bench/kernels.py`` times them). Exact mode's K-split heuristic and the N tiles it counts are constants
too, but here (:class:`ExactSplitRule`).

:func:`current` is what the kernels and the CUDA backend read at every launch; :func:`override` replaces fields
for a block of code (tests and benchmarks use it)::

    with tuning.override(gemm="triton", exact_split_k=1):
        ...

A run sets fields from its config (``kernels: ["exact_split_k=1", ...]``, read by :func:`parse_settings`, the one
reader of ``KEY=VALUE`` settings, which the benchmarks' ``--tuning`` and arms use too) for the whole run.

``JETRL_FP8_GEMM`` (``auto`` | ``cublas`` | ``deepgemm`` | ``triton`` | ``decode``) is read once, when this module is
imported, into the default object's ``gemm``. This module imports neither Triton nor DeepGEMM nor any other module of
jetrl besides :mod:`jetrl.quant.formats` and :mod:`~jetrl.quant.kernels.deepgemm_builds`, so the CPU tests and the
benchmarks' ``--help`` read it without a GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

from jetrl.quant.formats import BLOCK_SIZE
from jetrl.quant.kernels import deepgemm_builds

if TYPE_CHECKING:
    import torch

GEMM_CHOICES = ("auto", "cublas", "deepgemm", "triton", "decode")
# the Gluon decode kernel's ring slot per warp: a 16-token tile's K and V rows (16 x 128 bytes each) and their fp32
# scales; the ring's bound leaves an H200 SM's 227 KiB of shared memory room for the kernel's other buffers
STREAM_SLOT_BYTES = 2 * 16 * 128 + 2 * 16 * 4
STREAM_RING_MAX_BYTES = 192 * 1024
DECODE_GEMM_MAX_M = 256  # one decode-GEMM launch handles up to this many rows (the routing bounds pick which M go)


# Compile options of the kernel launches. Floating-point contraction (``a * b + c`` as one fma) is part of a
# kernel's arithmetic: the bitwise contracts (the quantization kernels against the CPU reference, exact mode's
# GEMMs against cuBLAS and against each other, its decode kernels against its tile kernels) were established with
# it on. Triton's default for it is read from TRITON_DEFAULT_FP_FUSION and is announced to change, so every launch
# states it: these options, or ``enable_fp_fusion=False`` where a kernel matches a reference without fma (SwiGLU,
# RoPE, the bias add).
COMPILE_OPTIONS = MappingProxyType({"enable_fp_fusion": True})


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pow2(v: int) -> bool:
    return _int(v) and v > 0 and v & (v - 1) == 0


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
        if not (_pow2(self.block_n) and 16 <= self.block_n <= 256):
            raise ValueError(f"DecodeGemmConfig.block_n must be a power of two in 16..256, got {self.block_n}")
        if self.block_m and not (_pow2(self.block_m) and 16 <= self.block_m <= DECODE_GEMM_MAX_M):
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


@dataclass(frozen=True, kw_only=True)
class DecodePolicy(DecodeGemmConfig):
    """How the default :class:`DecodeGemmConfig` is derived for row counts up to ``max_m``: the config's own fields
    are its tiles (``split_k`` aside), and the K split is the power of two that brings the program count nearest
    ``programs_per_sm`` per SM from below (``round_up=False``) or above (``round_up=True``), at most ``max_split``
    and at least ``min_kb_per_split`` 128-wide K blocks per split.
    """

    max_m: int
    programs_per_sm: float = 1.5
    round_up: bool = True
    max_split: int = 16
    min_kb_per_split: int = 4

    def config(self, m: int, n: int, k: int, sm_count: int) -> DecodeGemmConfig:
        """The config for an (m, n, k) GEMM (n: total width of a grouped launch) on ``sm_count`` SMs."""
        tiles = -(-n // self.block_n) * (-(-m // self.block_m) if 0 < self.block_m < m else 1)
        programs = int(self.programs_per_sm * sm_count)
        if self.round_up:
            split = 1 << (max(1, -(-programs // tiles)) - 1).bit_length()
        else:
            split = 1 << max(0, (programs // tiles).bit_length() - 1)
        split = max(1, min(split, self.max_split, max(1, -(-k // BLOCK_SIZE) // self.min_kb_per_split)))
        tiles = {f.name: getattr(self, f.name) for f in fields(DecodeGemmConfig)}
        return DecodeGemmConfig(**tiles | {"split_k": split})


# The decode GEMM's default config per row count (first match wins): M <= 32 about three programs per SM,
# M <= 64 about 1.5 (more MMA work per weight byte); M <= 128 about one program per SM, rounded down, 8 warps;
# M <= 256 128 x 128 tiles of weight rows x tokens with TMA loads.
DECODE_POLICIES: tuple[DecodePolicy, ...] = (
    DecodePolicy(max_m=32, programs_per_sm=3.0),
    DecodePolicy(max_m=64, programs_per_sm=1.5),
    DecodePolicy(max_m=128, programs_per_sm=1.0, round_up=False, num_warps=8),
    DecodePolicy(max_m=DECODE_GEMM_MAX_M, programs_per_sm=1.0, round_up=False, block_n=128, num_warps=8,
                 block_m=128, tma=True),
)

# Shapes whose best config in the decode sweep beat the per-M policy: (largest M of the bucket, total N, K,
# grouped launch) -> config. Buckets: 32 covers M = 1-32, 64 M = 33-64, 128 M = 65-128, 256 M = 129-256.
# Llama-8B linears (hidden 4096, MLP 14336, q/k/v 4096 + 1024 + 1024), the rollout benchmark's 1.5B model
# (Qwen2-1.5B: hidden 1536, MLP 8960, q/k/v 1536 + 256 + 256) and Qwen2.5-0.5B (hidden 896, MLP 4864, q/k/v
# 896 + 128 + 128); `bench/kernels.py --sections decode-sweep --sweep-shape 8b | 1.5b | 0.5b`.
DECODE_SHAPE_CONFIGS: Mapping[tuple[int, int, int, bool], DecodeGemmConfig] = MappingProxyType({
    # Llama-8B: q/k/v (grouped and not), o, gate_up, down
    (32, 6144, 4096, True): DecodeGemmConfig(block_n=64, split_k=4, tma=True),
    (32, 6144, 4096, False): DecodeGemmConfig(block_n=64, split_k=4, tma=True),
    (32, 4096, 4096, False): DecodeGemmConfig(block_n=64, split_k=4, tma=True),
    (32, 28672, 4096, False): DecodeGemmConfig(block_n=64, split_k=1, num_stages=4, tma=True),
    (32, 4096, 14336, False): DecodeGemmConfig(block_n=64, split_k=8, num_stages=4, tma=True),
    (64, 28672, 4096, False): DecodeGemmConfig(block_n=64, split_k=1, tma=True),
    (64, 4096, 14336, False): DecodeGemmConfig(block_n=64, split_k=4, k_unroll=2, tma=True),
    # Qwen2-1.5B: o, down, grouped q/k/v, grouped gate/up
    (32, 1536, 1536, False): DecodeGemmConfig(block_n=64, split_k=3, num_stages=4, tma=True),
    (32, 1536, 8960, False): DecodeGemmConfig(block_n=64, split_k=16, num_warps=8, tma=True),
    (128, 1536, 8960, False): DecodeGemmConfig(block_n=64, split_k=4, num_warps=8, k_unroll=2, tma=True),
    (256, 1536, 8960, False): DecodeGemmConfig(block_n=128, split_k=4, num_warps=8, block_m=128, k_unroll=2,
                                               tma=True),
    (32, 2048, 1536, True): DecodeGemmConfig(block_n=64, split_k=3, k_unroll=2),
    (128, 2048, 1536, True): DecodeGemmConfig(block_n=64, split_k=2, block_m=64, tma=True),
    (256, 2048, 1536, True): DecodeGemmConfig(block_n=128, split_k=2, block_m=64, tma=True),
    (32, 17920, 1536, True): DecodeGemmConfig(block_n=64, split_k=1, tma=True),
    # Qwen2.5-0.5B: o, down, grouped q/k/v, grouped gate/up
    (32, 896, 896, False): DecodeGemmConfig(block_n=64, split_k=1, k_unroll=2, tma=True),
    (64, 896, 896, False): DecodeGemmConfig(block_n=64, split_k=1, num_stages=4, tma=True),
    (128, 896, 896, False): DecodeGemmConfig(block_n=64, split_k=1, block_m=64, tma=True),
    (256, 896, 896, False): DecodeGemmConfig(block_n=128, split_k=1, block_m=64, tma=True),
    (32, 896, 4864, False): DecodeGemmConfig(block_n=64, split_k=9, num_stages=4, tma=True),
    (128, 896, 4864, False): DecodeGemmConfig(block_n=64, split_k=4, block_m=64, tma=True),
    (256, 896, 4864, False): DecodeGemmConfig(block_n=128, split_k=4, block_m=64, tma=True),
    (32, 1152, 896, True): DecodeGemmConfig(block_n=64, split_k=1, num_stages=4, tma=True),
    (64, 1152, 896, True): DecodeGemmConfig(block_n=64, split_k=1, k_unroll=2, tma=True),
    (128, 1152, 896, True): DecodeGemmConfig(block_n=64, split_k=1, block_m=64, tma=True),
    (256, 1152, 896, True): DecodeGemmConfig(block_n=128, split_k=1, block_m=64, tma=True),
    (32, 9728, 896, True): DecodeGemmConfig(block_n=64, split_k=1, num_stages=4, tma=True),
})

# Where the decode GEMM beats cuBLAS beyond the general bounds: {(N, K): max M} for single GEMMs and
# {("grouped", sum of N, K): max M} for grouped launches (Llama-8B's q/k/v; the 1.5B model's down and q/k/v;
# Qwen2.5-0.5B's o, down and q/k/v, whose narrow weights leave cuBLAS's blockwise GEMM at its fixed latency).
DECODE_MAX_M_BY_SHAPE: Mapping[tuple, int] = MappingProxyType({
    ("grouped", 6144, 4096): 256, (1536, 8960): 256, ("grouped", 2048, 1536): 256,
    (896, 896): 256, (896, 4864): 256, ("grouped", 1152, 896): 256,
})


@dataclass(frozen=True)
class ExactSplitRule:
    """Exact mode's K-split heuristic (:meth:`KernelTuning.exact_split` where ``exact_split_k`` is 0) and the N
    tiles of exact mode's GEMM (:mod:`~jetrl.quant.kernels.gemm_exact_triton`), whose count it reads.

    Constants, not settings: the split is part of exact mode's arithmetic, so the rollout and the trainer must run
    the same one; every run uses :data:`EXACT_SPLIT_RULE`, another rule is for tests. They live here, not beside the
    kernel, because the CUDA backend's routing (:meth:`KernelTuning.exact_on_cublas`,
    :meth:`KernelTuning.exact_decode_config`) reads the split through this module, which imports no Triton.
    """

    programs: int = 112  # the program count (N tiles x splits) a split aims for: fixed, not the device's SMs
    max_split: int = 8  # the most splits (a power of two)
    min_kb_per_split: int = 28  # the fewest 128-wide K blocks per split: only long K splits
    block_n: int = 128  # exact mode's GEMM tile columns
    narrow_block_n: int = 64  # its tile columns for weights of at most narrow_n rows (more programs)
    narrow_n: int = 1024  # the widest weight that gets the narrow tiles

    def __post_init__(self) -> None:
        if not (all(_pow2(v) for v in (self.max_split, self.block_n, self.narrow_block_n))
                and all(_int(v) and v >= 0 for v in (self.programs, self.min_kb_per_split, self.narrow_n))):
            raise ValueError(f"ExactSplitRule: max_split and the tiles must be powers of two, the rest non-negative "
                             f"ints, got {self}")

    def tile_n(self, n: int) -> int:
        """The N tile of exact mode's GEMM for a weight of ``n`` rows."""
        return self.narrow_block_n if n <= self.narrow_n else self.block_n


EXACT_SPLIT_RULE = ExactSplitRule()


@dataclass(frozen=True)
class Rule:
    """What a field accepts: ``text`` completes "must be ..." in its error and in the configuration reference."""

    text: str
    accepts: Callable[[object], bool]


_BOOL = Rule("a bool", lambda v: isinstance(v, bool))
_INT0 = Rule("a non-negative int", lambda v: _int(v) and v >= 0)
_INT1 = Rule("a positive int", lambda v: _int(v) and v >= 1)
_INT_TO_DECODE = Rule(f"an int in 0..{DECODE_GEMM_MAX_M} (the decode GEMM's rows)",
                      lambda v: _int(v) and 0 <= v <= DECODE_GEMM_MAX_M)
_POW2_1_16 = Rule("a power of two in 1..16", lambda v: _pow2(v) and v <= 16)
_POW2_1_8 = Rule("a power of two in 1..8", lambda v: _pow2(v) and v <= 8)
_TILE_OR_0 = Rule("0 (the route's own tile) or a power of two in 16..256",
                  lambda v: _int(v) and (v == 0 or (_pow2(v) and 16 <= v <= 256)))
_REGISTERS = Rule("0 (the compiler's choice) or an int in 24..255", lambda v: _int(v) and (v == 0 or 24 <= v <= 255))
_POSITIVE = Rule("a positive finite number",
                 lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < float("inf"))
_RING_SLOTS = Rule("an int >= 2 (ring slots: the tile read and at least one in flight)", lambda v: _int(v) and v >= 2)


def knob(default, meaning: str, rule: Rule | None, factory: bool = False):
    """A kernel setting: its default, one-line meaning and rule (None: not settable from text; its family checks it
    as a whole); ``factory`` for a mapping default (unhashable: dataclasses take it only from a factory, which returns
    the declared mapping itself). Its family is the dataclass that declares it."""
    meta = {"meaning": meaning, "rule": rule}
    return field(default_factory=lambda: default, metadata=meta) if factory else field(default=default, metadata=meta)


@dataclass(frozen=True)
class GemmRouting:
    """GEMM routing.

    Where each FP8 GEMM runs (the CUDA backend, :func:`jetrl.quant.kernels.cuda_backend.gemm_path`):

    * ``gemm``: ``"auto"`` (the GEMMs DeepGEMM's rule takes to DeepGEMM where it loads here, decode-sized M to
      the split-K decode GEMM, the rest to cuBLAS where its layout rules hold, else the Triton GEMM);
      ``"deepgemm"``: the same, but DeepGEMM is required (a config error where it is not installed or is another
      torch's build, an error at its first GEMM where it does not load); or one path forced: ``"cublas"``,
      ``"triton"``, ``"decode"`` (M <= 256 only); the default comes from ``JETRL_FP8_GEMM``. DeepGEMM is built from
      source or installed as the PyPI build for this torch (:mod:`~jetrl.quant.kernels.deepgemm_builds`);
    * ``deepgemm_decode_max_m`` / ``deepgemm_split_k_max_m``: DeepGEMM's rule
      (:func:`~jetrl.quant.kernels.gemm_deepgemm.route`): the rollout's Fprop of at most ``deepgemm_decode_max_m``
      rows (its decode steps; 0: none, which keeps ``auto`` off DeepGEMM), where a weight whose K is more than twice
      its N stays on the split-K decode kernel up to ``deepgemm_split_k_max_m`` rows (at most 256); GEMMs of more
      rows (prefill, training micro-batches) stay on the default route;
    * ``decode_max_m`` / ``grouped_decode_max_m``: the most rows a single / grouped (q/k/v, gate/up) GEMM sends
      to the decode kernel (a grouped launch at least ``decode_max_m``), ``decode_max_m_by_shape`` per-shape
      exceptions (see :data:`DECODE_MAX_M_BY_SHAPE`);
    * ``decode_policies`` / ``decode_shape_configs``: the decode GEMM's configs (:meth:`decode_config`);
    * ``decode_gemm_pdl`` (on): on a Hopper or later GPU the decode GEMM and the kernels before and after it are
      programmatic dependent launches, each waiting for the kernel before it before it reads anything: the same bits
      either way (:func:`early_dependents`, :mod:`~jetrl.quant.kernels.gemm_decode_triton`).
    """

    gemm: str = knob("auto", "FP8 GEMM path: auto (DeepGEMM where it loads, decode kernel, cuBLAS by shape), deepgemm "
                     "(DeepGEMM required), cublas, triton, decode; default JETRL_FP8_GEMM", None)
    deepgemm_decode_max_m: int = knob(DECODE_GEMM_MAX_M, "the most rows of a GEMM (a decode step's) that DeepGEMM "
                                      "takes (0: none, and auto never uses DeepGEMM)", _INT_TO_DECODE)
    deepgemm_split_k_max_m: int = knob(128, "where DeepGEMM runs: up to this many rows a weight with K > 2N stays on "
                                       "the split-K decode kernel", _INT_TO_DECODE)
    decode_max_m: int = knob(64, "the most rows a single FP8 GEMM sends to the split-K decode kernel", _INT0)
    grouped_decode_max_m: int = knob(64, "the same for a grouped launch (q/k/v, gate/up); at least decode_max_m "
                                         "applies", _INT0)
    decode_max_m_by_shape: Mapping[tuple, int] = knob(DECODE_MAX_M_BY_SHAPE, "per-shape exceptions to the two "
                                                      "bounds above", None, factory=True)
    decode_policies: tuple[DecodePolicy, ...] = knob(DECODE_POLICIES, "the decode GEMM's configs by rows", None)
    decode_shape_configs: Mapping[tuple[int, int, int, bool], DecodeGemmConfig] = knob(
        DECODE_SHAPE_CONFIGS, "the decode GEMM's configs of measured shapes", None, factory=True)
    decode_gemm_pdl: bool = knob(True, "on Hopper: the decode GEMM and the kernels around it launch while the "
                                 "kernel before each runs (programmatic dependent launch; the same bits)", _BOOL)

    def _check(self) -> None:
        if self.gemm not in GEMM_CHOICES:
            raise ValueError(f"the FP8 GEMM path (JETRL_FP8_GEMM or tuning gemm=) must be one of {GEMM_CHOICES}, "
                             f"got {self.gemm!r}")
        if self.gemm == "deepgemm" and (problem := deepgemm_builds.problem()) is not None:
            raise ValueError(f"the FP8 GEMM path deepgemm (JETRL_FP8_GEMM or tuning gemm=) needs DeepGEMM for this "
                             f"torch: {problem}")
        bounds = [p.max_m for p in self.decode_policies]
        if not bounds or bounds != sorted(bounds) or bounds[-1] != DECODE_GEMM_MAX_M:
            raise ValueError(f"KernelTuning.decode_policies must rise to max_m={DECODE_GEMM_MAX_M}, got {bounds}")
        # tables given as plain dicts are frozen too
        object.__setattr__(self, "decode_max_m_by_shape", MappingProxyType(dict(self.decode_max_m_by_shape)))
        object.__setattr__(self, "decode_shape_configs", MappingProxyType(dict(self.decode_shape_configs)))

    def uses_deepgemm(self, loads: Callable[[], bool]) -> bool:
        """Whether DeepGEMM's rule routes GEMMs: under ``gemm="deepgemm"`` always, under ``"auto"`` where the rule
        takes rows (``deepgemm_decode_max_m`` > 0), the installed DeepGEMM is one jetrl knows runs on this torch
        (:func:`~jetrl.quant.kernels.deepgemm_builds.auto_problem`) and ``loads()`` (it loads for the GPU at hand:
        the CUDA backend passes :func:`~jetrl.quant.kernels.gemm_deepgemm.is_available`; called only then)."""
        if self.gemm == "deepgemm":
            return True
        return (self.gemm == "auto" and self.deepgemm_decode_max_m > 0 and deepgemm_builds.auto_problem() is None
                and loads())

    def deepgemm_rule(self) -> dict[str, int]:
        """The bounds of DeepGEMM's rule (:func:`~jetrl.quant.kernels.gemm_deepgemm.route`), as its keywords."""
        return dict(decode_max_m=self.deepgemm_decode_max_m, split_k_max_m=self.deepgemm_split_k_max_m)

    def decode_policy(self, m: int) -> DecodePolicy:
        """The :attr:`decode_policies` entry for ``m`` rows."""
        for policy in self.decode_policies:
            if m <= policy.max_m:
                return policy
        raise ValueError(f"no decode policy for {m} rows (the decode GEMM handles at most {DECODE_GEMM_MAX_M})")

    def decode_config(self, m: int, n: int, k: int, sm_count: int, grouped: bool = False) -> DecodeGemmConfig:
        """The decode GEMM's config for (m, n, k) (``n``: total width of a grouped launch) on ``sm_count`` SMs:
        the :attr:`decode_shape_configs` entry where there is one, else the per-M policy."""
        bucket = 32 if m <= 32 else 64 if m <= 64 else 128 if m <= 128 else 256
        tuned = self.decode_shape_configs.get((bucket, n, k, bool(grouped)))
        if tuned is not None:
            return tuned
        return self.decode_policy(m).config(m, n, k, sm_count)

    def decode_rows(self, n: int, k: int, grouped: bool = False) -> int:
        """The most rows for which the decode kernel runs an (N, K) weight (``n``: the total width of a grouped
        launch): the general bound, or its :attr:`decode_max_m_by_shape` exception."""
        bound = max(self.decode_max_m, self.grouped_decode_max_m) if grouped else self.decode_max_m
        bound = self.decode_max_m_by_shape.get(("grouped", n, k) if grouped else (n, k), bound)
        return min(bound, DECODE_GEMM_MAX_M)


@dataclass(frozen=True)
class Quantizers:
    """Quantization kernels and FP8 weights.

    The same bytes either way. ``gluon`` (on): the 128x1 kernels and
    grad_out's one-pass 1x128 + 128x1 in Gluon where the installed Triton has it and the rows have unit stride; off
    (or no Gluon), the Triton 128x1 kernels, and grad_out as two Triton kernels (1x128, then 128x1).
    ``cache_weight_t`` (off) keeps W^T's FP8 form (1 byte per parameter) with each linear's FP8 weight for the
    weight's version; off, each backward transposes W's FP8 tiles into a transient W^T (one launch per linear: the
    same bytes). The training side then holds one FP8 copy of its weights, not two.
    """

    gluon: bool = knob(True, "the 128x1 quantizers (and grad_out's two-way pass) in Gluon where Triton has "
                       "it; off: Triton", _BOOL)
    cache_weight_t: bool = knob(False, "keep W^T's FP8 form beside W's for the weight's version (off: each "
                                "backward transposes W's FP8 tiles)", _BOOL)


@dataclass(frozen=True)
class ExactSchedule:
    """Exact mode's schedule (:mod:`jetrl.quant.exact`; beside :class:`GemmRouting` in :class:`KernelTuning`, whose
    decode configs its decode schedule uses).

    Its GEMMs' K split (:meth:`exact_split`) fixes their arithmetic, never chosen by M: ``exact_split_k`` (0, the
    default: the heuristic of :data:`EXACT_SPLIT_RULE`, so that a weight with K up to 7,040 walks K unsplit, trains
    on cuBLAS and decodes as one grouped launch where it shares an input, and an 8B model's down projection,
    K = 14,336, splits in 4; a positive count forces that many splits; 1 is the one in-order K walk). The rollout and
    the trainer must run the same split (any is batch-invariant, but two different ones are two different reduction
    orders). The other fields are schedules, the same bits (the GPU tests check them at the 8B shapes):

    * ``exact_split_max_m``: up to that many rows (256, a decode batch's most) the splits run as separate programs
      (partials through a workspace), above it one program walks all splits of its tile;
    * ``exact_wide_min_m`` (0: never): from that many rows on (prefill and the trainer's packed passes) the walking
      schedule's FP8 GEMMs load the decode-sized tiles through TMA where the layouts allow (a tile whose columns lie
      in one 128-row weight scale block scales by rows: the same fp32 products as the outer product of scales), and
      its other GEMMs run wide tiles (:class:`~jetrl.quant.kernels.gemm_exact_triton.ExactTiles`): a tile's extent
      in M and N is not part of a row's arithmetic;
    * ``exact_cublas_min_m`` (0: never): from that many rows on, a weight whose K is walked in one range
      (:meth:`exact_split` is 1) multiplies on cuBLAS's blockwise GEMM (:meth:`exact_on_cublas`), whose arithmetic
      is the in-order walk's: each 128-wide K block's MMA sum from zero, scaled by ``sa * sb`` into one fp32
      accumulator, K blocks in order, one rounding. At a few rows cuBLAS may split K for some shapes
      (docs/benchmark-history.md), so the default, 65, starts past the decode kernel's rows; every RL step's
      ``mismatch/logp_abs_diff_max`` would show a drift;
    * ``exact_decode_max_m`` (0: never): up to that many rows an exact FP8 GEMM runs on the fast path's split-K
      decode kernel (:mod:`~jetrl.quant.kernels.gemm_decode_triton`) forced to exact mode's K split
      (:meth:`exact_decode_config`). Its arithmetic is the exact kernel's: each split's K blocks walked in order from
      zero with ``acc += dot * (sa * sb)``, the partials summed in split order, one rounding; the swapped MMA operands
      multiply the same pairs in the same K order. Weights that share an input and a split (q/k/v, gate/up) run as
      one grouped launch.
    """

    exact_split_k: int = knob(0, "exact mode's K split on every weight (0: the fixed heuristic, "
                              "ExactSplitRule); changes the bits, the same on both sides", _INT0)
    exact_split_max_m: int = knob(256, "up to this many rows the splits run as separate programs (a "
                                  "schedule)", _INT0)
    exact_wide_min_m: int = knob(256, "from this many rows on, exact GEMMs on wide tiles and TMA loads (a "
                                 "schedule; 0: never)", _INT0)
    exact_cublas_min_m: int = knob(65, "from this many rows on, an unsplit weight multiplies on cuBLAS (the "
                                   "same bits; 0: never)", _INT0)
    exact_decode_max_m: int = knob(64, "up to this many rows, exact GEMMs run on the split-K decode kernel "
                                   "with exact mode's split (the same bits; 0: never)", _INT_TO_DECODE)

    def exact_split(self, n: int, k: int, rule: ExactSplitRule = EXACT_SPLIT_RULE) -> int:
        """How many contiguous K ranges exact mode's GEMM splits an (N, K) weight's reduction into (a function of
        the weight's shape, ``exact_split_k`` and ``rule`` only, never of M; ``rule``: the fixed heuristic, another
        one only in tests).

        Heuristic: the smallest power of two S <= ``rule.max_split`` whose ``ceil(N / rule.tile_n(N)) * S``
        programs (one row tile's worth) reach ``rule.programs``, else the largest allowed, and no larger than
        ``Kb // rule.min_kb_per_split`` (Kb: K's 128-wide blocks). ``exact_split_k > 0`` forces S instead (at
        most Kb). The splits hold whole K blocks, ``ceil(Kb / S)`` each, the last one the rest (with K's partial
        block if any); what is returned is the number of non-empty splits that makes (e.g. Kb = 33 in 8 asked
        splits of 5 blocks: 7 splits).
        """
        kb = -(-k // BLOCK_SIZE)
        if kb <= 1:
            return 1
        if self.exact_split_k:
            split = min(self.exact_split_k, kb)
        else:
            tiles = -(-n // rule.tile_n(n))
            cap = max(1, min(rule.max_split, kb // max(1, rule.min_kb_per_split)))
            split = 1
            while split * 2 <= cap and tiles * split < rule.programs:
                split *= 2
        return -(-kb // -(-kb // split))

    def exact_split_kb(self, n: int, k: int) -> int:
        """128-wide K blocks per split of an (N, K) weight (:meth:`exact_split`; the last split the rest)."""
        kb = -(-k // BLOCK_SIZE)
        return -(-kb // self.exact_split(n, k))

    def exact_on_cublas(self, m: int, n: int, k: int) -> bool:
        """Whether an exact FP8 GEMM of ``m`` rows on an (N, K) weight runs on cuBLAS's blockwise GEMM (a schedule:
        the same bits as the Triton kernel's single in-order K walk; see ``exact_cublas_min_m``): from
        ``exact_cublas_min_m`` rows on, where the weight's K is not split."""
        return bool(self.exact_cublas_min_m) and m >= self.exact_cublas_min_m and self.exact_split(n, k) == 1

    def exact_decode_config(self, m: int, widths: tuple[int, ...], k: int, sm_count: int) -> DecodeGemmConfig | None:
        """The decode GEMM's config that runs exact FP8 GEMMs of ``m`` rows on weights of ``widths`` rows and K
        columns sharing their input (one width: a lone GEMM; more: one grouped launch), or ``None`` where that
        schedule does not apply: above ``exact_decode_max_m`` rows, or weights whose K splits
        (:meth:`exact_split`) differ. :meth:`decode_config`'s tiles with the exact split, its ``k_unroll`` where
        that divides a split's K blocks (the decode kernel rounds a split up to whole loop trips, which would move
        the boundaries) and 1 otherwise."""
        if not self.exact_decode_max_m or m > self.exact_decode_max_m or not widths:
            return None
        splits = {self.exact_split(n, k) for n in widths}
        if len(splits) != 1:
            return None
        split = splits.pop()
        tiles = self.decode_config(m, sum(widths), k, sm_count, grouped=len(widths) > 1)  # GemmRouting's
        unroll = tiles.k_unroll if self.exact_split_kb(widths[0], k) % tiles.k_unroll == 0 else 1
        return dataclasses.replace(tiles, split_k=split, k_unroll=unroll)


@dataclass(frozen=True)
class DecodeAttention:
    """Decode attention over an FP8 cache.

    ``kv_decode_factored``: the paged decode kernel reads an FP8 KV cache as E4M3 tiles straight into its dots,
    the per-token scales on the dots' fp32 sides (:mod:`~jetrl.quant.kernels.paged_attention_triton`); off, each
    tile is dequantized in registers first (the route an fp16 query always takes). On by default.
    That kernel's launch over an FP8 cache (either route; a cache in q's dtype keeps its fixed launch,
    ``BF16_LAUNCH``): ``kv_decode_block_n`` tokens per tile (0: the route's own, 128 factored, 64 in registers),
    ``kv_decode_num_warps`` and ``kv_decode_num_stages`` (1 by default: a second stage adds no overlap to this loop,
    only shared memory), the context split (``choose_num_splits``) aiming at ``kv_decode_split_waves`` waves of
    programs over the SMs, at most ``kv_decode_max_splits``, and ``kv_decode_max_registers`` (``maxnreg``; 128 lets
    4 programs of 4 warps share an SM where the shared memory allows, at the cost of a few spills). The defaults are
    the fastest launch of the H200 sweep in docs/benchmark-history.md. Any values give the attention over the
    dequantized cache to summation order (the tile and the split set that order); ``bench/attention.py`` sweeps them.
    ``kv_decode_streams`` (on by default; faster on the H200, BENCHMARKS.md, "Decode attention") runs an FP8-cache
    decode step on the Gluon kernel of :mod:`~jetrl.quant.kernels.paged_attention_gluon` wherever it applies
    (:func:`~jetrl.quant.kernels.paged_attention_gluon.supports`, a Triton with Gluon), and the Triton kernel above
    elsewhere (or with the field off): ``kv_decode_stream_warps`` warp streams per program,
    ``kv_decode_stream_stages`` ring slots of 16-token tiles (``stages x warps`` slots of :data:`STREAM_SLOT_BYTES`
    within :data:`STREAM_RING_MAX_BYTES`), a context split aiming at ``kv_decode_stream_waves`` programs per SM
    (:func:`~jetrl.quant.kernels.paged_attention_gluon.num_splits`), at most ``kv_decode_stream_max_splits``, and
    ``kv_decode_stream_max_registers`` (``maxnreg``; 128 lets 16 one-warp programs share an SM).
    """

    kv_decode_factored: bool = knob(True, "FP8-cache decode attention reads E4M3 tiles into its dots, scales on "
                                    "the fp32 side (off: dequantized in registers)", _BOOL)
    kv_decode_block_n: int = knob(0, "tokens per tile of the Triton FP8-cache kernel (0: the route's own, 128 "
                                  "factored, 64 in registers)", _TILE_OR_0)
    kv_decode_num_warps: int = knob(4, "its warps", _POW2_1_16)
    kv_decode_num_stages: int = knob(1, "its pipeline stages", _INT1)
    kv_decode_split_waves: float = knob(2.0, "waves of programs over the SMs its context split aims for", _POSITIVE)
    kv_decode_max_splits: int = knob(16, "its most context splits", _INT1)
    kv_decode_max_registers: int = knob(128, "its registers per thread (maxnreg)", _REGISTERS)
    kv_decode_streams: bool = knob(True, "FP8-cache decode steps on the Gluon kernel where it applies (bf16 "
                                   "queries, head_dim 128, pages % 16, groups <= 8)", _BOOL)
    kv_decode_stream_warps: int = knob(1, "warp streams per program of the Gluon kernel", _POW2_1_8)
    kv_decode_stream_stages: int = knob(3, "its ring slots of 16-token tiles (the tile read and the rest in "
                                        "flight)", _RING_SLOTS)
    kv_decode_stream_waves: float = knob(6.0, "programs per SM its context split aims for from 4,096 tokens of "
                                         "context on (fewer below, to half)", _POSITIVE)
    kv_decode_stream_max_splits: int = knob(64, "its most context splits", _INT1)
    kv_decode_stream_max_registers: int = knob(128, "its registers per thread (maxnreg)", _REGISTERS)

    def _check(self) -> None:
        ring = self.kv_decode_stream_stages * self.kv_decode_stream_warps * STREAM_SLOT_BYTES
        if ring > STREAM_RING_MAX_BYTES:
            raise ValueError(f"KernelTuning.kv_decode_stream_stages x kv_decode_stream_warps: a ring of "
                             f"{self.kv_decode_stream_stages} slots for {self.kv_decode_stream_warps} warps is {ring} "
                             f"bytes of shared memory, more than the {STREAM_RING_MAX_BYTES} a program may use")


# the families, in the order the configuration reference lists them (and KernelTuning declares their fields)
FAMILY_CLASSES = (GemmRouting, Quantizers, ExactSchedule, DecodeAttention)
FAMILIES = ("GEMM routing", "quantization kernels and FP8 weights", "exact mode's schedule",
            "decode attention over an FP8 cache")


@dataclass(frozen=True)
class KernelTuning(DecodeAttention, ExactSchedule, Quantizers, GemmRouting):
    """The kernels' settings, one family of fields each (:data:`FAMILY_CLASSES`: GEMM routing, the quantizers,
    exact mode's schedule, decode attention over an FP8 cache); read with :func:`current`, changed for a block with
    :func:`override`. Each field declares its one-line meaning and its rule, which the object checks and the
    configuration reference prints; a family whose fields constrain one another checks that too. The families are
    its parts, not settings objects of their own: only this object runs their checks."""

    def __post_init__(self) -> None:
        for f in fields(self):  # each field's own rule (its metadata, which the configuration reference prints)
            rule = f.metadata.get("rule")
            value = getattr(self, f.name)
            if rule is not None and not rule.accepts(value):
                raise ValueError(f"KernelTuning.{f.name} must be {rule.text}, got {value!r}")
        for family in (GemmRouting, DecodeAttention):  # the families whose fields constrain one another
            family._check(self)


def family_of(name: str) -> str:
    """The family (:data:`FAMILIES`) of the :class:`KernelTuning` field ``name``."""
    for cls, title in zip(FAMILY_CLASSES, FAMILIES):
        if name in {f.name for f in fields(cls)}:
            return title
    raise KeyError(name)


_DEFAULT = KernelTuning(gemm=os.environ.get("JETRL_FP8_GEMM", "auto"))
_CURRENT: contextvars.ContextVar[KernelTuning] = contextvars.ContextVar("jetrl_kernel_tuning", default=_DEFAULT)


def interpreting() -> bool:
    """Whether Triton runs its kernels in the interpreter (``TRITON_INTERPRET=1``, read now): the CPU tests' mode,
    in which a kernel module picks the interpreter's stand-ins (NumPy math, no inline PTX, no programmatic launch).
    Triton reads the variable when it is imported, so a process sets it before that."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def early_dependents(device: torch.device) -> bool:
    """Whether the decode GEMM on ``device`` and the kernels before and after it in a decode step (the fused norms and
    SwiGLU where they quantize, the 1x128 quantizer, RoPE; :func:`pdl_args`) launch as programmatic dependents: each
    waits for the kernel before it (``griddepcontrol.wait``) before it reads or writes anything, then lets the next one
    launch (RoPE only waits), so a kernel's launch overlaps the one before it. ``decode_gemm_pdl`` on a GPU of compute
    capability 9.0 or later (``griddepcontrol`` is Hopper's), not under ``TRITON_INTERPRET=1`` (the interpreter has no
    such launch, on CPU or CUDA tensors)."""
    if device.type != "cuda" or not current().decode_gemm_pdl or interpreting():
        return False
    import torch

    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device, feeds_fp8: bool = True) -> dict:
    """A kernel's ``PDL`` flag (its wait) with the launch option that goes with it, from :func:`early_dependents`;
    ``feeds_fp8``: whether this launch's output is an FP8 GEMM's input (the fused norm and SwiGLU launch as
    dependents only when they quantize: in ``bf16`` the kernels around them are cuBLAS's)."""
    return {"PDL": True, "launch_pdl": True} if feeds_fp8 and early_dependents(device) else {"PDL": False}


@functools.lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    import torch

    return torch.cuda.get_device_capability(index)[0] >= 9


def current() -> KernelTuning:
    """The settings in force (the innermost :func:`override`, else the defaults)."""
    return _CURRENT.get()


@contextlib.contextmanager
def override(**changes) -> Iterator[KernelTuning]:
    """Replace the named fields of :func:`current` for the enclosed block (an unknown name is an error)."""
    known = {f.name for f in fields(KernelTuning)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"tuning.override: unknown setting(s) {unknown}; choose from {sorted(known)}")
    token = _CURRENT.set(dataclasses.replace(current(), **changes))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


SETTING_TYPES = (bool, int, float, str)  # the field types a KEY=VALUE setting can give (parse_settings)


def settable_fields() -> tuple[str, ...]:
    """The fields of :class:`KernelTuning` that :func:`parse_settings` can set from text (a config's
    ``kernels``), in declaration order: those holding a bool, int, float or str."""
    now = current()
    return tuple(f.name for f in fields(KernelTuning) if type(getattr(now, f.name)) in SETTING_TYPES)


def setting_docs() -> tuple[tuple[str, str, str, str, str], ...]:
    """``(family, name, default, rule, meaning)`` of every field :func:`parse_settings` can set, family by family
    (:data:`FAMILIES`) and in declaration order within one: what the configuration reference prints. The default
    is the declared one (``JETRL_FP8_GEMM`` may change ``gemm``'s in a process); the rule completes "must be ..."."""
    settable = set(settable_fields())
    rows = [(family_of(f.name), f.name, f.default, f.metadata["rule"], f.metadata["meaning"])
            for f in fields(KernelTuning) if f.name in settable]
    rows.sort(key=lambda r: FAMILIES.index(r[0]))  # stable: declaration order within a family
    return tuple((family, name, str(value).lower() if isinstance(value, bool) else str(value),
                  rule.text if rule else f"one of {', '.join(GEMM_CHOICES)}", meaning)
                 for family, name, value, rule, meaning in rows)


def parse_settings(items, what: str = "kernels") -> dict:
    """``["exact_split_k=1", "kv_decode_factored=true"]`` -> the fields for :func:`override`: each value read as
    the type of its field (bool: true/false/1/0), then checked by the tuning object itself. A ``ValueError`` that
    names ``what`` (where the settings came from) for a key that is not a field, a repeated key, a value of the
    wrong type, a field no text can give (a mapping) or a value the object rejects."""
    now = current()
    settings: dict = {}
    for item in items:
        key, sep, text = str(item).partition("=")
        key = key.strip()
        if not sep or key not in {f.name for f in fields(KernelTuning)}:
            raise ValueError(f"{what}: a tuning setting reads KEY=VALUE with KEY a field of KernelTuning, "
                             f"got {str(item).strip()!r}")
        if key in settings:
            raise ValueError(f"{what}: {key} is set twice")
        kind = type(getattr(now, key))
        text = text.strip()
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{what}: {key} must be true or false, got {text!r}")
            settings[key] = text.lower() in ("true", "1")
        elif kind in SETTING_TYPES:
            try:
                settings[key] = kind(text)
            except ValueError:
                raise ValueError(f"{what}: {key} must be {kind.__name__}, got {text!r}") from None
        else:
            raise ValueError(f"{what}: {key} holds a {kind.__name__}, which a KEY=VALUE setting cannot give")
    try:
        dataclasses.replace(now, **settings)  # the object's own checks, before any model is built
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what}: {exc}") from None
    return settings
