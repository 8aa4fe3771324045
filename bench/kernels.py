"""FP8 kernel benchmarks at Llama-3.1-8B shapes on one Hopper GPU: every ratio against BF16 in the same run.

Sections (medians of ``triton.testing.do_bench``, L2 flushed between repetitions):

1. quantization kernels: achieved bandwidth as a fraction of a measured device-to-device copy;
2. pre-quantized GEMMs (Fprop, DGrad, WGrad) in FP8 vs BF16 ``torch.matmul``, TFLOP/s;
3. ``FP8Linear`` forward+backward, quantization included, vs BF16 ``nn.Linear``;
4. an MLP block (RMSNorm, gate_up, SwiGLU, down) forward+backward, recipe ``jet`` vs BF16;
5. decode-size GEMMs (M = 1..64) FP8 vs BF16, per GEMM path;
6. ``exact-gemm`` (not in the default sections): exact mode's batch-invariant GEMM at training sizes
   (``--exact-m``), its schedules (tiles), each checked bitwise against the decode-sized tiles, over the fast
   FP8 GEMM and BF16;
7. ``decode-sweep`` (not in the default sections): the decode kernel's tuning variants at M = 16..256, per
   shape the best config and its ratio to BF16, the best policy per M and where it beats cuBLAS
   (``--sweep-shape 1.5b`` for the rollout benchmark's small model, ``--sweep-m`` for the row counts);
8. ``cublas-invariance`` (not in the default sections): whether a row of cuBLAS's blockwise FP8 GEMM (and of BF16
   ``torch.matmul``) depends on M, and whether exact mode's single in-order K walk gives cuBLAS's bits (what the
   tuning's ``exact_cublas_min_m`` relies on);
9. ``profile`` / ``host-profile`` (not in the default sections): one FP8Linear step under the PyTorch
   profiler, and the host (Python) time of its eager forward+backward under cProfile;
10. ``gemm-train`` (not in the default sections): Fprop, DGrad and WGrad at the Qwen2.5-0.5B, -1.5B and -7B linears'
    shapes (``--train-models``) and ``--train-m`` tokens (13,440), cuBLAS's blockwise ``scaled_mm`` against BF16
    ``torch.matmul``: TFLOP/s and the ratio;
11. ``sampler`` (not in the default sections): the decode step's seeded sampler (:mod:`jetrl.quant.kernels.
    sampling_triton`) on BF16 logits of 32K and 152K vocabularies, 1-256 rows, T = 1 and 0.7: us per call as CUDA
    graph replays, with the approximate noise (the default) and with the exact noise throughout
    (``exact_tiles``), and the tensor-op sampler; the logits' bytes over the time as a fraction of copy.

Run: ``python bench/kernels.py [--quick] [--json PATH]``; the training GEMMs alone:
``python bench/kernels.py --sections gemm-train --json gemm_train.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

LLAMA8B_NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
TRAIN_M = [64, 256, 4096, 16384]
DECODE_M = [1, 16, 32, 64]
TOKEN_TILES = [(64, 4), (32, 2), (32, 1)]  # (block_k, num_warps) tried for the Triton 128x1 kernels


@dataclass
class Report:
    device: str = ""
    torch_version: str = ""
    triton_version: str = ""
    copy_gbps: float = 0.0
    sections: dict[str, list[dict]] = field(default_factory=dict)

    def add(self, section: str, **row) -> None:
        self.sections.setdefault(section, []).append(row)
        print(f"[{section}] " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _bench_ms(fn, warmup: int = 10, rep: int = 40) -> float:
    """Eager median: CPU launch overhead shows up whenever the GPU waits for it."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _graph_ms(fn) -> float | None:
    """Median of CUDA-graph replays of ``fn``: GPU time alone (how decoding and graphed steps run)."""
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"))
    except Exception as exc:  # a path that cannot be captured is reported, not fatal
        print(f"  (graph capture failed: {type(exc).__name__}: {str(exc)[:120]})", flush=True)
        return None


def _cpu_us(fn, iters: int = 20) -> float:
    """Host time to enqueue one call (no synchronization inside the loop)."""
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def _copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6  # GB/s, bytes read + written



