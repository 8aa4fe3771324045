"""Rollout throughput: ``RolloutEngine`` in ``bf16`` and ``jet`` vs ``transformers.generate`` (static cache).

Random weights built from a config (no download): the Llama-3.1-8B shape and a ~1.5B shape (Qwen2.5-1.5B).
Settings (prompt length, new tokens with stops ignored, prompts x samples):

* ``b64``:  64 prompts x 1 sample,  256-token prompts, 1,024 new tokens (the FP8 weight-bytes regime)
* ``b256``: 256 prompts x 1 sample, same lengths (the KV-bytes regime)
* ``n8``:   32 prompts x 8 samples (256 sequences sharing their prompts' KV blocks)

For each: output tokens/s end to end (prefill included) for ``bf16`` and ``jet``, the ratio, the
*ceiling* of that ratio (bytes per decode step in BF16 over bytes in jet: FP8 halves the linear weights,
not the BF16 KV cache), and the fraction of the roofline: the decode time if every step only streamed its
weight and KV bytes at the copy bandwidth (``--bandwidth``, default the 4.3 TB/s measured on the H200),
or ran its FLOPs at the measured BF16 matmul rate (FP8: twice that), whichever is slower.

**Exact mode** (``--exact``): a third arm, ``jet-exact`` (``RolloutEngine(exact=True)`` on the ``jet`` recipe,
see :mod:`jetrl.quant.exact`), runs after the others on the same prompts; each arm's prefill and decode times, the
cost of exact over fast ``jet`` and the speed against fast ``bf16`` are printed, and every arm's completions are
scored by the training forward (``exact`` where the arm is) to print the rollout/training mismatch |dlogp| mean
and max side by side (``jet-exact``: 0 by construction).

GPU: ``python bench/rollout.py --shape 8b`` (and ``--shape 1.5b``); ``--settings b64,b256`` picks settings,
``--no-hf`` skips transformers, ``--hf-new-tokens 256`` shortens its run, ``--json PATH`` saves results.
CPU smoke run: ``python bench/rollout.py --tiny``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field

import torch

try:  # repository root on sys.path (python -m bench.rollout, the tests)
    from bench.common import LLAMA31_8B, TINY_LLAMA, random_prompts, sync
except ModuleNotFoundError:  # python bench/rollout.py: bench/ itself is on sys.path
    from common import LLAMA31_8B, TINY_LLAMA, random_prompts, sync  # type: ignore[no-redef]

SHAPES = {
    "8b": LLAMA31_8B,
    "1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                 num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, rms_norm_eps=1e-6,
                 rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True, qkv_bias=True,
                 eos_token_id=151643),
    "tiny": TINY_LLAMA,
}
SETTINGS = {"b64": (64, 1), "b256": (256, 1), "n8": (32, 8)}  # prompts, samples per prompt


@dataclass
class Result:
    shape: str
    setting: str
    num_prompts: int
    n: int
    prompt_len: int
    new_tokens: int
    tokens_per_s: dict[str, float] = field(default_factory=dict)  # recipe -> tokens/s, end to end
    decode_tokens_per_s: dict[str, float] = field(default_factory=dict)  # decode steps only
    decode_roofline_fraction: dict[str, float] = field(default_factory=dict)
    roofline_tokens_per_s: dict[str, float] = field(default_factory=dict)
    roofline_fraction: dict[str, float] = field(default_factory=dict)
    bound: dict[str, str] = field(default_factory=dict)
    jet_over_bf16: float = 0.0
    jet_ceiling: float = 0.0
    hf_tokens_per_s: float = 0.0
    engine_over_hf: float = 0.0
    preemptions: dict[str, int] = field(default_factory=dict)
    prefill_seconds: dict[str, float] = field(default_factory=dict)
    decode_seconds: dict[str, float] = field(default_factory=dict)
    # with --exact: rollout/training |dlogp| per arm, and exact jet's time over fast jet's / over fast bf16's
    mismatch_mean: dict[str, float] = field(default_factory=dict)
    mismatch_max: dict[str, float] = field(default_factory=dict)
    exact_over_jet: float = 0.0
    exact_over_bf16: float = 0.0


EXACT_SUFFIX = "-exact"  # an arm ``<recipe>-exact`` runs that recipe with RolloutEngine(exact=True)


def arm_recipe(arm: str) -> tuple[str, bool]:
    """``"jet-exact"`` -> ``("jet", True)``; a plain recipe name -> ``(name, False)``."""
    if arm.endswith(EXACT_SUFFIX):
        return arm[:-len(EXACT_SUFFIX)], True
    return arm, False


def _linear_params(model) -> tuple[int, int]:
    """(parameters in the blocks' linear layers, parameters read per step outside them: LM head, norms)."""
    linear = other = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            if name.endswith("lm_head"):
                other += module.weight.numel()
            else:
                linear += module.weight.numel()
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith("bias"):
            other += p.numel()
    return linear, other


def roofline(model, num_seqs: int, prompt_len: int, new_tokens: int, fp8: bool, bandwidth: float,
             matmul_flops: float) -> tuple[float, str, float]:
    """Roofline output tokens/s of the decode phase, what binds, and the bytes streamed per step (mean)."""
    cfg = model.config
    linear, other = _linear_params(model)
    weight_bytes = linear * (1 if fp8 else 2) + linear // (128 * 128) * 4 * fp8 + other * 2
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    steps = new_tokens - 1  # the first token comes from prefill
    # step t reads the KV of prompt_len + t tokens for every sequence (and writes one token's)
    kv_bytes = num_seqs * kv_per_token * (steps * prompt_len + steps * (steps + 1) / 2 + steps)
    total_bytes = steps * weight_bytes + kv_bytes
    flops = steps * num_seqs * 2 * (linear + other)  # attention FLOPs are small next to the weights at decode
    t_bytes = total_bytes / bandwidth
    t_flops = flops / (matmul_flops * (2 if fp8 else 1))
    t = max(t_bytes, t_flops)
    return num_seqs * steps / t, ("bandwidth" if t_bytes >= t_flops else "compute"), total_bytes / steps


def _measure_device(device: torch.device) -> tuple[float, float]:
    """Copy bandwidth (bytes/s, read + write) and BF16 matmul rate (FLOP/s) on ``device``."""
    if device.type != "cuda":
        return 50e9, 1e11
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def timed(fn, reps):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2]

    bw = 2 * src.numel() / timed(lambda: dst.copy_(src), 20)
    flops = 2 * 8192 ** 3 / timed(lambda: a @ b, 20)
    return bw, flops  # the buffers are freed on return


