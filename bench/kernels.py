"""FP8 kernel benchmarks at Llama-3.1-8B shapes on one Hopper GPU: every ratio against BF16 in the same run.

Sections (medians of ``triton.testing.do_bench``, L2 flushed between repetitions):

1. quantization kernels: achieved bandwidth as a fraction of a measured device-to-device copy;
2. pre-quantized GEMMs (Fprop, DGrad, WGrad) in FP8 vs BF16 ``torch.matmul``, TFLOP/s;
3. ``FP8Linear`` forward+backward, quantization included, vs BF16 ``nn.Linear``;
4. an MLP block (RMSNorm, gate_up, SwiGLU, down) forward+backward, recipe ``jet`` vs BF16;
5. decode-size GEMMs (M = 1..64) FP8 vs BF16, per GEMM path.

Run: ``python bench/kernels.py [--quick] [--json PATH]``.
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
TOKEN_TILES = [(128, 4), (64, 4), (64, 8), (32, 4), (32, 2)]  # (block_k, num_warps) tried for the 128x1 kernels


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


def _bench_ms(fn) -> float:
    """Eager median: CPU launch overhead shows up whenever the GPU waits for it."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


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
    from jetrl.quant import triton_kernels as tk

    for m, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        q, s = tk.quantize_act_1x128(x)
        kb, mb = -(-k // 128), -(-m // 128)
        cases = {
            # name: (fn, bytes moved)
            "act 1x128": (lambda: tk.quantize_act_1x128(x), 2 * m * k + m * k + 4 * m * kb),
        }
        for t_in in (True, False):
            tag = "" if t_in == tk.TRANSPOSE_INPUT else " [transpose E4M3 out]" if not t_in else " [transpose in]"
            cases.update({
                "act 1x128 + 128x1" + tag: (lambda t=t_in: tk.quantize_act_1x128(x, emit_token=True, transpose_input=t),
                                            2 * m * k + 2 * m * k + 4 * (m * kb + mb * k)),
                "token 128x1" + tag: (lambda t=t_in: tk.quantize_token_128x1(x, transpose_input=t),
                                      2 * m * k + m * k + 4 * mb * k),
                "requant 1x128->128x1" + tag: (lambda t=t_in: tk.requantize_act_to_token(q, s, transpose_input=t),
                                               2 * m * k + 4 * (m * kb + mb * k)),
                "weight 128x128 + W^T" + tag: (lambda t=t_in: tk.quantize_weight_128x128(x, emit_t=True,
                                                                                       transpose_input=t),
                                               2 * m * k + 2 * m * k),
            })
        for bk, warps in TOKEN_TILES:  # the 128x1 kernels' tile sweep (both transposition strategies)
            for t_in in (True, False):
                tag = f" [bk{bk} w{warps} {'T_in' if t_in else 'T_out'}]"
                cases["token 128x1" + tag] = (
                    lambda b=bk, w=warps, t=t_in: tk.quantize_token_128x1(x, transpose_input=t, block_k=b, num_warps=w),
                    2 * m * k + m * k + 4 * mb * k)
                cases["requant 1x128->128x1" + tag] = (
                    lambda b=bk, w=warps, t=t_in: tk.requantize_act_to_token(q, s, transpose_input=t, block_k=b,
                                                                            num_warps=w),
                    2 * m * k + 4 * (m * kb + mb * k))
        for name, (fn, nbytes) in cases.items():
            ms = _graph_ms(fn) or _bench_ms(fn)
            gbps = nbytes / ms / 1e6
            rep.add("quant", kernel=name, shape=f"{m}x{k}", us=ms * 1e3, gbps=gbps, frac_copy=gbps / rep.copy_gbps)


def _gemm_operands(m: int, n: int, k: int):
    from jetrl.quant.cuda import CudaBackend

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


def _rotation(n: int, k: int, min_bytes: int = 256 * 2 ** 20) -> int:
    """Weight copies to cycle through so that each GEMM reads its weight from HBM, as a decode step does
    (one layer after another), not from the 50 MB L2 a single repeated GEMM would hit."""
    return max(2, -(-min_bytes // (2 * n * k)))


# (block_n, split_k, num_stages, num_warps) tried at M = 64, where the default is least settled
DECODE_SWEEP = [(bn, split, stages, warps) for bn in (32, 64, 128) for split in (2, 4, 8) for stages in (2, 3, 4)
                for warps in (4, 8)]


def bench_decode(rep: Report, nk_list: list[tuple[int, int]], sweep: bool = True,
                 ms: list[int] | None = None) -> None:
    """Decode GEMMs timed as CUDA-graph replays (the rollout engine replays graphs) over rotating weight
    copies (HBM reads, as in a real step): GPU time per GEMM."""
    from jetrl.quant import cuda as cuda_mod
    from jetrl.quant import scaled_mm
    from jetrl.quant import decode_gemm_triton as dk
    from jetrl.quant import triton_kernels as tk
    from jetrl.quant.cuda import CudaBackend

    be = CudaBackend()
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
            row["triton_us"] = per_gemm(lambda i: tk.blockwise_fp8_gemm(qx.data, qx.scale, qws[i].data,
                                                                         qws[i].scale, 128))
            row["decode_us"] = per_gemm(lambda i: dk.fp8_decode_gemm(qx.data, qx.scale, qws[i].data, qws[i].scale,
                                                                      128)) if m <= 64 else None
            if sweep and m == 64:
                for bn, split, stages, warps in DECODE_SWEEP:
                    cfg = dk.DecodeGemmConfig(block_n=bn, split_k=split, num_warps=warps, num_stages=stages)
                    row[f"decode_n{bn}k{split}s{stages}w{warps}_us"] = per_gemm(
                        lambda i: dk.fp8_decode_gemm(qx.data, qx.scale, qws[i].data, qws[i].scale, 128, config=cfg))
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
                   and kk.startswith(("cublas", "triton", "decode"))}
            best = min(fp8, key=fp8.get)
            row["best_fp8"] = best
            row["speedup_best_fp8"] = row["bf16_us"] / fp8[best]
            row["weight_gbps_auto"] = n * k / (row["auto_us"] * 1e3)
            row["weight_gbps_bf16"] = 2 * n * k / (row["bf16_us"] * 1e3)
            rep.add("decode", **row)
        del ws, qws
        torch.cuda.empty_cache()


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
    from jetrl.quant import triton_kernels as tk
    from jetrl.quant.cuda import CudaBackend

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
        "triton blockwise_fp8_gemm": lambda: tk.blockwise_fp8_gemm(qx.data, qx.scale, qw.data, qw.scale, 128),
    }
    for name, fn in cases.items():
        rep.add("host", op=name, us=_cpu_us(fn, iters=200))


def profile_fp8_linear(m: int = 4096, n: int = 4096, k: int = 4096) -> None:
    """Where one FP8Linear forward+backward spends host and device time (top ops)."""
    from torch.profiler import ProfilerActivity, profile

    from jetrl.quant import FP8Linear

    layer = FP8Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    step = _fwd_bwd(layer, x, gy)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


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
    parser.add_argument("--decode-m", default=",".join(str(m) for m in DECODE_M),
                        help="row counts of the decode section (up to 256)")
    args = parser.parse_args(argv)
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
        ("gemm", lambda: bench_gemms(rep, train_m, LLAMA8B_NK)),
        ("decode", lambda: bench_decode(rep, LLAMA8B_NK + [(1024, 4096)],
                                        ms=[int(m) for m in args.decode_m.split(",")])),  # + the k/v projections
        ("fp8linear", lambda: bench_fp8_linear(rep, [4096, 16384], LLAMA8B_NK)),
        ("host", lambda: bench_host_overhead(rep)),
        ("profile", profile_fp8_linear),
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
    for row in rep.sections.get("host", []):
        print(f"host {row['op']}: {row['us']:.1f} us")
    for row in rep.sections.get("quant", []):
        print(f"quant {row['kernel']} {row['shape']}: {row['frac_copy']:.2f} of copy")


if __name__ == "__main__":
    main()