def bench_quantization(rep: Report, shapes: list[tuple[int, int]]) -> None:
    from jetrl.quant.kernels import quantize_triton as tk

    for m, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        q, s = tk.quantize_act_1x128(x)
        kb, mb = -(-k // 128), -(-m // 128)
        cases = {
            # name: (fn, bytes moved); tiles and warps are the kernels' defaults
            "act 1x128": (lambda: tk.quantize_act_1x128(x), 2 * m * k + m * k + 4 * m * kb),
            "token 128x1": (lambda: tk.quantize_token_128x1(x), 2 * m * k + m * k + 4 * mb * k),
            "requant 1x128->128x1": (lambda: tk.requantize_act_to_token(q, s), 2 * m * k + 4 * (m * kb + mb * k)),
            "weight 128x128 + W^T": (lambda: tk.quantize_weight_128x128(x, emit_t=True), 2 * m * k + 2 * m * k),
            # grad_out without Gluon: the 1x128 kernel, then the 128x1 kernel (the backend's fallback)
            "act 1x128 + 128x1 [two kernels]": (lambda: (tk.quantize_act_1x128(x), tk.quantize_token_128x1(x)),
                                                2 * m * k + 2 * m * k + 4 * (m * kb + mb * k)),
        }
        for bk, warps in TOKEN_TILES:  # the Triton 128x1 kernels' tile sweep, passed to their launchers
            tag = f" [bk{bk} w{warps}]"
            tiles = dict(block_k=bk, num_warps=warps)
            cases["token 128x1" + tag] = (lambda t=tiles: tk.quantize_token_128x1(x, **t),
                                          2 * m * k + m * k + 4 * mb * k)
            cases["requant 1x128->128x1" + tag] = (lambda t=tiles: tk.requantize_act_to_token(q, s, **t),
                                                   2 * m * k + 4 * (m * kb + mb * k))
        try:  # the Gluon 128x1 kernels (the tile staged in shared memory, one whole column per thread)
            from jetrl.quant.kernels import quantize_gluon as tg

            cases.update({
                "requant 1x128->128x1 [gluon]": (lambda: tg.requantize_act_to_token(q, s),
                                                 2 * m * k + 4 * (m * kb + mb * k)),
                "token 128x1 [gluon]": (lambda: tg.quantize_token_128x1(x), 2 * m * k + m * k + 4 * mb * k),
                "act 1x128 + 128x1 [gluon one pass]": (lambda: tg.quantize_act_and_token(x),
                                                       2 * m * k + 2 * m * k + 4 * (m * kb + mb * k)),
            })
        except ImportError as exc:
            print(f"  (no Gluon kernels: {exc})", flush=True)
        for name, (fn, nbytes) in cases.items():
            try:
                fn()
            except Exception as exc:  # an experimental variant that does not compile here is reported, not fatal
                print(f"  ({name}: {type(exc).__name__}: {str(exc)[:200]})", flush=True)
                continue
            ms = _graph_ms(fn) or _bench_ms(fn)
            gbps = nbytes / ms / 1e6
            rep.add("quant", kernel=name, shape=f"{m}x{k}", us=ms * 1e3, gbps=gbps, frac_copy=gbps / rep.copy_gbps)


# quant-sweep: per kernel, the configurations timed (keyword arguments of its launcher in
# jetrl.quant.kernels.quantize_triton, whose constants are the defaults). Every configuration gives the same bits
# (tests/quant/test_triton_interpret.py, tests/quant/test_kernels_gpu.py).
def _quant_sweep_configs() -> dict[str, list[dict]]:
    return {
        "act 1x128": [dict(block_m=bm, num_warps=w) for bm, w in ((32, 4), (64, 8), (16, 4))],
        "token 128x1": [dict(block_k=bk, num_warps=w) for bk, w in ((32, 1), (64, 4), (32, 2), (64, 2), (128, 4))],
        "requant 1x128->128x1": [dict(block_k=bk, num_warps=w) for bk, w in ((32, 1), (32, 4), (32, 2), (64, 2),
                                                                             (128, 4))],
        "weight 128x128 + W^T": [dict(num_warps=w) for w in (8, 4)],
    }


def _config_name(cfg: dict) -> str:
    short = {"block_m": "bm", "block_k": "bk", "num_warps": "w"}
    return " ".join(f"{short[k]}={v}" for k, v in cfg.items())


def bench_quant_sweep(rep: Report, shapes: list[tuple[int, int]]) -> None:
    """Every quantization kernel in every configuration of :func:`_quant_sweep_configs`, per shape: fraction of
    copy bandwidth (CUDA-graph replays, same byte counts as the ``quant`` section), the best configuration per
    kernel and shape, and the configuration best over all shapes (geometric mean), to set as the default."""
    import math

    import triton.testing

    from jetrl.quant.kernels import quantize_triton as tk

    def graph_ms(fn) -> float:
        try:
            return float(triton.testing.do_bench_cudagraph(fn, rep=15, return_mode="median"))
        except Exception:  # capture failed: eager timing still ranks the configurations
            return float(triton.testing.do_bench(fn, warmup=5, rep=15, return_mode="median"))

    configs = _quant_sweep_configs()
    fracs: dict[str, dict[str, list[float]]] = {kernel: {} for kernel in configs}
    for m, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        q, s = tk.quantize_act_1x128(x)
        kb, mb = -(-k // 128), -(-m // 128)
        calls = {  # kernel: (call with a configuration, bytes moved)
            "act 1x128": (lambda c: tk.quantize_act_1x128(x, **c), 2 * m * k + m * k + 4 * m * kb),
            "token 128x1": (lambda c: tk.quantize_token_128x1(x, **c), 2 * m * k + m * k + 4 * mb * k),
            "requant 1x128->128x1": (lambda c: tk.requantize_act_to_token(q, s, **c),
                                     2 * m * k + 4 * (m * kb + mb * k)),
            "weight 128x128 + W^T": (lambda c: tk.quantize_weight_128x128(x, emit_t=True, **c),
                                     2 * m * k + 2 * m * k),
        }
        for kernel, (call, nbytes) in calls.items():
            best = None
            for cfg in configs[kernel]:
                name = _config_name(cfg)
                ms = graph_ms(lambda c=cfg: call(c))
                frac = nbytes / ms / 1e6 / rep.copy_gbps
                fracs[kernel].setdefault(name, []).append(frac)
                rep.add("quant-sweep", kernel=kernel, shape=f"{m}x{k}", config=name, us=ms * 1e3, frac_copy=frac)
                best = max(best or (frac, name), (frac, name))
            default_ms = graph_ms(lambda: call({}))
            print(f"  -> {kernel} {m}x{k}: best {best[1]} {best[0]:.2f} of copy; "
                  f"current default {nbytes / default_ms / 1e6 / rep.copy_gbps:.2f}", flush=True)
    for kernel, by_cfg in fracs.items():
        score = {name: math.exp(sum(math.log(f) for f in v) / len(v)) for name, v in by_cfg.items()}
        name = max(score, key=score.get)
        rep.add("quant-sweep-best", kernel=kernel, config=name, geomean_frac_copy=score[name],
                per_shape=" ".join(f"{f:.2f}" for f in by_cfg[name]))


def _gemm_operands(m: int, n: int, k: int):
    from jetrl.quant.kernels.cuda_backend import CudaBackend

    be = CudaBackend()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    qx = be.quantize(x, (1, 128))
    qw, qw_t = be.quantize_weight_pair(w)
    qdy, qdy_tok = be.quantize_act_and_token(dy)
    qx_tok = be.requantize(qx, (128, 1))
    return be, (x, w, dy), (qx, qw, qw_t, qdy, qdy_tok.t(), qx_tok.t())


def bench_gemms(rep: Report, ms_list: list[int], nk_list: list[tuple[int, int]]) -> None:
    for n, k in nk_list:
        for m in ms_list:
            be, (x, w, dy), (qx, qw, qw_t, qdy, qdy_tok_t, qx_tok_t) = _gemm_operands(m, n, k)
            flop = 2.0 * m * n * k
            pairs = {
                "fprop": (lambda: be.gemm(qx, qw), lambda: torch.matmul(x, w.t())),
                "dgrad": (lambda: be.gemm(qdy, qw_t), lambda: torch.matmul(dy, w)),
                "wgrad": (lambda: be.gemm(qdy_tok_t, qx_tok_t), lambda: torch.matmul(dy.t(), x)),
            }
            for name, (f8, bf) in pairs.items():
                t8, tb = _bench_ms(f8), _bench_ms(bf)
                rep.add("gemm", gemm=name, m=m, n=n, k=k, fp8_tflops=flop / t8 / 1e9, bf16_tflops=flop / tb / 1e9,
                        speedup=tb / t8)


# exact mode's GEMM schedules timed by the exact-gemm section: name -> (tuning overrides, keyword arguments of
# jetrl.quant.kernels.gemm_exact_triton.ExactTiles for the launch; the decode-sized tiles first: the bits every
# other one is checked against)
def _exact_wide(bm: int, bn: int, warps: int, stages: int) -> tuple[dict, dict]:
    return dict(exact_wide_min_m=1), dict(wide_block_m=bm, wide_block_n=bn, wide_mm_block_n=bn,
                                          wide_num_warps=warps, wide_num_stages=stages)


EXACT_SCHEDULES = {
    "decode-tiles": (dict(exact_wide_min_m=0), {}),
    "tma-decode-tiles": (dict(exact_wide_min_m=1), {}),  # the default walk (FP8: TMA, row scales)
    "tma-s4": (dict(exact_wide_min_m=1), dict(num_stages=4)),
    "tma-128x128w8": (dict(exact_wide_min_m=1), dict(block_m=128, num_warps=8)),
}
# the wide tiles of the 16/32-bit path (the LM head; the FP8 walk loads the decode-sized tiles through TMA)
EXACT_WIDE_SCHEDULES = {
    "128x128w8s3": _exact_wide(128, 128, 8, 3),
    "128x128w8s4": _exact_wide(128, 128, 8, 4),
    "128x256w8s3": _exact_wide(128, 256, 8, 3),
    "256x128w8s3": _exact_wide(256, 128, 8, 3),
}
EXACT_LM_HEAD = (128256, 4096)  # Llama-3.1-8B's LM head: exact mode runs it through the bf16 exact GEMM


def bench_exact_gemm(rep: Report, ms_list: list[int], nk_list: list[tuple[int, int]]) -> None:
    """Exact mode's batch-invariant GEMM at training sizes: each schedule of :data:`EXACT_SCHEDULES` (and on the
    LM head :data:`EXACT_WIDE_SCHEDULES`), checked bitwise against the decode-sized tiles before it is timed, against the fast
    blockwise FP8 GEMM and BF16 ``torch.matmul`` of the same shape (the LM head: its bf16 exact GEMM against
    ``torch.matmul``)."""
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.gemm_exact_triton import ExactTiles, exact_fp8_gemm, exact_matmul

    for n, k in nk_list + [EXACT_LM_HEAD]:
        for m in ms_list:
            lm_head = (n, k) == EXACT_LM_HEAD
            be, (x, w, _), (qx, qw, *_rest) = _gemm_operands(m, n, k)
            if lm_head:
                exact = lambda tiles: exact_matmul(x, w, tiles=tiles)  # noqa: E731
                fast = lambda: torch.matmul(x, w.t())  # noqa: E731
            else:
                exact = lambda tiles: exact_fp8_gemm(qx.data, qx.scale, qw.data, qw.scale, 128,  # noqa: E731
                                                     tiles=tiles)
                fast = lambda: be.gemm(qx, qw)  # noqa: E731
            flop = 2.0 * m * n * k
            t_bf16 = _bench_ms(lambda: torch.matmul(x, w.t()))
            t_fast = _bench_ms(fast)
            base = None
            for name, (over, launch) in (EXACT_SCHEDULES | EXACT_WIDE_SCHEDULES if lm_head
                                         else EXACT_SCHEDULES).items():
                tiles = ExactTiles(**launch)
                try:
                    with tuning.override(**over):
                        out = exact(tiles)
                        base = out if base is None else base
                        same = bool(torch.equal(out, base))
                        t = _bench_ms(lambda: exact(tiles))
                except Exception as exc:  # a tile that does not compile (shared memory) is reported, not fatal
                    print(f"  {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                rep.add("exact-gemm", path="bf16" if lm_head else "fp8", schedule=name, m=m, n=n, k=k, ms=t,
                        tflops=flop / t / 1e9, bitwise_default=same, over_fast=t / t_fast, over_bf16=t / t_bf16,
                        fast_ms=t_fast, bf16_ms=t_bf16)


# ---- training GEMMs: cuBLAS blockwise FP8 against BF16 at the Qwen2.5 and Llama-8B linears ----

# the Qwen2.5 linears as (label, N, K): q/k/v and gate/up stacked as the models launch them
TRAIN_GEMM_SHAPES = {
    "0.5b": [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864)],
    "1.5b": [("qkv", 2048, 1536), ("o", 1536, 1536), ("gate_up", 17920, 1536), ("down", 1536, 8960)],
    "7b": [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)],
    "8b": [(label, n, k) for label, (n, k) in zip(("qkv", "o", "gate_up", "down"), LLAMA8B_NK)],
}
TRAIN_GEMM_M = 13440
# the decode section's weights: Llama-8B's linears and its k/v projections; the Qwen2.5-1.5B linears (q/k/v and
# gate/up stacked, as the training and the rollout's large-M steps launch them)
DECODE_NK = {"8b": LLAMA8B_NK + [(1024, 4096)], "1.5b": [(n, k) for _, n, k in TRAIN_GEMM_SHAPES["1.5b"]]}