def _run_engine(model, prompts, n, new_tokens, args, device, exact: bool = False) -> tuple[float, dict, list]:
    from jetrl.rollout import RolloutEngine, SamplingParams

    engine = RolloutEngine(model, memory_budget=args.memory_budget if device.type == "cuda" else 2 ** 30,
                           max_num_seqs=len(prompts) * n, max_num_batched_tokens=args.max_num_batched_tokens,
                           max_model_len=len(prompts[0]) + new_tokens, progress=args.progress,
                           cuda_graphs=not args.no_cuda_graphs, exact=exact)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=None)
    engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=min(8, new_tokens),
                                            ignore_eos=True))  # warm-up: graph capture, kernel autotune
    times = []
    for _ in range(args.repeats):
        sync(device)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        sync(device)
        times.append(time.perf_counter() - start)
        assert sum(len(o.token_ids) for o in outs) == len(prompts) * n * new_tokens
    stats = dict(engine.last_stats)
    engine.free_cache()
    del engine
    seconds = sorted(times)[len(times) // 2]
    return len(prompts) * n * new_tokens / seconds, stats, outs


def mismatch(model, prompts, outs, exact: bool, device, max_tokens: int = 16384) -> tuple[float, float]:
    """Mean and max |engine log-prob - training-forward log-prob| over every generated token; the training
    forward (packed, ``exact`` as the arm) runs in micro-batches of at most ``max_tokens`` tokens."""
    from jetrl.models import token_logprobs

    total, count, worst = 0.0, 0, 0.0
    start = 0
    while start < len(outs):
        group, used = [], 0
        while start < len(outs) and (not group or used + len(prompts[outs[start].prompt_index]) +
                                     len(outs[start].token_ids) <= max_tokens):
            used += len(prompts[outs[start].prompt_index]) + len(outs[start].token_ids)
            group.append(outs[start])
            start += 1
        ids, pos, cu, tg = [], [], [0], []
        for c in group:
            seq = list(prompts[c.prompt_index]) + list(c.token_ids)
            ids, pos, tg = ids + seq, pos + list(range(len(seq))), tg + seq[1:] + [-1]
            cu.append(cu[-1] + len(seq))
        with torch.no_grad():
            lp, _ = token_logprobs(model, torch.tensor(ids, device=device), torch.tensor(pos, device=device),
                                   torch.tensor(cu, device=device), None, torch.tensor(tg, device=device), 1.0,
                                   exact=exact)
        lp = lp.cpu()
        for i, c in enumerate(group):
            first = cu[i] + len(prompts[c.prompt_index]) - 1
            diff = (lp[first:first + len(c.token_ids)] - torch.tensor(c.logprobs, dtype=torch.float32)).abs()
            total, count, worst = total + float(diff.sum()), count + diff.numel(), max(worst, float(diff.max()))
    return total / max(count, 1), worst


def _run_hf(model, prompts, n, new_tokens, device) -> float:
    """``transformers`` generate with a static cache on a copy of the same weights (BF16)."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**model.config.to_hf())
    with torch.device(device):  # initialised on the device (fast), then overwritten with our weights
        try:
            hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=model.dtype)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            hf = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=model.dtype)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if not (hf_config.tie_word_embeddings and "lm_head" in k)]
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto transformers' model: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    hf.eval()
    ids = torch.tensor([p for p in prompts for _ in range(n)], device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                  top_p=1.0, cache_implementation="static", pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        hf.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        sync(device)
        start = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        sync(device)
        seconds = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == new_tokens
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ids.shape[0] * new_tokens / seconds


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["8b", "1.5b"], default="8b")
    parser.add_argument("--settings", default="b64,b256,n8", help=f"comma list of {sorted(SETTINGS)}")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--hf-new-tokens", type=int, default=None, help="new tokens for transformers (default: same)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    parser.add_argument("--recipes", default="bf16,jet", help="comma list of recipes (each may end in -exact)")
    parser.add_argument("--exact", action="store_true",
                        help="also run jet in exact mode (the arm jet-exact) and print every arm's mismatch")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--memory-budget", type=float, default=0.85, help="fraction of free GPU memory for KV")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the roofline")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 4 prompts, 8 tokens")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from jetrl.models import DecoderConfig, build_model
    from jetrl.quant import apply_recipe

    if args.tiny:
        shape, device, dtype = "tiny", torch.device("cpu"), torch.float32
        settings = {"tiny": (4, 1), "tiny-n2": (2, 2)}
        args.prompt_len, args.new_tokens = 8, 8
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/rollout.py needs a CUDA GPU (use --tiny for a CPU smoke run)")
        shape, device, dtype = args.shape, torch.device("cuda"), torch.bfloat16
        names = [s for s in args.settings.split(",") if s]
        unknown = [s for s in names if s not in SETTINGS]
        if unknown:
            raise SystemExit(f"unknown settings {unknown}; choose from {sorted(SETTINGS)}")
        settings = {s: SETTINGS[s] for s in names}
    recipes = [r for r in args.recipes.split(",") if r]
    if args.exact and "jet-exact" not in recipes:
        recipes.append("jet-exact")
    bandwidth_measured, matmul_flops = _measure_device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    bandwidth = args.bandwidth if device.type == "cuda" else bandwidth_measured
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}: copy bandwidth "
          f"{bandwidth_measured / 1e12:.2f} TB/s measured (roofline uses {bandwidth / 1e12:.2f}), BF16 matmul "
          f"{matmul_flops / 1e12:.0f} TFLOP/s", flush=True)

    # seed=None draws the random weights on the device itself (a CPU generator would take minutes at 8B)
    model = build_model(DecoderConfig(**SHAPES[shape]), dtype=dtype, device=device, recipe="bf16",
                        seed=0 if device.type == "cpu" else None)
    results = []
    for setting, (num_prompts, n) in settings.items():
        prompts = random_prompts(num_prompts, args.prompt_len, model.config.vocab_size, seed=len(results))
        res = Result(shape, setting, num_prompts, n, args.prompt_len, args.new_tokens)
        step_bytes = {}
        for recipe in recipes:  # an arm: a recipe, or <recipe>-exact
            base, exact = arm_recipe(recipe)
            apply_recipe(model, base)  # swaps linear layers in place, sharing the parameters
            tps, stats, outs = _run_engine(model, prompts, n, args.new_tokens, args, device, exact)
            if args.exact:
                res.mismatch_mean[recipe], res.mismatch_max[recipe] = mismatch(model, prompts, outs, exact, device)
            del outs
            res.prefill_seconds[recipe], res.decode_seconds[recipe] = stats["prefill_seconds"], stats["decode_seconds"]
            fp8 = base != "bf16"
            roof, bound, step_bytes[recipe] = roofline(model, num_prompts * n, args.prompt_len, args.new_tokens, fp8,
                                                       bandwidth, matmul_flops)
            res.tokens_per_s[recipe] = tps
            res.roofline_tokens_per_s[recipe] = roof
            res.roofline_fraction[recipe] = tps / roof
            res.bound[recipe] = bound
            res.preemptions[recipe] = int(stats.get("preemptions", 0))
            res.decode_tokens_per_s[recipe] = stats["decode_tokens_per_s"]
            res.decode_roofline_fraction[recipe] = stats["decode_tokens_per_s"] / roof
            print(f"[{shape} {setting}] {recipe}: {tps:,.0f} tok/s end to end ({tps / roof:.1%} of the decode "
                  f"roofline {roof:,.0f}, {bound}-bound); decode steps alone {stats['decode_tokens_per_s']:,.0f} "
                  f"tok/s ({stats['decode_tokens_per_s'] / roof:.1%}); prefill {stats['prefill_seconds']:.2f} s, "
                  f"decode {stats['decode_seconds']:.2f} s; host time not waiting for the GPU {stats.get('host_seconds', 0.0):.2f} s of "
                  f"{stats['seconds']:.2f} s; {stats.get('preemptions', 0)} preemptions, "
                  f"{stats.get('num_blocks', 0)} KV blocks", flush=True)
        apply_recipe(model, "bf16")
        if args.exact and "jet-exact" in res.tokens_per_s:
            tps = res.tokens_per_s
            res.exact_over_jet = tps["jet"] / tps["jet-exact"] if "jet" in tps else 0.0
            res.exact_over_bf16 = tps["bf16"] / tps["jet-exact"] if "bf16" in tps else 0.0
            times = ", ".join(f"{a} prefill {res.prefill_seconds[a]:.2f} s decode {res.decode_seconds[a]:.2f} s"
                              for a in tps)
            gaps = ", ".join(f"{a} {res.mismatch_mean[a]:.2e} / {res.mismatch_max[a]:.2e}" for a in tps)
            print(f"[{shape} {setting}] exact jet takes {res.exact_over_jet:.2f}x fast jet's time and "
                  f"{res.exact_over_bf16:.2f}x fast bf16's (end to end); {times}", flush=True)
            print(f"[{shape} {setting}] rollout/training mismatch |dlogp| mean / max: {gaps}", flush=True)
        if "bf16" in res.tokens_per_s and "jet" in res.tokens_per_s:
            res.jet_over_bf16 = res.tokens_per_s["jet"] / res.tokens_per_s["bf16"]
            res.jet_ceiling = step_bytes["bf16"] / step_bytes["jet"]
            print(f"[{shape} {setting}] jet / bf16 = {res.jet_over_bf16:.2f}x (bytes ceiling {res.jet_ceiling:.2f}x, "
                  f"{res.jet_over_bf16 / res.jet_ceiling:.0%} of it)", flush=True)
        if not args.no_hf:
            hf_tokens = args.hf_new_tokens or args.new_tokens
            res.hf_tokens_per_s = _run_hf(model, prompts, n, hf_tokens, device)
            if "bf16" in res.tokens_per_s:
                res.engine_over_hf = res.tokens_per_s["bf16"] / res.hf_tokens_per_s
            print(f"[{shape} {setting}] transformers.generate (static cache, {hf_tokens} new tokens): "
                  f"{res.hf_tokens_per_s:,.0f} tok/s; engine bf16 / transformers = {res.engine_over_hf:.2f}x",
                  flush=True)
        results.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return results


if __name__ == "__main__":
    main()
