"""Where the time of one decode step and one training step goes: GPU kernel time by kernel and by kind.

Random weights from a config (no download). The decode step is ``forward_paged`` for ``--batch`` sequences
with ``--context`` cached tokens each (the rollout engine's inner step, without sampling); the training
step is a packed forward+backward over ``--train-tokens`` tokens. Both run eagerly under
``torch.profiler`` (GPU time per kernel is what a CUDA graph replays), and the decode step is also timed as
a CUDA-graph replay, so the gap between the two is launch cost.

GPU: ``python bench/profile_step.py --layers 8`` prints, per recipe, the top kernels and a summary by kind
(GEMM, FP8 quantization, attention, norm, elementwise, other) in microseconds per step and per layer.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

try:
    from bench.common import LLAMA31_8B, with_layers
except ModuleNotFoundError:
    from common import LLAMA31_8B, with_layers  # type: ignore[no-redef]

KINDS = (
    ("attention", ("paged_decode", "merge_splits", "flash", "attention", "fmha", "sdpa", "softmax")),
    ("fp8 quant", ("quant", "requant", "_act_", "_token_")),
    ("gemm", ("gemm", "gemv", "sm90_xmma", "cutlass", "nvjet", "scaled_mm", "matmul", "splitk", "cublas")),
    ("norm/reduce", ("reduce", "norm", "mean")),
    ("copy/index", ("copy", "index", "cat", "scatter", "gather", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def _device_time(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(evt, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def profile(fn, steps: int) -> dict[str, tuple[float, int]]:
    """Kernel name -> (total GPU us per step, launches per step) over ``steps`` calls of ``fn``."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, tuple[float, int]] = {}
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) is not None and "CUDA" not in str(evt.device_type):
            continue
        t = _device_time(evt)
        if t <= 0 or evt.key.startswith(("aten::", "cuda", "Memcpy", "Memset")) and "kernel" not in evt.key.lower():
            continue
        out[evt.key] = (t / steps, evt.count // steps)
    return out


def summarize(title: str, kernels: dict[str, tuple[float, int]], layers: int, top: int) -> dict:
    total = sum(t for t, _ in kernels.values())
    launches = sum(c for _, c in kernels.values())
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, (t, c) in kernels.items():
        k = by_kind[kind_of(name)]
        k[0] += t
        k[1] += c
    print(f"\n== {title}: {total:.0f} us GPU per step, {launches} kernels ({total / layers:.1f} us, "
          f"{launches / layers:.1f} kernels per layer)")
    print(f"{'kind':<14}{'us/step':>10}{'share':>8}{'kernels':>9}")
    for kind, (t, c) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"{kind:<14}{t:>10.1f}{t / total:>8.1%}{c:>9d}")
    print(f"top {top} kernels:")
    for name, (t, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {t:9.1f} us {c:5d}x  {name[:110]}")
    return {"total_us": total, "kernels": launches, "by_kind": {k: v for k, v in by_kind.items()},
            "top": sorted(((n, t, c) for n, (t, c) in kernels.items()), key=lambda x: -x[1])[:top]}


def decode_setup(model, batch: int, context: int, block_size: int = 16):
    from jetrl.models.attention import PagedAttentionMetadata, PagedKVCache

    cfg = model.config
    dev = model.device
    blocks_per_seq = -(-(context + 1) // block_size)
    cache = PagedKVCache.allocate(cfg.num_hidden_layers, batch * blocks_per_seq + 1, block_size,
                                  cfg.num_key_value_heads, cfg.head_dim, model.dtype, dev)
    for t in (*cache.k, *cache.v):
        t.normal_(0, 1)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=dev).view(batch, blocks_per_seq)
    ctx = torch.full((batch,), context + 1, dtype=torch.int32, device=dev)
    slots = (tables[:, context // block_size].long() * block_size + context % block_size)
    meta = PagedAttentionMetadata(torch.arange(batch + 1, dtype=torch.int32, device=dev), ctx, tables, slots,
                                  max_query_len=1, max_context_len=context + 1)
    ids = torch.randint(2, cfg.vocab_size, (batch,), device=dev)
    pos = torch.full((batch,), context, dtype=torch.long, device=dev)
    return ids, pos, meta, cache


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=768)
    p.add_argument("--train-tokens", type=int, default=8192)
    p.add_argument("--train-seqlen", type=int, default=2048)
    p.add_argument("--recipes", default="bf16,jet")
    p.add_argument("--parts", default="decode,train")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="4 blocks instead of --layers (scripts/gpu_check.sh --quick)")
    args = p.parse_args(argv)
    if args.quick:
        args.layers = 4

    from jetrl.models import build_model, token_logprobs
    from jetrl.quant import precision_side

    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py needs a CUDA GPU")
    dev = torch.device("cuda")
    shape = with_layers(LLAMA31_8B, args.layers)
    results: dict = {}
    for recipe in args.recipes.split(","):
        model = build_model(shape, device=dev, recipe=recipe, seed=0)
        parts = args.parts.split(",")
        if "decode" in parts:
            ids, pos, meta, cache = decode_setup(model, args.batch, args.context)

            def step():
                with torch.no_grad(), precision_side("rollout"):
                    return model.forward_paged(ids, pos, meta, cache)

            kernels = profile(step, steps=5)
            res = summarize(f"{recipe} decode b{args.batch} ctx{args.context} ({args.layers} layers)", kernels,
                            args.layers, args.top)
            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step()
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(graph):
                step()
            import triton.testing as tt
            graph_ms = tt.do_bench(graph.replay, warmup=20, rep=200)
            eager_ms = tt.do_bench(step, warmup=5, rep=100)
            print(f"decode step: graph {graph_ms * 1e3:.0f} us, eager {eager_ms * 1e3:.0f} us, kernel sum "
                  f"{res['total_us']:.0f} us")
            res.update(graph_us=graph_ms * 1e3, eager_us=eager_ms * 1e3)
            results[f"{recipe}/decode"] = res
            del graph, cache
        if "train" in parts:
            model.set_activation_checkpointing(False)
            n = args.train_tokens
            ids = torch.randint(2, shape["vocab_size"], (n,), device=dev)
            pos = torch.arange(args.train_seqlen, device=dev).repeat(n // args.train_seqlen)
            cu = list(range(0, n + 1, args.train_seqlen))

            targets = torch.roll(ids, -1)
            cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)

            def train_step():
                lp, _ = token_logprobs(model, ids, pos, cu_t, args.train_seqlen, targets)
                lp.sum().backward()

            kernels = profile(train_step, steps=2)
            res = summarize(f"{recipe} train fwd+bwd {n} tokens ({args.layers} layers)", kernels, args.layers,
                            args.top)
            results[f"{recipe}/train"] = res
            model.zero_grad(set_to_none=True)
        del model
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()