def bench_train_gemms(rep: Report, models: list[str], ms: list[int] = (TRAIN_GEMM_M,)) -> None:
    """Fprop, DGrad and WGrad of each model's linears at each of ``ms`` tokens: cuBLAS's blockwise ``scaled_mm``
    and the route the backend takes (under the tuning in force: ``JETRL_FP8_GEMM``) against BF16 ``torch.matmul``,
    in TFLOP/s, and the ratio (``speedup``: BF16's time over the route's)."""
    from jetrl.quant.kernels import gemm_scaled_mm as scaled_mm
    from jetrl.quant.kernels.cuda_backend import gemm_path

    bench = lambda fn: _bench_ms(fn, warmup=5, rep=25)  # noqa: E731  (multi-millisecond GEMMs: enough reps)
    for model in models:
        for label, n, k in TRAIN_GEMM_SHAPES[model]:
            for m in ms:
                be, (x, w, dy), (qx, qw, qw_t, qdy, qdy_tok_t, qx_tok_t) = _gemm_operands(m, n, k)
                flop = 2.0 * m * n * k
                pairs = {  # (a, b, BF16 product): a @ b.T
                    "fprop": (qx, qw, lambda: torch.matmul(x, w.t())),
                    "dgrad": (qdy, qw_t, lambda: torch.matmul(dy, w)),
                    "wgrad": (qdy_tok_t, qx_tok_t, lambda: torch.matmul(dy.t(), x)),
                }
                for gemm, (a, b, bf16) in pairs.items():
                    t_cublas = bench(lambda: scaled_mm.blockwise_scaled_mm(a, b))
                    t_bf16 = bench(bf16)
                    row = dict(model=model, linear=label, gemm=gemm, m=a.shape[0], n=b.shape[0], k=a.shape[1],
                               cublas_ms=t_cublas, bf16_ms=t_bf16, cublas_tflops=flop / t_cublas / 1e9,
                               bf16_tflops=flop / t_bf16 / 1e9, cublas_speedup=t_bf16 / t_cublas)
                    route = gemm_path(a, b)
                    t_route = t_cublas if route == "cublas" else None
                    if t_route is None:
                        t_route = bench(lambda: be.gemm(a, b))
                    rep.add("gemm-train", **row, route=route, speedup=t_bf16 / t_route)
                del x, w, dy, qx, qw, qw_t, qdy, qdy_tok_t, qx_tok_t, pairs
                torch.cuda.empty_cache()


CUBLAS_INVARIANCE_M = [1, 2, 3, 4, 5, 8, 16, 17, 31, 32, 33, 48, 64, 65, 96, 100, 128, 129, 192, 255, 256, 257,
                      384, 512, 1000, 1024, 2048, 4096, 5000]


def bench_cublas_invariance(rep: Report, ms_list: list[int], nk_list: list[tuple[int, int]], rows: int = 8192) -> None:
    """Does a row of cuBLAS's product depend on M? Exact mode needs to know before it lets cuBLAS take a GEMM.

    Per (N, K): random activations (rows of different magnitudes) quantized 1x128 and a weight 128x128, with fp32
    scales and with power-of-two ones; the ``rows``-row product of cuBLAS's blockwise FP8 GEMM, then for every M of
    ``ms_list`` at row offsets 0 and 37 the M-row product against the same rows of the big one (differing
    elements, largest difference), and the same for BF16 ``torch.matmul``. Last, the Triton exact GEMM's single
    in-order K walk (``exact_split_k=1``, cuBLAS's schedule off) against cuBLAS on all rows: equal bits are what
    ``exact_cublas_min_m`` relies on."""
    from jetrl.quant.exact import exact_fp8_gemm
    from jetrl.quant.formats import ACT, WEIGHT, Fp8Tensor
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.gemm_scaled_mm import blockwise_scaled_mm
    from jetrl.quant.reference import quantize_tensor

    def differing(out: torch.Tensor, ref: torch.Tensor) -> tuple[int, float]:
        bad = out.view(torch.int16) != ref.view(torch.int16)
        return int(bad.sum()), float((out.float() - ref.float()).abs().max())

    for n, k in nk_list:
        x = torch.randn(rows + 64, k, device="cuda", dtype=torch.bfloat16)
        x = (x * torch.rand(rows + 64, 1, device="cuda") * 4).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        for scales in ("fp32", "pow2"):
            a = quantize_tensor(x, ACT, pow2_scale=scales == "pow2")
            b = quantize_tensor(w, WEIGHT, pow2_scale=scales == "pow2")
            big = blockwise_scaled_mm(Fp8Tensor(a.data[:rows], a.scale[:rows], ACT), b)
            for m in ms_list:
                for off in (0, 37):
                    out = blockwise_scaled_mm(Fp8Tensor(a.data[off:off + m], a.scale[off:off + m], ACT), b)
                    count, worst = differing(out, big[off:off + m])
                    rep.add("cublas-invariance", gemm="cublas-fp8", n=n, k=k, scales=scales, m=m, offset=off,
                            differing=count, max_abs_diff=worst)
            with tuning.override(exact_split_k=1, exact_cublas_min_m=0):
                walk = exact_fp8_gemm(Fp8Tensor(a.data[:rows], a.scale[:rows], ACT), b)
            count, worst = differing(walk, big)
            rep.add("cublas-invariance", gemm="exact-walk-vs-cublas", n=n, k=k, scales=scales, m=rows, offset=0,
                    differing=count, max_abs_diff=worst)
        big = x[:rows] @ w.t()
        for m in ms_list:
            count, worst = differing(x[:m] @ w.t(), big[:m])
            rep.add("cublas-invariance", gemm="bf16-matmul", n=n, k=k, scales="-", m=m, offset=0, differing=count,
                    max_abs_diff=worst)


