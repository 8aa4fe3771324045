"""Helpers shared by the benchmarks: model shapes built from configs (no download), the arms (recipe, FP8 KV
cache, exact mode, kernel tuning) and their names, the ``--tuning`` option, device utilities.

Scripts import this as ``bench.common`` (repository root on ``sys.path``, e.g. ``python -m bench.x`` or
the tests) or as ``common`` (``python bench/x.py`` puts ``bench/`` on ``sys.path``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

import torch

# Llama-3.1-8B as published (HF config.json fields): 8,030,261,248 parameters.
LLAMA31_8B: dict = dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072,
    rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)

# Qwen2.5-32B as published (base model's HF config.json fields; qwen2 has q/k/v biases, an untied LM head here):
# 32,763,876,352 parameters, 65.5 GB in BF16 -- one copy fits one H200.
QWEN25_32B: dict = dict(
    model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
    num_attention_heads=40, num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=32768,
    rope_theta=1000000.0, tie_word_embeddings=False, eos_token_id=151643,
)

# Qwen2-1.5B's shape (HF config.json fields; qwen2: q/k/v biases, the LM head tied to the embedding).
QWEN2_15B: dict = dict(
    model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
    num_attention_heads=12, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
    max_position_embeddings=32768, tie_word_embeddings=True, eos_token_id=151643,
)

# Qwen2.5-0.5B as published (head_dim 64, tied LM head, q/k/v biases).
QWEN25_05B: dict = dict(
    model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
    max_position_embeddings=32768, tie_word_embeddings=True, eos_token_id=151643,
)

# Qwen2.5-7B as published (head_dim 128, untied LM head, q/k/v biases; the instruct model's 32K context, as
# bench/train_run.py's). ``with_layers`` keeps fewer blocks of it where the whole model does not fit a benchmark's time.
QWEN25_7B: dict = dict(
    model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1000000.0,
    max_position_embeddings=32768, tie_word_embeddings=False, eos_token_id=151643,
)

# The same family at CPU-test size; hidden and intermediate sizes are multiples of the 128-wide FP8 blocks.
TINY_LLAMA: dict = dict(LLAMA31_8B, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=1)


# The shapes the benchmarks name on their command lines (bench/rollout.py, bench/decode_profile.py).
MODEL_SHAPES: dict[str, dict] = {
    "8b": LLAMA31_8B,
    "32b": QWEN25_32B,
    "7b": QWEN25_7B,
    "1.5b": QWEN2_15B,
    "0.5b": QWEN25_05B,
    "tiny": TINY_LLAMA,
}


def with_layers(shape: dict, num_layers: int | None) -> dict:
    """``shape`` with ``num_hidden_layers`` replaced (None keeps it): a same-width model of fewer blocks."""
    if num_layers is None:
        return dict(shape)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    return dict(shape, num_hidden_layers=num_layers)


# ------------------------------------------------------------------------------------------------ arms

KV8_SUFFIX = "+kv8"  # an arm ``<recipe>+kv8``: the recipe with the FP8 KV cache (run config ``kv_fp8: true``)
EXACT_SUFFIX = "-exact"  # an arm ``<recipe>[+kv8]-exact``: the same in exact on-policy mode
TUNING_MARK = "@"  # an arm ``<...>@KEY=VALUE``: a field of the kernels' tuning object, for that arm only
TUNING_SEP = ";"  # between an arm's tuning settings (the arm list itself is comma-separated)
ARM_SYNTAX = f"<recipe>[{KV8_SUFFIX}][{EXACT_SUFFIX}][{TUNING_MARK}KEY=VALUE[{TUNING_SEP}KEY=VALUE...]]"
DEFAULT_ARMS = "bf16,jet"  # the benchmarks' default arms (plain recipes, so also a default recipe list)


def recipe_names() -> str:
    """The precision recipes of :data:`jetrl.quant.recipe.RECIPES`, comma-separated, for help texts."""
    from jetrl.quant.recipe import RECIPES

    return ", ".join(RECIPES)


def arms_help(example: str, default: str | None = None) -> str:
    """The help text of a benchmark's ``--arms``: the arm grammar (:data:`ARM_SYNTAX`), the recipes, an
    ``example`` arm with its own kernel tuning, and ``default`` where argparse does not show it."""
    default_text = f"; default {default}" if default else ""
    return (f"comma list of {ARM_SYNTAX} (recipes {recipe_names()}; after {TUNING_MARK} the arm's own kernel "
            f"tuning, e.g. {example}{default_text})")


@dataclass(frozen=True)
class Arm:
    """One benchmark arm: a precision recipe, with or without the FP8 KV cache, fast or exact, and the kernel
    tuning it runs under.

    Named ``<recipe>[+kv8][-exact][@KEY=VALUE[;KEY=VALUE...]]``: ``bf16``, ``jet``, ``jet+kv8``, ``jet-exact``,
    ``jet+kv8-exact``, ``fp8-rollout+kv8`` (the rollout-only FP8 cache peers ship). The rules are the run config's:
    ``kv_fp8`` needs a recipe that rolls out in FP8 (:func:`jetrl.quant.recipe.kv_fp8_train`), exact mode one that
    runs the same precision on both sides.

    After ``@``, fields of :class:`jetrl.quant.kernels.tuning.KernelTuning` for this arm only, read like
    ``--tuning`` (:func:`parse_tuning`: each value as its field's type, bools ``true``/``false``/``1``/``0``):
    ``jet-exact@exact_split_k=0`` is exact ``jet`` with the split-K heuristic, next to a plain ``jet-exact`` in the
    same process, on the same model and against the same ``bf16`` arm. A benchmark runs everything of the arm
    (engine, CUDA graphs, warm-up, timing, scoring) inside ``tuning.override(**arm.tuning)``, nested in the
    run's ``--tuning``, so the arm's settings win. ``tuning`` is a read-only mapping in canonical order, keys
    sorted by name, and :attr:`name` writes it so (bools as ``true``/``false``):
    ``parse_arm("jet+kv8@kv_decode_factored=1;exact_split_k=0").name`` is
    ``"jet+kv8@exact_split_k=0;kv_decode_factored=true"``. In a shell, quote an arm list that has ``;``.
    """

    recipe: str
    kv_fp8: bool = False
    exact: bool = False
    tuning: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tuning", MappingProxyType(dict(sorted(dict(self.tuning).items()))))

    def __hash__(self) -> int:  # the tuning mapping itself is not hashable
        return hash((self.recipe, self.kv_fp8, self.exact, tuple(self.tuning.items())))

    @property
    def name(self) -> str:
        base = self.recipe + (KV8_SUFFIX if self.kv_fp8 else "") + (EXACT_SUFFIX if self.exact else "")
        if not self.tuning:
            return base
        return base + TUNING_MARK + TUNING_SEP.join(f"{k}={_tuning_text(v)}" for k, v in self.tuning.items())

    @property
    def rollout_fp8(self) -> bool:
        """Whether the rollout side runs FP8 linears (the recipe's ``rollout_fp8``)."""
        from jetrl.quant.recipe import get_recipe

        return get_recipe(self.recipe).rollout_fp8

    @property
    def train_kv_fp8(self) -> bool:
        """Whether the training forward quantizes K and V too: the FP8 cache under a recipe that trains in
        FP8 (``jet+kv8``); ``fp8-rollout+kv8`` quantizes the rollout's cache only
        (:func:`jetrl.quant.recipe.kv_fp8_train`)."""
        from jetrl.quant.recipe import kv_fp8_train

        return kv_fp8_train(self.recipe, self.kv_fp8)


def _tuning_text(value: Any) -> str:
    """A tuning value as an arm name writes it: bools ``true``/``false``, the rest as ``str``."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def parse_arm(name: str) -> Arm:
    """``"jet+kv8-exact"`` -> ``Arm("jet", kv_fp8=True, exact=True)``, ``"jet-exact@exact_split_k=0"`` ->
    ``Arm("jet", exact=True, tuning={"exact_split_k": 0})``; a ``ValueError`` naming the arm and the problem for
    an unknown recipe, ``kv8`` on a recipe that rolls out in BF16, exact mode under ``fp8-rollout``, or a tuning
    key or value the tuning object does not take (checked here, before any model is built)."""
    from jetrl.quant.recipe import RECIPES, kv_fp8_train

    if not isinstance(name, str):
        raise TypeError(f"an arm name is a string, got {type(name).__name__}")
    base, mark, settings_text = name.partition(TUNING_MARK)
    base = base.strip()
    settings: dict = {}
    if mark:
        items = settings_text.split(TUNING_SEP)
        if any(not item.strip() for item in items):
            raise ValueError(f"arm {name!r}: {TUNING_MARK} is followed by KEY=VALUE[{TUNING_SEP}KEY=VALUE...], "
                             f"with no empty setting")
        settings = _tuning_settings(items, f"arm {name!r}")
    exact = base.endswith(EXACT_SUFFIX)
    base = base[:-len(EXACT_SUFFIX)] if exact else base
    kv_fp8 = base.endswith(KV8_SUFFIX)
    recipe = base[:-len(KV8_SUFFIX)] if kv_fp8 else base
    if recipe not in RECIPES:
        raise ValueError(f"arm {name!r}: unknown recipe {recipe!r}; an arm is {ARM_SYNTAX} with a recipe of "
                         f"{list(RECIPES)}")
    spec = RECIPES[recipe]
    try:
        kv_fp8_train(spec, kv_fp8)
    except ValueError as exc:
        raise ValueError(f"arm {name!r}: {exc}") from None
    if exact and spec.rollout_fp8 != spec.train_fp8:
        raise ValueError(f"arm {name!r}: exact mode needs the same precision on the rollout and training sides; "
                         f"{recipe!r} rolls out in FP8 and trains in BF16")
    return Arm(recipe, kv_fp8, exact, settings)


def parse_arms(text: str) -> list[Arm]:
    """A comma list of arm names (see :class:`Arm`), in order; an empty list, a bad arm or two arms of one
    canonical name (``jet@kv_decode_factored=1`` and ``jet@kv_decode_factored=true``) are a ``ValueError``.
    Arms may differ by their tuning only."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"no arm named in {text!r}")
    arms = [parse_arm(n) for n in names]
    canonical = [a.name for a in arms]
    repeated = sorted({n for n in canonical if canonical.count(n) > 1})
    if repeated:
        raise ValueError(f"arms named twice: {repeated}")
    return arms


def fast_arm_of(arm: Arm, names: Iterable[str]) -> str | None:
    """The arm among ``names`` that an exact arm's cost is set against: the same arm in fast mode (same tuning),
    else the untuned fast arm (a setting of exact mode's GEMM, e.g. ``exact_split_k``, does not touch the fast
    route); None when neither is there or ``arm`` is not exact."""
    if not arm.exact:
        return None
    names = set(names)
    for fast in (Arm(arm.recipe, arm.kv_fp8, tuning=arm.tuning), Arm(arm.recipe, arm.kv_fp8)):
        if fast.name in names:
            return fast.name
    return None


# ------------------------------------------------------------------------------------------- utilities

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


__all__ = ["write_report", "LLAMA31_8B", "QWEN25_32B", "QWEN2_15B", "QWEN25_05B", "QWEN25_7B", "TINY_LLAMA",
           "MODEL_SHAPES", "Arm", "parse_arm", "parse_arms", "fast_arm_of",
           "KV8_SUFFIX", "EXACT_SUFFIX", "TUNING_MARK", "TUNING_SEP", "ARM_SYNTAX", "DEFAULT_ARMS", "recipe_names",
           "arms_help", "add_tuning_argument", "parse_tuning", "parse_arm_args", "with_layers", "sync", "random_prompts",
           "device_description", "reset_peak_memory", "peak_memory_gib"]


def add_tuning_argument(parser) -> None:
    """``--tuning KEY=VALUE`` (repeatable): a field of the kernels' tuning object for the whole run (an arm's own
    ``@KEY=VALUE`` wins over it, see :class:`Arm`)."""
    parser.add_argument("--tuning", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of jetrl.quant.kernels.tuning for the run, e.g. exact_split_k=0 or "
                             "kv_decode_factored=true (repeatable; an arm's own <arm>@KEY=VALUE wins)")


def parse_tuning(parser, items: list[str]) -> dict:
    """``["exact_split_k=0", "kv_decode_factored=true"]`` -> settings for ``tuning.override``: each value read as
    the type of its field's current value (bool: true/false/1/0), checked by the tuning object; a bad or repeated
    key or a bad value is ``parser``'s usage error. An arm's ``@KEY=VALUE`` settings are read by the same rules."""
    try:
        return _tuning_settings(items, "--tuning")
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))


def parse_arm_args(parser, argv):
    """``parser``'s arguments, with ``--arms`` read into :class:`Arm` objects and ``--tuning`` into settings (a bad
    one is the parser's usage error): what the benchmarks that compare arms share."""
    args = parser.parse_args(argv)
    try:
        args.arms = parse_arms(args.arms)
    except ValueError as exc:
        parser.error(f"--arms: {exc}")
    args.tuning = parse_tuning(parser, args.tuning)
    return args


def _tuning_settings(items: list[str], what: str) -> dict:
    """``--tuning`` and an arm's ``@...`` settings: :func:`jetrl.quant.kernels.tuning.parse_settings` (the one
    reader of ``KEY=VALUE`` tuning settings, which a run config's ``kernels`` uses too)."""
    from jetrl.quant.kernels import tuning

    return tuning.parse_settings(items, what)
