"""Peak memory and step time of a packed forward+backward of a Llama-3.1-8B-shaped model, BF16 vs ``jet``.

The model is built from a config with random weights directly on the device (no download). One step
is the trainer's scoring path: ``forward_packed`` over ``num_seqs`` packed sequences, chunked fp32
``token_logprobs`` (with entropy), a scalar loss and ``backward``; per-block activation checkpointing
is on unless ``--no-checkpointing``. Reported per recipe: peak allocated memory (model, gradients
and activations; no optimizer state), median step time over ``--steps`` after ``--warmup``, tokens
per second, and both ratios against the BF16 run of the same invocation.

Run on the GPU: ``python bench/model_memory.py``; on CPU with a tiny config: ``--tiny``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from jetrl.models import DecoderConfig, build_model, token_logprobs

try:  # repository root on sys.path (python -m bench.model_memory, the tests)
    from bench.common import DEFAULT_ARMS, LLAMA31_8B, TINY_LLAMA, peak_memory_gib, reset_peak_memory, sync
except ModuleNotFoundError:  # python bench/model_memory.py: bench/ itself is on sys.path
    from common import (DEFAULT_ARMS, LLAMA31_8B, TINY_LLAMA, peak_memory_gib,  # type: ignore[no-redef]
                        reset_peak_memory, sync)


@dataclass
class Result:
    recipe: str
    peak_gib: float | None
    median_ms: float
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.median_ms / 1e3)


def run_recipe(config: DecoderConfig, recipe: str, num_seqs: int, seq_len: int, device: torch.device,
               steps: int, warmup: int, checkpointing: bool, seed: int = 0) -> Result:
    """Build the model under ``recipe`` and time ``steps`` packed forward+backward steps."""
    reset_peak_memory(device)
    model = build_model(config, dtype=torch.bfloat16, device=device, recipe=recipe, seed=seed)
    model.set_activation_checkpointing(checkpointing).train()
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    n = num_seqs * seq_len
    ids = torch.randint(0, config.vocab_size, (n,), device=device, generator=gen)
    positions = torch.arange(seq_len, device=device).repeat(num_seqs)
    cu = torch.arange(0, n + 1, seq_len, device=device, dtype=torch.int32)
    targets = torch.roll(ids, -1)
    targets[cu[1:] - 1] = -1  # no next token at the end of each sequence
    times = []
    for step in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        sync(device)
        start = time.perf_counter()
        logprobs, entropy = token_logprobs(model, ids, positions, cu, seq_len, targets)
        loss = -(logprobs.sum() / n) - 1e-3 * entropy.mean()
        loss.backward()
        sync(device)
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss under recipe {recipe!r}")
    peak = peak_memory_gib(device)
    del model
    return Result(recipe, peak, statistics.median(times), n)


def format_table(results: list[Result], baseline: str = "bf16") -> str:
    base = next((r for r in results if r.recipe == baseline), results[0])
    lines = [f"{'recipe':<12} {'peak GiB':>9} {'mem/bf16':>9} {'median ms':>10} {'time/bf16':>10} {'tok/s':>10}"]
    for r in results:
        peak = f"{r.peak_gib:9.2f}" if r.peak_gib is not None else f"{'n/a':>9}"
        mem_ratio = (f"{r.peak_gib / base.peak_gib:9.3f}" if r.peak_gib is not None and base.peak_gib
                     else f"{'n/a':>9}")
        lines.append(f"{r.recipe:<12} {peak} {mem_ratio} {r.median_ms:10.1f} {r.median_ms / base.median_ms:10.3f} "
                     f"{r.tokens_per_s:10.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, hidden-256 model (CPU smoke run)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--recipes", default=DEFAULT_ARMS, help="comma-separated precision recipes")
    parser.add_argument("--num-seqs", type=int, default=None, help="packed sequences per step (8; tiny: 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (2048; tiny: 64)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (5; tiny: 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (2; tiny: 1)")
    parser.add_argument("--no-checkpointing", action="store_true", help="keep every block's activations")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = DecoderConfig.from_hf(TINY_LLAMA if args.tiny else LLAMA31_8B)
    small = args.tiny
    num_seqs = args.num_seqs or (2 if small else 8)
    seq_len = args.seq_len or (64 if small else 2048)
    steps = args.steps or (2 if small else 5)
    warmup = args.warmup if args.warmup is not None else (1 if small else 2)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]

    print(f"model: {'tiny' if small else 'Llama-3.1-8B'}-shaped, {config.num_hidden_layers} layers, hidden "
          f"{config.hidden_size}, vocab {config.vocab_size}; device {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}; "
          f"{num_seqs} x {seq_len} packed tokens; activation checkpointing "
          f"{'off' if args.no_checkpointing else 'on'}; torch {torch.__version__}", flush=True)
    results = []
    for recipe in recipes:
        results.append(run_recipe(config, recipe, num_seqs, seq_len, device, steps, warmup,
                                  checkpointing=not args.no_checkpointing))
        print(f"  {recipe}: done", flush=True)
    print(format_table(results))
    return results


if __name__ == "__main__":
    main()