def _rotation(n: int, k: int, min_bytes: int = 256 * 2 ** 20) -> int:
    """Weight copies to cycle through so that each GEMM reads its weight from HBM, as a decode step does
    (one layer after another), not from the 50 MB L2 a single repeated GEMM would hit."""
    return max(2, -(-min_bytes // (2 * n * k)))


# (block_n, split_k, num_stages, num_warps) tried at M = 64, where the default is least settled
# (block_m, block_n, warps, stages) of the blockwise Triton GEMM tried at 65-256 rows in the decode section: does
# a small tile reach DeepGEMM's latency there without DeepGEMM?
TRITON_SMALL_TILES = [(32, 64, 4, 4), (64, 64, 4, 4), (64, 64, 8, 3), (64, 128, 4, 3), (128, 64, 8, 3), (16, 64, 4, 4)]
DECODE_SWEEP = [(bn, split, stages, warps) for bn in (32, 64, 128) for split in (2, 4, 8) for stages in (2, 3, 4)
                for warps in (4, 8)]


def bench_decode(rep: Report, nk_list: list[tuple[int, int]], sweep: bool = True,
                 ms: list[int] | None = None) -> None:
    """Decode GEMMs timed as CUDA-graph replays (the rollout engine replays graphs) over rotating weight
    copies (HBM reads, as in a real step): GPU time per GEMM; DeepGEMM's too where it is installed (its kernels
    compiled ahead)."""
    from jetrl.quant.kernels import cuda_backend as cuda_mod
    from jetrl.quant.kernels import gemm_deepgemm as deepgemm
    from jetrl.quant.kernels import gemm_scaled_mm as scaled_mm
    from jetrl.quant.kernels import gemm_decode_triton as dk
    from jetrl.quant.kernels import gemm_triton
    from jetrl.quant.kernels.cuda_backend import CudaBackend
    from jetrl.quant.kernels.tuning import GEMM_CHOICES

    fp8_paths = tuple(c for c in GEMM_CHOICES if c != "auto")  # the FP8 GEMM paths "auto" routes between
    be = CudaBackend()
    with_dg = deepgemm.is_available(torch.device("cuda"))
    if with_dg:
        deepgemm.compile_kernels([deepgemm.GemmShape(m, n, k) for n, k in nk_list for m in ms or DECODE_M],
                                 torch.device("cuda"))
    for n, k in nk_list:
        copies = _rotation(n, k)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        qws = [be.quantize(w, (128, 128)) for w in ws]
        for m in ms or DECODE_M:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            qx = be.quantize(x, (1, 128))

            def per_gemm(fn):
                ms = _graph_ms(lambda: [fn(i) for i in range(copies)])
                return None if ms is None else ms * 1e3 / copies

            row = {"m": m, "n": n, "k": k, "copies": copies}
            row["bf16_us"] = per_gemm(lambda i: torch.matmul(x, ws[i].t()))
            row["cublas_us"] = per_gemm(lambda i: scaled_mm.blockwise_scaled_mm(qx, qws[i]))
            row["triton_us"] = per_gemm(lambda i: gemm_triton.blockwise_fp8_gemm(qx.data, qx.scale, qws[i].data,
                                                                                  qws[i].scale, 128))
            row["decode_us"] = per_gemm(lambda i: dk.fp8_decode_gemm(qx.data, qx.scale, qws[i].data, qws[i].scale,
                                                                      128)) if m <= 64 else None
            if with_dg:
                row["deepgemm_us"] = per_gemm(lambda i: deepgemm.gemm(qx, qws[i]))
            if sweep and m == 64:
                for bn, split, stages, warps in DECODE_SWEEP:
                    cfg = dk.DecodeGemmConfig(block_n=bn, split_k=split, num_warps=warps, num_stages=stages)
                    row[f"decode_n{bn}k{split}s{stages}w{warps}_us"] = per_gemm(
                        lambda i: dk.fp8_decode_gemm(qx.data, qx.scale, qws[i].data, qws[i].scale, 128, config=cfg))
            if m > 64:  # smaller tiles of the blockwise Triton GEMM (its default above 64 rows is 128 x 128)
                for bm, bn, warps, stages in TRITON_SMALL_TILES:
                    cfg = gemm_triton.GemmConfig(block_m=bm, block_n=bn, group_m=1, num_warps=warps,
                                                 num_stages=stages)
                    row[f"triton_m{bm}n{bn}w{warps}s{stages}_us"] = per_gemm(
                        lambda i: gemm_triton.blockwise_fp8_gemm(qx.data, qx.scale, qws[i].data, qws[i].scale, 128,
                                                                 config=cfg))
            if m > 64:  # beyond the decode path's range: is the decode kernel still competitive there?
                for bn, split, warps in ((64, 1, 8), (64, 2, 8), (128, 1, 8), (64, 4, 8)):
                    cfg = dk.DecodeGemmConfig(block_n=bn, split_k=split, num_warps=warps, num_stages=3)
                    row[f"decode_n{bn}k{split}s3w{warps}_us"] = per_gemm(
                        lambda i: dk.fp8_decode_gemm(qx.data, qx.scale, qws[i].data, qws[i].scale, 128, config=cfg))
            row["auto_path"] = cuda_mod.gemm_path(qx, qws[0])
            row["auto_us"] = per_gemm(lambda i: be.gemm(qx, qws[i]))
            row["auto_with_quant_us"] = per_gemm(lambda i: be.gemm(be.quantize(x, (1, 128)), qws[i]))
            row["speedup_auto"] = row["bf16_us"] / row["auto_us"]
            fp8 = {kk: v for kk, v in row.items() if kk.endswith("_us") and v is not None
                   and kk.startswith(fp8_paths)}
            best = min(fp8, key=fp8.get)
            row["best_fp8"] = best
            row["speedup_best_fp8"] = row["bf16_us"] / fp8[best]
            row["weight_gbps_auto"] = n * k / (row["auto_us"] * 1e3)
            row["weight_gbps_bf16"] = 2 * n * k / (row["bf16_us"] * 1e3)
            rep.add("decode", **row)
        del ws, qws
        torch.cuda.empty_cache()


# ---- decode GEMM sweep: tuning variants of the split-K decode kernel against BF16 and cuBLAS FP8 ----

DECODE_SWEEP_M = [16, 32, 64, 128, 256]
# (label, output widths sharing one input, K): the four Llama-8B linears, then the grouped launches
DECODE_SWEEP_CELLS = [("qkv", (6144,), 4096), ("o", (4096,), 4096), ("gate_up", (28672,), 4096),
                      ("down", (4096,), 14336), ("qkv-grouped", (4096, 1024, 1024), 4096),
                      ("gate_up-grouped", (14336, 14336), 4096)]
# the rollout benchmark's 1.5B shape (Qwen2-1.5B: hidden 1536, 12 query and 2 key/value heads, MLP 8960), as the
# engine launches it: q/k/v and gate/up grouped, o and down alone
DECODE_SWEEP_CELLS_1P5B = [("o", (1536,), 1536), ("down", (1536,), 8960), ("qkv-grouped", (1536, 256, 256), 1536),
                           ("gate_up-grouped", (8960, 8960), 1536)]
# Qwen2.5-0.5B (hidden 896, 14 query and 2 key/value heads of 64, MLP 4864) and Qwen2.5-7B (hidden 3584, 28 and 4
# heads of 128, MLP 18944), launched likewise
DECODE_SWEEP_CELLS_0P5B = [("o", (896,), 896), ("down", (896,), 4864), ("qkv-grouped", (896, 128, 128), 896),
                           ("gate_up-grouped", (4864, 4864), 896)]
DECODE_SWEEP_CELLS_7B = [("o", (3584,), 3584), ("down", (3584,), 18944), ("qkv-grouped", (3584, 512, 512), 3584),
                         ("gate_up-grouped", (18944, 18944), 3584)]
DECODE_SWEEP_SHAPES = {"8b": DECODE_SWEEP_CELLS, "1.5b": DECODE_SWEEP_CELLS_1P5B, "0.5b": DECODE_SWEEP_CELLS_0P5B,
                       "7b": DECODE_SWEEP_CELLS_7B}


def decode_sweep_policies(m: int) -> list:
    """Variants of the default policy for ``m`` rows, most promising first (the sweep stops when its time
    budget runs out, after the same variants for every shape)."""
    from dataclasses import replace

    from jetrl.quant.kernels import tuning

    base = tuning.current().decode_policy(m)
    if m <= 64:
        kws = [{}, dict(tma=True), dict(k_unroll=2), dict(tma=True, k_unroll=2),
               dict(block_n=128, num_warps=8, tma=True, k_unroll=2), dict(block_n=128, num_warps=8),
               dict(tma=True, num_stages=4), dict(num_warps=8, tma=True),
               dict(programs_per_sm=base.programs_per_sm * 2, tma=True),
               dict(programs_per_sm=base.programs_per_sm / 2, tma=True),
               dict(block_n=128, num_warps=4, tma=True, k_unroll=2), dict(block_n=32, tma=True, k_unroll=2)]
    else:
        kws = [{}, dict(tma=True), dict(tma=True, k_unroll=2), dict(block_n=128, tma=True, k_unroll=2),
               dict(block_n=128), dict(block_m=64, num_warps=4, tma=True), dict(programs_per_sm=2.0, tma=True),
               dict(block_n=256, tma=True), dict(tma=True, num_stages=4), dict(block_m=128, block_n=128, tma=True)]
    return [replace(base, **kw) for kw in kws]


def _replay_us(calls: list, reps: int = 20) -> float | None:
    """GPU time per call: ``calls`` (one per rotating weight copy) captured in one CUDA graph, the median of
    ``reps`` timed replays divided by the number of calls; ``None`` if the path fails or cannot be captured."""
    try:
        for c in calls:  # compile / allocate outside the graph
            c()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        times = sorted(start.elapsed_time(end) for start, end in events)
        del graph
        return times[len(times) // 2] * 1e3 / len(calls)
    except Exception as exc:
        print(f"  (failed: {type(exc).__name__}: {str(exc)[:160]})", flush=True)
        torch.cuda.synchronize()
        return None


def _operand_layout(t: torch.Tensor) -> list:
    return [list(t.shape), list(t.stride())]


def _decode_precompile_worker(specs_json: str) -> None:
    """Compile the decode-kernel variants of ``specs_json`` (run in a child process: many at once fill the
    Triton cache that the timing process then reads). Operands are uninitialized tensors with the measured
    runs' shapes and strides, which is all the compiled kernel is specialized on."""
    from jetrl.quant.kernels import gemm_decode_triton as dk

    def empty(layout, dtype):
        return torch.empty_strided(layout[0], layout[1], dtype=dtype, device="cuda")

    cache: dict = {}
    for spec in json.loads(specs_json):
        key = json.dumps(spec["operands"])
        if key not in cache:
            ops = spec["operands"]
            a = empty(ops["a"], torch.uint8).view(torch.float8_e4m3fn)
            a_s = empty(ops["a_scale"], torch.float32)
            ws = [(empty(w, torch.uint8).view(torch.float8_e4m3fn), empty(s, torch.float32), None)
                  for w, s in zip(ops["w"], ops["w_scale"])]
            cache = {key: (a, a_s, ws)}  # one shape's operands at a time
        a, a_s, ws = cache[key]
        cfg = dk.DecodeGemmConfig(**spec["config"])
        try:
            if len(ws) == 1:
                dk.fp8_decode_gemm(a, a_s, ws[0][0], ws[0][1], 128, config=cfg)
            else:
                dk.fp8_decode_gemm_grouped(a, a_s, ws, config=cfg)
        except Exception as exc:
            print(f"precompile {cfg.name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
    torch.cuda.synchronize()


def _start_precompile(specs: list, workers: int) -> list:
    """Child processes compiling ``specs`` round-robin (each in priority order); returned running."""
    import os
    import subprocess
    from pathlib import Path

    if not specs or workers < 1:
        return []
    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; import kernels; "
            "kernels._decode_precompile_worker(sys.stdin.read())")
    procs = []
    for i in range(min(workers, len(specs))):
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True, env=dict(os.environ))
        proc.stdin.write(json.dumps(specs[i::workers]))
        proc.stdin.close()
        procs.append(proc)
    return procs


def _wait_precompile(procs: list, deadline: float) -> None:
    import subprocess
    import time

    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:  # out of time: the timing process compiles what is missing itself
            proc.kill()
            proc.wait()


def bench_decode_sweep(rep: Report, budget_s: float = 100.0, ms: list[int] | None = None,
                       workers: int | None = None, shape: str = "8b") -> None:
    """Tuning variants of the split-K decode kernel per shape and row count against BF16 ``torch.matmul`` (a
    grouped cell's over the stacked weight, as ``bf16``'s decode step runs q/k/v and gate/up) and cuBLAS
    blockwise FP8 in the same run (CUDA-graph replays over rotating weight copies, as
    :func:`bench_decode`), then per row count the policy that is best across shapes (to paste into
    ``DECODE_POLICIES`` of ``jetrl.quant.kernels.tuning``) and where the decode kernel beats cuBLAS (the
    tuning object's routing bounds).

    Variants are compiled ahead by child processes, then timed variant by variant across all shapes until
    ``budget_s`` (counted from the start of this function) runs out."""
    import math
    import os
    import time
    from dataclasses import replace

    from jetrl.quant.kernels import cuda_backend as cuda_mod
    from jetrl.quant.kernels import gemm_decode_triton as dk
    from jetrl.quant.kernels import gemm_scaled_mm as scaled_mm
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.cuda_backend import CudaBackend

    t0 = time.perf_counter()
    be = CudaBackend()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ms = ms or DECODE_SWEEP_M
    sweep_cells = DECODE_SWEEP_SHAPES[shape]
    cells = []
    for label, ns, k in sweep_cells:
        copies = _rotation(sum(ns), k)
        ws = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n in ns] for _ in range(copies)]
        qws = [[be.quantize(w, (128, 128)) for w in group] for group in ws]
        bf16_ws = [[torch.cat(group)] for group in ws] if len(ns) > 1 else ws
        # the members' 128-row blocks stack whole (q/k/v and gate/up widths are multiples of 128)
        stacked_qws = [[be.quantize(w, (128, 128)) for w in group] for group in bf16_ws] if len(ns) > 1 else qws
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cells.append(dict(label=label, ns=ns, k=k, m=m, copies=copies, ws=ws, bf16_ws=bf16_ws, qws=qws,
                              stacked_qws=stacked_qws, x=x,
                              qx=be.quantize(x, (1, 128)), times={}, ok={}, policy_us={}))
    policies = {m: decode_sweep_policies(m) for m in ms}
    specs = []
    for pi in range(max(len(p) for p in policies.values())):
        for cell in cells:
            if pi < len(policies[cell["m"]]):
                cfg = policies[cell["m"]][pi].config(cell["m"], sum(cell["ns"]), cell["k"], sms)
                qx, qw = cell["qx"], cell["qws"][0]
                ops = dict(a=_operand_layout(qx.data), a_scale=_operand_layout(qx.scale),
                           w=[_operand_layout(w.data) for w in qw], w_scale=[_operand_layout(w.scale) for w in qw])
                specs.append(dict(operands=ops, config=asdict(cfg)))
    workers = workers if workers is not None else max(1, min(12, (os.cpu_count() or 2) - 2))
    procs = _start_precompile(specs, workers)
    print(f"[decode-sweep] {len(cells)} cells, {len(specs)} variant launches compiling in {len(procs)} processes",
          flush=True)

    def calls_for(cell, fn):
        return [lambda i=i: fn(cell, i) for i in range(cell["copies"])]

    def bf16(cell, i):  # a grouped cell as `bf16`'s decode step runs it: one GEMM over the stacked weight
        return [torch.matmul(cell["x"], w.t()) for w in cell["bf16_ws"][i]]

    def cublas(cell, i):  # a grouped cell as the engine runs it above the decode bound: one GEMM, stacked weight
        return [scaled_mm.blockwise_scaled_mm(cell["qx"], w) for w in cell["stacked_qws"][i]]

    def auto(cell, i):
        qws = cell["qws"][i]
        out = be.grouped_gemm(cell["qx"], qws, [None] * len(qws)) if len(qws) > 1 else None
        return out if out is not None else [be.gemm(cell["qx"], w) for w in cell["stacked_qws"][i]]

    def decode(cfg):
        def run(cell, i):
            qx, qws = cell["qx"], cell["qws"][i]
            if len(qws) == 1:
                return dk.fp8_decode_gemm(qx.data, qx.scale, qws[0].data, qws[0].scale, 128, config=cfg)
            return dk.fp8_decode_gemm_grouped(qx.data, qx.scale, [(w.data, w.scale, None) for w in qws], config=cfg)
        return run

    for cell in cells:  # the baselines (no Triton compiles) while the variants compile
        cell["bf16_us"] = _replay_us(calls_for(cell, bf16))
        cell["cublas_us"] = _replay_us(calls_for(cell, cublas))
        cell["ref"] = torch.cat(cublas(cell, 0), dim=1).float()
    _wait_precompile(procs, t0 + 0.6 * budget_s)
    print(f"[decode-sweep] compiled after {time.perf_counter() - t0:.0f} s", flush=True)
    for cell in cells:
        qws = cell["qws"][0]
        cell["auto_path"] = cuda_mod.gemm_path(cell["qx"], qws[0], grouped_n=sum(cell["ns"]) if len(qws) > 1 else None)
        cell["auto_us"] = _replay_us(calls_for(cell, auto))
    measured = {m: 0 for m in ms}  # how many policies (in order) every cell of this M has measured
    stop = False
    for pi in range(max(len(p) for p in policies.values())):
        for cell in cells:
            m = cell["m"]
            if pi >= len(policies[m]):
                continue
            if time.perf_counter() - t0 > budget_s:
                stop = True
                break
            cfg = policies[m][pi].config(m, sum(cell["ns"]), cell["k"], sms)
            if cfg.name not in cell["times"]:
                try:
                    out = decode(cfg)(cell, 0)
                except Exception as exc:  # e.g. a tile that does not fit in shared memory at this M
                    print(f"[decode-sweep] {cell['label']} M={m} {cfg.name}: {type(exc).__name__}", flush=True)
                    cell["ok"][cfg.name], cell["times"][cfg.name] = False, None
                    cell.setdefault("failed", []).append(cfg.name)
                else:
                    rel = float((out.float() - cell["ref"]).norm() / cell["ref"].norm())
                    cell["ok"][cfg.name] = bool(rel < 1e-2)  # vs cuBLAS ~1e-3 (summation order); broken ~1
                    cell["times"][cfg.name] = _replay_us(calls_for(cell, decode(cfg)))
            cell["policy_us"][pi] = cell["times"][cfg.name] if cell["ok"][cfg.name] else None
        if stop:
            print(f"[decode-sweep] time budget of {budget_s:.0f} s reached at variant {pi}", flush=True)
            break
        for m in ms:
            if pi < len(policies[m]):
                measured[m] = pi + 1
    for cell in cells:
        ok_times = {name: t for name, t in cell["times"].items() if t is not None and cell["ok"][name]}
        best = min(ok_times, key=ok_times.get) if ok_times else None
        n, bf = sum(cell["ns"]), cell["bf16_us"]
        default = cell.get("policy_us", {}).get(0)
        row = dict(cell=cell["label"], m=cell["m"], n=n, k=cell["k"], bf16_us=bf, cublas_us=cell["cublas_us"],
                   auto_path=cell["auto_path"], auto_us=cell["auto_us"], default_us=default, best=best,
                   best_us=ok_times.get(best))
        ratio = lambda t: (bf / t) if (bf and t) else None  # noqa: E731
        row.update(cublas_x=ratio(cell["cublas_us"]), auto_x=ratio(cell["auto_us"]), default_x=ratio(default),
                   best_x=ratio(row["best_us"]),
                   best_frac_copy=(n * cell["k"] / (row["best_us"] * 1e3) / rep.copy_gbps)
                   if row["best_us"] and rep.copy_gbps else None,
                   failed=cell.get("failed", []),  # raised (e.g. tiles beyond shared memory): not timed
                   broken=[name for name, good in cell["ok"].items()
                           if not good and name not in cell.get("failed", [])],
                   variants={name: t for name, t in cell["times"].items()})
        rep.add("decode-sweep", **row)
    print("\n== decode sweep: per shape, best decode config vs BF16 (x = BF16 time / time) ==")
    for row in rep.sections.get("decode-sweep", []):
        print(f"{row['cell']:>16} M={row['m']:<4} bf16 {_fmt(row['bf16_us'])} us | cuBLAS FP8 {_fmt(row['cublas_x'])}x"
              f" | auto({row['auto_path']}) {_fmt(row['auto_x'])}x | default {_fmt(row['default_x'])}x"
              f" | best {row['best']} {_fmt(row['best_us'])} us {_fmt(row['best_x'])}x"
              f" ({_fmt(row['best_frac_copy'])} of copy)"
              + (f" WRONG RESULTS: {row['broken']}" if row["broken"] else "")
              + (f" (did not run: {len(row['failed'])} variants)" if row["failed"] else ""))
    print("\n== decode sweep: policy per M (geometric mean over shapes of time / that shape's best; 1.0 = best "
          "everywhere) ==")
    chosen = {}
    for m in ms:
        mcells = [c for c in cells if c["m"] == m]
        scores = []
        for pi in range(measured[m]):
            ts = [c["policy_us"].get(pi) for c in mcells]
            bests = [min(t for t in c["policy_us"].values() if t is not None) if any(
                t is not None for t in c["policy_us"].values()) else None for c in mcells]
            if all(t is not None for t in ts) and all(b is not None for b in bests):
                scores.append((math.exp(sum(math.log(t / b) for t, b in zip(ts, bests)) / len(ts)), pi))
        scores.sort()
        for score, pi in scores[:3]:
            print(f"M={m}: {score:.3f}  {replace(policies[m][pi], max_m=m)!r}")
        if scores:
            chosen[m] = scores[0][1]
    print("\n== decode sweep: routing (the chosen policy per M against cuBLAS FP8, grouped cells: one call over the "
          "stacked weight) ==")
    for label, ns, k in sweep_cells:
        wins = []
        for m in ms:
            cell = next(c for c in cells if c["label"] == label and c["m"] == m)
            t = cell["policy_us"].get(chosen.get(m, -1)) if m in chosen else None
            wins.append((m, t is not None and cell["cublas_us"] is not None and t < cell["cublas_us"], t,
                         cell["cublas_us"]))
        bound = 0
        for m, win, _, _ in wins:
            if not win:
                break
            bound = m
        key = ("grouped", sum(ns), k) if len(ns) > 1 else (sum(ns), k)
        detail = ", ".join(f"M={m}: {_fmt(t)} vs {_fmt(c)} us" for m, _, t, c in wins)
        general = max(tuning.current().decode_max_m, tuning.current().grouped_decode_max_m if len(ns) > 1 else 0)
        hint = f"; set DECODE_MAX_M_BY_SHAPE[{key!r}] = {bound} in tuning.py" if bound > general else ""
        print(f"{label:>16}: the decode kernel beats cuBLAS through M={bound}{hint}   ({detail})")
    rep.sections.setdefault("decode-sweep-policy", []).extend(
        {"m": m, "policy": repr(replace(policies[m][pi], max_m=m))} for m, pi in chosen.items())


