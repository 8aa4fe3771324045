"""Where the time of a decode step and of the training-side passes goes: GPU kernel time by kernel and by kind.

Random weights from a config (no download). Arms are ``<recipe>[+kv8][-exact][@KEY=VALUE...]`` as in the other
benchmarks (:class:`bench.common.Arm`), each run under its own kernel tuning. The parts:

* ``decode``: ``forward_paged`` for ``--batch`` sequences with ``--context`` cached tokens each (the rollout
  engine's inner step, without sampling), also timed as a CUDA-graph replay (the gap to eager is launch cost);
* ``train``: a packed forward+backward over ``--train-tokens`` tokens in sequences of ``--train-seqlen``, no
  activation checkpointing (the fast training step's profile);
* ``score``: one micro-batch of the trainer's scoring passes (old log-probs, the reference model): ``--micro-batch``
  sequences of ``--prompt-len`` + ``--new-tokens`` tokens, one packed forward without grad and the LM head's
  log-probabilities on the response rows, exactly as ``Trainer.sequence_logprobs`` runs them (``exact`` and
  ``kv_fp8`` from the arm);
* ``update``: the same micro-batch with grad and its backward, with per-block activation checkpointing as the RL
  step runs it (``--no-checkpointing`` keeps the activations).

Every part runs eagerly under ``torch.profiler`` (GPU time per kernel is what a CUDA graph replays) and is timed
(CUDA events; ``score``/``update``/``train`` per call; ``score`` also split into the decoder blocks and the LM
head). Kernels are grouped by kind (:func:`kind_of`): exact mode's GEMMs (the batch-invariant Triton GEMM and its
split-K reduction) and exact attention (its tile kernel and its swapped decode kernel) apart from the fast GEMMs and attention,
then SwiGLU, FP8 quantization (the Gluon 128x1 kernels included), the LM head's log-softmax, norm, copies (DGrad's
W^T transpose included), elementwise (RoPE and the bias add included), other. With an exact arm and its fast
arm in one run, a table per part sets all arms side by side by kind, with each exact arm's kernel sum and wall time
over its fast arm's.

GPU: ``python bench/profile_step.py --layers 8`` (bf16 vs jet, decode and train); exact mode's training side at
the RL benchmark's shape: ``python bench/profile_step.py --exact --layers 8`` (the arms ``jet,jet-exact``, the
parts ``score,update``); add arms to compare exact schedules in the same process, e.g.
``--arms 'jet,jet-exact,jet-exact@exact_split_k=1'``. ``--tiny``: a CPU smoke run of the same
code (a 2-block model, reference kernels, CPU operator times instead of GPU kernels).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

try:
    from bench.common import DEFAULT_ARMS, LLAMA31_8B, TINY_LLAMA, add_tuning_argument, arms_help, fast_arm_of, \
        parse_arms, parse_tuning, with_layers
except ModuleNotFoundError:
    from common import DEFAULT_ARMS, LLAMA31_8B, TINY_LLAMA, add_tuning_argument, arms_help, fast_arm_of, \
        parse_arms, parse_tuning, with_layers  # type: ignore[no-redef]

# (kind, name fragments), first match wins: exact mode's Triton kernels before the generic words their names
# contain (``_exact_reduce_kernel`` is the exact GEMM's split-K sum, not a norm; ``_exact_attention_*`` is not the
# fast attention); the LM head's log-softmax before "softmax"
KINDS = (
    ("exact gemm", ("_exact_gemm", "_exact_reduce")),
    ("exact attention", ("_exact_attention", "_exact_decode_kernel")),
    ("lm-head logprobs", ("_logprob_", "log_softmax", "logsoftmax", "softmaxforward", "softmaxbackward")),
    ("attention", ("paged_decode", "merge_splits", "flash", "attention", "fmha", "sdpa", "softmax")),
    ("swiglu", ("_swiglu_",)),
    ("fp8 quant", ("quant", "requant", "_act_", "_token_", "token_kernel")),
    ("gemm", ("gemm", "gemv", "sm90_xmma", "cutlass", "nvjet", "scaled_mm", "matmul", "splitk", "cublas")),
    ("norm/reduce", ("reduce", "norm", "mean")),
    ("copy/index", ("copy", "index", "cat", "scatter", "gather", "fill", "transpose")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "_rope_", "_add_bias")),
)
PARTS = ("decode", "train", "score", "update")
EXACT_ARMS = "jet,jet-exact"  # the default arms under --exact
DEFAULT_PARTS, EXACT_PARTS = "decode,train", "score,update"  # the default parts, without and with --exact


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile(fn, steps: int, device: torch.device) -> dict[str, tuple[float, int]]:
    """Kernel name -> (total GPU us per step, launches per step) over ``steps`` calls of ``fn`` (after one
    untimed call). On CPU: ATen operator -> (self CPU us per step, calls per step), the smoke run's stand-in."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = device.type == "cuda"
    fn()
    _sync(device)
    activities = [ProfilerActivity.CUDA, ProfilerActivity.CPU] if cuda else [ProfilerActivity.CPU]
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    out: dict[str, tuple[float, int]] = {}
    for evt in prof.key_averages():
        if not cuda:
            if evt.key.startswith("aten::") and evt.self_cpu_time_total > 0:
                out[evt.key] = (float(evt.self_cpu_time_total) / steps, evt.count // steps)
            continue
        if "CUDA" not in str(evt.device_type):
            continue
        t = float(evt.self_device_time_total)
        if t <= 0 or evt.key.startswith(("aten::", "cuda", "Memcpy", "Memset")) and "kernel" not in evt.key.lower():
            continue
        out[evt.key] = (t / steps, evt.count // steps)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn, steps: int, device: torch.device) -> float:
    """Milliseconds per call of ``fn`` (already warm): CUDA events around ``steps`` calls, host time on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / steps


def summarize(title: str, kernels: dict[str, tuple[float, int]], layers: int, top: int) -> dict:
    total = sum(t for t, _ in kernels.values())
    launches = sum(c for _, c in kernels.values())
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, (t, c) in kernels.items():
        k = by_kind[kind_of(name)]
        k[0] += t
        k[1] += c
    print(f"\n== {title}: {total:.0f} us per step, {launches} kernels ({total / layers:.1f} us, "
          f"{launches / layers:.1f} kernels per layer)")
    print(f"{'kind':<18}{'us/step':>10}{'share':>8}{'kernels':>9}")
    for kind, (t, c) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"{kind:<18}{t:>10.1f}{t / max(total, 1e-9):>8.1%}{c:>9d}")
    print(f"top {top} kernels:")
    for name, (t, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {t:9.1f} us {c:5d}x  {kind_of(name):<17} {name[:100]}")
    return {"total_us": total, "kernels": launches, "by_kind": {k: v for k, v in by_kind.items()},
            "top": sorted(((n, t, c) for n, (t, c) in kernels.items()), key=lambda x: -x[1])[:top]}


def compare(part: str, results: dict, arms) -> None:
    """One table for ``part``: us per step by kind, an arm per column ([i] in the legend), then the kernel sum and
    wall times, and for each exact arm its kernel sum and wall time over its fast arm's (``fast_arm_of``)."""
    present = [a for a in arms if f"{a.name}/{part}" in results]
    if len(present) < 2:
        return
    res = [results[f"{a.name}/{part}"] for a in present]
    print(f"\n== {part}: arms side by side (us per step)")
    for i, arm in enumerate(present):
        print(f"  [{i}] {arm.name}")
    kinds = sorted({k for r in res for k in r["by_kind"]}, key=lambda k: -max(r["by_kind"].get(k, (0.0,))[0]
                                                                                 for r in res))
    print(f"{'kind':<18}" + "".join(f"{f'[{i}]':>12}" for i in range(len(present))))
    for k in kinds:
        print(f"{k:<18}" + "".join(f"{r['by_kind'].get(k, (0.0,))[0]:>12.1f}" for r in res))
    print(f"{'kernel sum':<18}" + "".join(f"{r['total_us']:>12.1f}" for r in res))
    for key, text in (("wall_ms", "wall ms/call"), ("host_ms", "host ms/call"), ("blocks_wall_ms", " blocks ms"),
                      ("head_wall_ms", " head ms"), ("peak_gib", "peak GiB"),
                      ("graph_us", "graph us")):
        if all(key in r for r in res):
            print(f"{text:<18}" + "".join(f"{r[key]:>12.2f}" for r in res))
    names = [a.name for a in present]
    for i, arm in enumerate(present):
        fast = fast_arm_of(arm, names)
        if fast is None:
            continue
        a, b = results[f"{fast}/{part}"], res[i]
        line = f"[{i}] over [{names.index(fast)}]: kernel sum {b['total_us'] / max(a['total_us'], 1e-9):.2f}x"
        for key in ("wall_ms", "graph_us"):
            if key in a and key in b:
                line += f", {key.split('_')[0]} {b[key] / max(a[key], 1e-9):.2f}x"
        print(line)


def decode_setup(model, batch: int, context: int, block_size: int = 16, kv_fp8: bool = False):
    """A decode step's inputs: ``batch`` sequences with ``context`` cached tokens of random K/V (FP8 with unit
    scales under ``kv_fp8``) and one new token each."""
    from jetrl.models.attention import PagedAttentionMetadata, PagedKVCache

    cfg = model.config
    dev = model.device
    blocks_per_seq = -(-(context + 1) // block_size)
    cache = PagedKVCache.allocate(cfg.num_hidden_layers, batch * blocks_per_seq + 1, block_size,
                                  cfg.num_key_value_heads, cfg.head_dim, model.dtype, dev, kv_fp8=kv_fp8)
    for t in (*cache.k, *cache.v):
        t.copy_(torch.randn(t.shape, device=dev).to(t.dtype))
    for t in (*(cache.k_scale or ()), *(cache.v_scale or ())):
        t.fill_(1.0)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=dev).view(batch, blocks_per_seq)
    ctx = torch.full((batch,), context + 1, dtype=torch.int32, device=dev)
    slots = (tables[:, context // block_size].long() * block_size + context % block_size)
    meta = PagedAttentionMetadata(torch.arange(batch + 1, dtype=torch.int32, device=dev), ctx, tables, slots,
                                  max_query_len=1, max_context_len=context + 1)
    ids = torch.randint(2, cfg.vocab_size, (batch,), device=dev)
    pos = torch.full((batch,), context, dtype=torch.long, device=dev)
    return ids, pos, meta, cache


def micro_batch_inputs(vocab: int, seqs: int, prompt_len: int, new_tokens: int, device: torch.device):
    """The trainer's packed micro-batch (``Trainer.sequence_logprobs``): ``seqs`` sequences of ``prompt_len`` +
    ``new_tokens`` random tokens -> (ids, positions, cu_seqlens, max_seqlen, targets, response_rows)."""
    g = torch.Generator().manual_seed(0)
    length = prompt_len + new_tokens
    ids = torch.randint(2, vocab, (seqs * length,), generator=g)
    positions = torch.arange(length).repeat(seqs)
    targets = torch.cat([torch.cat([s[1:], torch.tensor([-1])]) for s in ids.view(seqs, length)])
    starts = torch.arange(seqs) * length
    rows = (starts[:, None] + prompt_len - 1 + torch.arange(new_tokens)[None, :]).flatten()
    cu = torch.arange(seqs + 1, dtype=torch.int32) * length
    return (ids.to(device), positions.to(device), cu.to(device), length, targets.to(device), rows.to(device))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--arms", "--recipes", dest="arms", default=None,
                   help=arms_help("jet-exact@exact_split_k=1",
                                  default=f"{DEFAULT_ARMS}, with --exact {EXACT_ARMS}"))
    p.add_argument("--exact", action="store_true",
                   help=f"exact mode's training side against fast mode: arms {EXACT_ARMS} and parts {EXACT_PARTS} "
                        "unless --arms/--parts say otherwise")
    p.add_argument("--parts", default=None, help=f"comma list of {','.join(PARTS)} (default {DEFAULT_PARTS}; with "
                                                 f"--exact {EXACT_PARTS})")
    p.add_argument("--batch", type=int, default=64, help="decode: sequences")
    p.add_argument("--context", type=int, default=768, help="decode: cached tokens per sequence")
    p.add_argument("--train-tokens", type=int, default=8192, help="train: packed tokens")
    p.add_argument("--train-seqlen", type=int, default=2048, help="train: tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=8, help="score/update: sequences per micro-batch")
    p.add_argument("--prompt-len", type=int, default=256, help="score/update: prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=256, help="score/update: response tokens per sequence")
    p.add_argument("--no-checkpointing", action="store_true", help="update: keep every block's activations")
    p.add_argument("--steps", type=int, default=None, help="profiled and timed calls per part (default 5 decode, "
                                                           "2 otherwise)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="also run each part once under cProfile and print its N costliest host functions")
    p.add_argument("--json", default=None)
    p.add_argument("--shape", default=None, metavar="JSON",
                   help='model-config fields over the 8B shape (or --tiny\'s), e.g. \'{"hidden_size": 1024, '
                        '"intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 4}\' '
                        '(the experiments\' 94M model with --layers 8)')
    p.add_argument("--quick", action="store_true", help="4 blocks instead of --layers (scripts/gpu_check.sh --quick)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke run: a 2-block model, micro-batch 2 x (8 + 8) tokens, CPU operator times")
    add_tuning_argument(p)
    args = p.parse_args(argv)
    run_tuning = parse_tuning(p, args.tuning)
    try:
        arms = parse_arms(args.arms or (EXACT_ARMS if args.exact else DEFAULT_ARMS))
    except ValueError as exc:
        p.error(str(exc))
    parts = [s.strip() for s in (args.parts or (EXACT_PARTS if args.exact else DEFAULT_PARTS)).split(",")
             if s.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        p.error(f"--parts: choose from {PARTS}, got {parts}")
    if args.quick:
        args.layers = 4
    try:
        shape_override = json.loads(args.shape) if args.shape else {}
    except json.JSONDecodeError as exc:
        p.error(f"--shape: not JSON ({exc})")
    if not isinstance(shape_override, dict):
        p.error(f"--shape: a JSON object of model-config fields, got {args.shape!r}")

    from jetrl.models import build_model, logprobs_from_hidden, token_logprobs
    from jetrl.quant import precision_side
    from jetrl.quant.kernels import tuning

    if args.tiny:
        dev = torch.device("cpu")
        shape = dict(TINY_LLAMA)
        args.micro_batch, args.prompt_len, args.new_tokens = 2, 8, 8
        args.batch, args.context, args.train_tokens, args.train_seqlen = 2, 16, 32, 16
    else:
        if not torch.cuda.is_available():
            raise SystemExit("profile_step.py needs a CUDA GPU (--tiny: a CPU smoke run)")
        dev = torch.device("cuda")
        shape = with_layers(LLAMA31_8B, args.layers)
    shape.update(shape_override)
    layers = shape["num_hidden_layers"]
    results: dict = {}
    models: dict = {}
    for arm in arms:
        if arm.recipe not in models:
            models.clear()  # one model at a time (8B-shaped blocks)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            models[arm.recipe] = build_model(shape, device=dev, recipe=arm.recipe, seed=0)
        model = models[arm.recipe]
        label = arm.name
        with tuning.override(**{**run_tuning, **arm.tuning}):
            if "decode" in parts:
                results[f"{label}/decode"] = _decode_part(model, arm, args, dev, layers, precision_side)
            if "train" in parts:
                model.set_activation_checkpointing(False)
                n = args.train_tokens
                ids = torch.randint(2, shape["vocab_size"], (n,), device=dev)
                pos = torch.arange(args.train_seqlen, device=dev).repeat(n // args.train_seqlen)
                cu_t = torch.tensor(list(range(0, n + 1, args.train_seqlen)), dtype=torch.int32, device=dev)
                targets = torch.roll(ids, -1)

                def train_step():
                    lp, _ = token_logprobs(model, ids, pos, cu_t, args.train_seqlen, targets, exact=arm.exact,
                                           kv_fp8=arm.train_kv_fp8)
                    lp.sum().backward()

                results[f"{label}/train"] = _timed_part(
                    train_step, f"{label} train fwd+bwd {n} tokens ({layers} layers)", args, dev, layers)
            if "score" in parts or "update" in parts:
                ids, pos, cu, max_len, targets, rows = micro_batch_inputs(
                    shape["vocab_size"], args.micro_batch, args.prompt_len, args.new_tokens, dev)

                def seq_logprobs():
                    hidden = model.forward_packed(ids, pos, cu, max_len, exact=arm.exact, kv_fp8=arm.train_kv_fp8)
                    return logprobs_from_hidden(model, hidden[rows], targets[rows], temperature=1.0,
                                                exact=arm.exact)[0]

                shape_text = f"{args.micro_batch} x ({args.prompt_len} + {args.new_tokens}) tokens, {layers} layers"
                if "score" in parts:
                    def score_step():
                        with torch.no_grad():
                            seq_logprobs()

                    res = _timed_part(score_step, f"{label} score (no grad) {shape_text}", args, dev, layers)
                    with torch.no_grad():  # the split of the wall time: the decoder blocks, then the LM head
                        hidden = model.forward_packed(ids, pos, cu, max_len, exact=arm.exact,
                                                      kv_fp8=arm.train_kv_fp8)
                        res["blocks_wall_ms"] = wall_ms(lambda: model.forward_packed(
                            ids, pos, cu, max_len, exact=arm.exact, kv_fp8=arm.train_kv_fp8), args.steps or 2, dev)
                        res["head_wall_ms"] = wall_ms(lambda: logprobs_from_hidden(
                            model, hidden[rows], targets[rows], temperature=1.0, exact=arm.exact), args.steps or 2, dev)
                    del hidden
                    print(f"of which decoder blocks {res['blocks_wall_ms']:.2f} ms, LM head + log-probs "
                          f"{res['head_wall_ms']:.2f} ms")
                    results[f"{label}/score"] = res
                if "update" in parts:
                    model.set_activation_checkpointing(not args.no_checkpointing)

                    def update_step():  # gradients accumulate, as over a mini-batch's micro-batches
                        seq_logprobs().sum().backward()

                    ckpt = "" if args.no_checkpointing else ", checkpointing"
                    results[f"{label}/update"] = _timed_part(
                        update_step, f"{label} update fwd+bwd {shape_text}{ckpt}", args, dev, layers)
                    model.set_activation_checkpointing(False)
            model.zero_grad(set_to_none=True)
    models.clear()
    for part in parts:
        compare(part, results, arms)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


def host_ms(fn, steps: int, device: torch.device) -> float:
    """Milliseconds per call that the host spends issuing ``fn``'s work (the GPU's queue drained first, waited for
    after): near :func:`wall_ms` when the host, not the GPU, sets the pace."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    seconds = time.perf_counter() - t0
    _sync(device)
    return seconds * 1e3 / steps


def host_profile(fn, top: int) -> None:
    """One call of ``fn`` under cProfile: the ``top`` host functions by own and by cumulative time (where the host
    time goes)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)


def _timed_part(fn, title: str, args, dev: torch.device, layers: int) -> dict:
    steps = args.steps or 2
    kernels = profile(fn, steps=steps, device=dev)
    res = summarize(title, kernels, layers, args.top)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    res["wall_ms"] = wall_ms(fn, steps, dev)
    res["host_ms"] = host_ms(fn, steps, dev)
    text = ""
    if dev.type == "cuda":  # the model, its FP8 caches, the gradients and the pass's own peak
        res["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        text = f", peak {res['peak_gib']:.2f} GiB allocated"
    print(f"wall {res['wall_ms']:.2f} ms per call, host {res['host_ms']:.2f} ms issuing it{text}")
    if args.host_profile:
        host_profile(fn, args.host_profile)
    return res


def _decode_part(model, arm, args, dev: torch.device, layers: int, precision_side) -> dict:
    ids, pos, meta, cache = decode_setup(model, args.batch, args.context, kv_fp8=arm.kv_fp8)

    def step():
        with torch.no_grad(), precision_side("rollout"):
            return model.forward_paged(ids, pos, meta, cache, exact=arm.exact)

    kernels = profile(step, steps=args.steps or 5, device=dev)
    res = summarize(f"{arm.name} decode b{args.batch} ctx{args.context} ({layers} layers)", kernels, layers,
                    args.top)
    if dev.type != "cuda":
        return res
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
    del graph
    return res


if __name__ == "__main__":
    main()
