"""Helpers shared by the benchmarks: model shapes built from configs (no download), device utilities.

Scripts import this as ``bench.common`` (repository root on ``sys.path``, e.g. ``python -m bench.x`` or
the tests) or as ``common`` (``python bench/x.py`` puts ``bench/`` on ``sys.path``).
"""

from __future__ import annotations

import torch

# Llama-3.1-8B as published (HF config.json fields): 8,030,261,248 parameters.
LLAMA31_8B: dict = dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072,
    rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)

# The same family at CPU-test size; hidden and intermediate sizes are multiples of the 128-wide FP8 blocks.
TINY_LLAMA: dict = dict(LLAMA31_8B, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=1)


def with_layers(shape: dict, num_layers: int | None) -> dict:
    """``shape`` with ``num_hidden_layers`` replaced (None keeps it): a same-width model of fewer blocks."""
    if num_layers is None:
        return dict(shape)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    return dict(shape, num_hidden_layers=num_layers)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so host timers measure finished kernels."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids drawn uniformly from [2, vocab_size) (0 and 1 left out:
    pad/eos ids in small test vocabularies)."""
    if num < 1 or length < 1 or vocab_size < 3:
        raise ValueError(f"need num >= 1, length >= 1 and vocab_size >= 3, got {num}, {length}, {vocab_size}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (num, length), generator=gen).tolist()


def device_description(device: torch.device) -> str:
    """A one-line name of the device with its total memory, for benchmark headers."""
    if device.type != "cuda":
        return str(device)
    props = torch.cuda.get_device_properties(device)
    return f"{props.name} ({props.total_memory / 2 ** 30:.0f} GiB)"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    """Peak allocated memory since :func:`reset_peak_memory` (None on CPU, where it is not tracked)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2 ** 30



def write_report(report: dict, path: str | None, out_name: str) -> None:
    """Write ``report`` as JSON to ``path`` (``--json``) and to ``$OUT/<out_name>`` when ``OUT`` is set."""
    import json
    import os

    paths = [path] if path else []
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], out_name))
    for target in paths:
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        with open(target, "w") as f:
            json.dump(report, f, indent=2)

__all__ = ["write_report", "LLAMA31_8B", "TINY_LLAMA", "with_layers", "sync", "random_prompts", "device_description",
           "reset_peak_memory", "peak_memory_gib"]