SAMPLER_CELLS = [(rows, vocab, t) for vocab in (32000, 151936) for rows in (1, 16, 64, 256) for t in (1.0,)] + [
    (256, 151936, 0.7)]


def bench_sampler(rep: Report) -> None:
    """The seeded sampler of a decode step: (rows, vocab, temperature) cells, every row seeded."""
    from jetrl.quant.kernels.sampling_triton import seeded_sample
    from jetrl.rollout.sampling import SamplingBatch, SamplingParams, sample

    for rows, vocab, temp in SAMPLER_CELLS:
        logits = (torch.randn(rows, vocab, device="cuda") * 3).to(torch.bfloat16)
        batch = SamplingBatch.build([SamplingParams(temperature=temp, seed=17 + i) for i in range(rows)],
                                    [0] * rows, list(range(rows)), "cuda")
        args = (batch.temperature, batch.seed_lo, batch.seed_hi, batch.sample_index, batch.position)
        row = {"rows": rows, "vocab": vocab, "temperature": temp}
        for name, fn in (("kernel", lambda: seeded_sample(logits, *args)),
                         ("exact_tiles", lambda: seeded_sample(logits, *args, exact_tiles=True)),
                         ("tensor_ops", lambda: sample(logits, batch, impl="reference"))):
            ms = _graph_ms(fn)
            row[f"{name}_us"] = None if ms is None else ms * 1e3
        row["same_tokens"] = bool(torch.equal(seeded_sample(logits, *args)[0], sample(logits, batch,
                                                                                         impl="reference")[0]))
        row["kernel_copy_share"] = 2 * rows * vocab / (row["kernel_us"] * 1e3) / rep.copy_gbps
        rep.add("sampler", **row)
        print(f"sampler {rows} x {vocab} T={temp}: kernel {_fmt(row['kernel_us'])} us, exact tiles "
              f"{_fmt(row['exact_tiles_us'])} us, tensor ops {_fmt(row['tensor_ops_us'])} us, "
              f"same tokens {row['same_tokens']}", flush=True)


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, gy: torch.Tensor):
    def step():
        xi = x.detach().requires_grad_()
        layer(xi).backward(gy)

    return step


def bench_fp8_linear(rep: Report, ms_list: list[int], nk_list: list[tuple[int, int]]) -> None:
    from jetrl.quant import FP8Linear

    for n, k in nk_list:
        for m in ms_list:
            ref = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            fp8 = FP8Linear.from_linear(ref)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            tb = _bench_ms(_fwd_bwd(ref, x, gy))
            t8 = _bench_ms(_fwd_bwd(fp8, x, gy))  # weight quantized once (unchanged weight)
            fp8_requant = FP8Linear.from_linear(ref)  # the same step re-quantizing W (after an optimizer step)

            def requant_step():
                fp8_requant.invalidate_weight_cache()
                _fwd_bwd(fp8_requant, x, gy)()

            t8q = _bench_ms(requant_step)
            gb, g8 = _graph_ms(_fwd_bwd(ref, x, gy)), _graph_ms(_fwd_bwd(fp8, x, gy))
            rep.add("fp8linear", m=m, n=n, k=k, bf16_ms=tb, fp8_ms=t8, fp8_requant_w_ms=t8q, speedup=tb / t8,
                    speedup_requant_w=tb / t8q, graph_bf16_ms=gb, graph_fp8_ms=g8,
                    graph_speedup=(gb / g8) if gb and g8 else None,
                    cpu_us_bf16=_cpu_us(_fwd_bwd(ref, x, gy)), cpu_us_fp8=_cpu_us(_fwd_bwd(fp8, x, gy)))
            ref.weight.grad = None


def bench_host_overhead(rep: Report) -> None:
    """Host time to enqueue single operations (what an eager step pays per launch)."""
    from jetrl.quant.kernels import gemm_triton
    from jetrl.quant.kernels import quantize_triton as tk
    from jetrl.quant.kernels.cuda_backend import CudaBackend

    be = CudaBackend()
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    qx, qw = be.quantize(x, (1, 128)), be.quantize(w, (128, 128))
    cases = {
        "torch.empty": lambda: torch.empty(256, 1024, device="cuda"),
        "bf16 matmul": lambda: torch.matmul(x, w.t()),
        "triton quantize_act_1x128": lambda: tk.quantize_act_1x128(x),
        "backend.quantize ACT": lambda: be.quantize(x, (1, 128)),
        "backend.gemm (cuBLAS path)": lambda: be.gemm(qx, qw),
        "triton blockwise_fp8_gemm": lambda: gemm_triton.blockwise_fp8_gemm(qx.data, qx.scale, qw.data, qw.scale,
                                                                             128),
    }
    for name, fn in cases.items():
        rep.add("host", op=name, us=_cpu_us(fn, iters=200))


def _warm_fp8_linear_step(m: int, n: int, k: int):
    """One FP8Linear forward+backward step (an (m, k) input, an (n, k) weight), already run a few times."""
    from jetrl.quant import FP8Linear

    layer = FP8Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    step = _fwd_bwd(layer, x, gy)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return step


def profile_fp8_linear(m: int = 4096, n: int = 4096, k: int = 4096) -> None:
    """Where one FP8Linear forward+backward spends host and device time (top ops)."""
    from torch.profiler import ProfilerActivity, profile

    step = _warm_fp8_linear_step(m, n, k)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def profile_fp8_linear_host(m: int = 4096, n: int = 4096, k: int = 4096, iters: int = 100) -> None:
    """Python-level profile (cProfile) of the host work of FP8Linear forward+backward steps: which calls
    the eager path's host time goes to (the GPU work is not waited for inside the loop)."""
    import cProfile
    import pstats

    step = _warm_fp8_linear_step(m, n, k)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        step()
    prof.disable()
    torch.cuda.synchronize()
    print(f"== host profile: FP8Linear {m}x{n}x{k} forward+backward, {iters} steps (times are totals) ==")
    stats = pstats.Stats(prof).strip_dirs()
    stats.sort_stats("tottime").print_stats(22)
    stats.sort_stats("cumulative").print_stats(22)


class _Mlp(nn.Module):
    """jetrl's own MLP block: the fused norm (+ residual add, + FP8 input), gate/up, fused SwiGLU (+ FP8
    input of down), down; the residual stream comes back as ``mlp_out + residual`` like a decoder block's."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        from jetrl.models.config import DecoderConfig
        from jetrl.models.transformer import MLP, RMSNorm

        cfg = DecoderConfig.from_hf(dict(model_type="llama", vocab_size=256, hidden_size=dim, intermediate_size=hidden,
                                         num_hidden_layers=1, num_attention_heads=dim // 128,
                                         num_key_value_heads=dim // 128))
        self.norm = RMSNorm(dim, 1e-5, device="cuda", dtype=torch.bfloat16)
        self.mlp = MLP(cfg, device="cuda", dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from jetrl.quant import fp8_input_scaling

        normed = self.norm.fused(x, None, fp8_input_scaling(*self.mlp.input_projections()))
        return x + self.mlp(normed.out, normed.out_fp8)


def bench_mlp(rep: Report, ms_list: list[int], dim: int = 4096, hidden: int = 14336) -> None:
    from jetrl.quant import apply_recipe

    for m in ms_list:
        model = _Mlp(dim, hidden)
        x = torch.randn(m, dim, device="cuda", dtype=torch.bfloat16)
        gy = torch.randn(m, dim, device="cuda", dtype=torch.bfloat16)
        tb, gb = _bench_ms(_fwd_bwd(model, x, gy)), _graph_ms(_fwd_bwd(model, x, gy))
        apply_recipe(model, "jet")
        tj, gj = _bench_ms(_fwd_bwd(model, x, gy)), _graph_ms(_fwd_bwd(model, x, gy))
        rep.add("mlp", m=m, dim=dim, hidden=hidden, bf16_ms=tb, jet_ms=tj, speedup=tb / tj, graph_bf16_ms=gb,
                graph_jet_ms=gj, graph_speedup=(gb / gj) if gb and gj else None)


def main(argv: list[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="M in {4096, 16384} and fewer shapes")
    parser.add_argument("--json", default=None, help="write all rows to this JSON file")
    parser.add_argument("--sections", default="quant,gemm,decode,fp8linear,host,mlp")
    parser.add_argument("--profile", action="store_true", help="print a profile of one FP8Linear step")
    parser.add_argument("--decode-shape", choices=sorted(DECODE_NK), default="8b",
                        help="the weights of the decode section")
    parser.add_argument("--decode-m", default=",".join(str(m) for m in DECODE_M),
                        help="row counts of the decode section (up to 256)")
    parser.add_argument("--sweep-seconds", type=float, default=100.0, help="time budget of the decode sweep")
    parser.add_argument("--sweep-shape", choices=sorted(DECODE_SWEEP_SHAPES), default="8b",
                        help="model whose linears the decode sweep measures")
    parser.add_argument("--sweep-m", default=",".join(str(m) for m in DECODE_SWEEP_M),
                        help="row counts of the decode sweep (up to 256)")
    parser.add_argument("--exact-m", default="8192", help="row counts of the exact-gemm section")
    parser.add_argument("--train-m", default=str(TRAIN_GEMM_M),
                        help="token counts of the gemm-train section (multiples of 128: WGrad contracts over whole "
                             "128-token blocks, as the training step pads them)")
    parser.add_argument("--train-models", default=",".join(TRAIN_GEMM_SHAPES),
                        help=f"models whose linears the gemm-train section times ({', '.join(TRAIN_GEMM_SHAPES)})")
    args = parser.parse_args(argv)
    if any(int(v) % 128 for v in args.train_m.split(",")):
        parser.error(f"--train-m takes multiples of 128, got {args.train_m}")
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU; nothing measured", file=sys.stderr)
        return Report()
    import triton

    torch.manual_seed(0)
    rep = Report(device=torch.cuda.get_device_name(), torch_version=torch.__version__,
                 triton_version=triton.__version__)
    rep.copy_gbps = _copy_bandwidth()
    print(f"device {rep.device}, torch {rep.torch_version}, triton {rep.triton_version}, "
          f"copy {rep.copy_gbps:.0f} GB/s", flush=True)
    train_m = [4096, 16384] if args.quick else TRAIN_M
    sections = args.sections.split(",")
    runs = [
        ("quant", lambda: bench_quantization(rep, [(4096, 4096), (16384, 4096), (4096, 14336), (16384, 14336)])),
        ("quant-sweep", lambda: bench_quant_sweep(rep, [(4096, 4096), (16384, 4096), (4096, 14336), (16384, 14336)])),
        ("gemm", lambda: bench_gemms(rep, train_m, LLAMA8B_NK)),
        ("decode", lambda: bench_decode(rep, DECODE_NK[args.decode_shape],
                                        ms=[int(m) for m in args.decode_m.split(",")])),
        ("decode-sweep", lambda: bench_decode_sweep(rep, budget_s=args.sweep_seconds,
                                                            ms=[int(m) for m in args.sweep_m.split(",")],
                                                            shape=args.sweep_shape)),
        ("exact-gemm", lambda: bench_exact_gemm(rep, [int(m) for m in args.exact_m.split(",")], LLAMA8B_NK)),
        ("gemm-train", lambda: bench_train_gemms(rep, args.train_models.split(","),
                                                         [int(v) for v in args.train_m.split(",")])),
        ("cublas-invariance", lambda: bench_cublas_invariance(rep, CUBLAS_INVARIANCE_M, LLAMA8B_NK)),
        ("sampler", lambda: bench_sampler(rep)),
        ("fp8linear", lambda: bench_fp8_linear(rep, [4096, 16384], LLAMA8B_NK)),
        ("host", lambda: bench_host_overhead(rep)),
        ("profile", profile_fp8_linear),
        ("host-profile", profile_fp8_linear_host),
        ("mlp", lambda: bench_mlp(rep, [4096, 16384] if args.quick else [1024, 4096, 16384])),
    ]
    try:
        for name, run in runs:
            if name in sections or (name == "profile" and args.profile):
                try:
                    run()
                except Exception:  # one broken section must not hide the others' numbers
                    print(f"section {name} failed:\n{traceback.format_exc()}", flush=True)
                    rep.sections.setdefault("errors", []).append({"section": name})
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(asdict(rep), f, indent=1)
        _print_summary(rep)
    return rep


def _print_summary(rep: Report) -> None:
    print("\n== summary (medians) ==")
    for row in rep.sections.get("gemm", []):
        if row["gemm"] == "fprop" and row["m"] >= 4096:
            print(f"fprop M={row['m']} N={row['n']} K={row['k']}: {row['speedup']:.2f}x")
    for row in rep.sections.get("fp8linear", []):
        print(f"FP8Linear M={row['m']} N={row['n']} K={row['k']}: eager {row['speedup']:.2f}x, "
              f"graph {_fmt(row['graph_speedup'])}x, host us/step bf16 {row['cpu_us_bf16']:.0f} fp8 {row['cpu_us_fp8']:.0f}")
    for row in rep.sections.get("mlp", []):
        print(f"MLP M={row['m']}: eager {row['speedup']:.2f}x, graph {_fmt(row['graph_speedup'])}x")
    for row in rep.sections.get("decode", []):
        print(f"decode M={row['m']} N={row['n']} K={row['k']}: auto({row['auto_path']}) {row['speedup_auto']:.2f}x, "
              f"best {row['best_fp8']} {row['speedup_best_fp8']:.2f}x")
    for row in rep.sections.get("exact-gemm", []):
        print(f"exact {row['path']} M={row['m']} N={row['n']} K={row['k']} {row['schedule']}: {row['ms']:.3f} ms, "
              f"{row['over_fast']:.2f}x fast, {row['over_bf16']:.2f}x bf16, bitwise {row['bitwise_default']}")
    for row in rep.sections.get("gemm-train", []):
        print(f"gemm-train {row['model']} {row['linear']} {row['gemm']} M={row['m']} N={row['n']} K={row['k']}: "
              f"cuBLAS {row['cublas_tflops']:.0f} TFLOP/s, BF16 {row['bf16_tflops']:.0f} TFLOP/s"
              + f"; route {row['route']} {row['speedup']:.2f}x BF16")
    groups: dict = {}
    for row in rep.sections.get("cublas-invariance", []):
        key = (row["gemm"], row["n"], row["k"], row["scales"])
        groups.setdefault(key, [])
        if row["differing"]:
            groups[key].append(f"M={row['m']}@{row['offset']}: {row['differing']} ({row['max_abs_diff']:.3g})")
    for (gemm, n, k, scales), bad in groups.items():
        print(f"rows bitwise across M: {gemm} N={n} K={k} scales {scales}: "
              + ("all equal" if not bad else "differ at " + "; ".join(bad)))
    for row in rep.sections.get("host", []):
        print(f"host {row['op']}: {row['us']:.1f} us")
    for row in rep.sections.get("quant", []):
        print(f"quant {row['kernel']} {row['shape']}: {row['frac_copy']:.2f} of copy")
    for row in rep.sections.get("quant-sweep-best", []):
        print(f"quant-sweep best over shapes: {row['kernel']}: {row['config']} (geomean {row['geomean_frac_copy']:.2f} "
              f"of copy; per shape {row['per_shape']})")


if __name__ == "__main__":
    main()
