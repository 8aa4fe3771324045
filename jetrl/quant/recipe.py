"""Precision recipes: what the rollout side and the training side each run, and the layer swap.

================  ============  ==============  ==========================================================
recipe            rollout       training        meaning
================  ============  ==============  ==========================================================
``bf16``          BF16          BF16            the reference run
``fp8-rollout``   FP8           BF16            the common baseline: generation in FP8, updates in BF16, so
                                                the data comes from a different policy (off-policy)
``jet``           FP8           FP8 (+FP8 bwd)  the unified FP8 flow: identical quantization on both
                                                sides, FP8 DGrad/WGrad, BF16 master weights
================  ============  ==============  ==========================================================

**Exact on-policy mode** is not a recipe but a choice of the callers (``RolloutEngine(exact=True)``, the run
config's ``exact``, ``forward_packed(..., exact=True)``), valid with ``bf16`` and ``jet`` (:func:`check_exact`):
see :mod:`jetrl.quant.exact`. So is the **FP8 KV cache** (``kv_fp8``), valid with the recipes that roll out in
FP8; :func:`kv_fp8_train` says which side quantizes K and V under which recipe.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace

import torch.nn as nn

from jetrl.quant.linear import FP8Linear
from jetrl.quant.weight_cache import bf16_stacks, invalidate_bf16_stacks

DEFAULT_EXCLUDE = ("lm_head", "*embed*")


@dataclass(frozen=True)
class PrecisionRecipe:
    """Which sides run FP8, and which linear layers stay out of FP8 (glob patterns on module names)."""

    name: str
    rollout_fp8: bool
    train_fp8: bool
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    pow2_scale: bool = False
    check_finite: bool = False

    def __post_init__(self) -> None:
        if self.train_fp8 and not self.rollout_fp8:
            raise ValueError("a recipe that trains in FP8 must also roll out in FP8 (that is the point of it)")
        if isinstance(self.exclude, str):
            raise TypeError("PrecisionRecipe.exclude must be a tuple of glob patterns, not a string")

    @property
    def uses_fp8(self) -> bool:
        return self.rollout_fp8 or self.train_fp8

    def excludes(self, module_name: str) -> bool:
        leaf = module_name.rsplit(".", 1)[-1]
        return any(fnmatch.fnmatchcase(module_name, p) or fnmatch.fnmatchcase(leaf, p) for p in self.exclude)


RECIPES: dict[str, PrecisionRecipe] = {
    "bf16": PrecisionRecipe("bf16", rollout_fp8=False, train_fp8=False),
    "fp8-rollout": PrecisionRecipe("fp8-rollout", rollout_fp8=True, train_fp8=False),
    "jet": PrecisionRecipe("jet", rollout_fp8=True, train_fp8=True),
}


def get_recipe(recipe: str | PrecisionRecipe, **overrides) -> PrecisionRecipe:
    """Look a recipe up by name (``"bf16" | "fp8-rollout" | "jet"``) or pass one through."""
    if not isinstance(recipe, PrecisionRecipe):
        if recipe not in RECIPES:
            raise ValueError(f"unknown precision recipe {recipe!r}; choose one of {sorted(RECIPES)}")
        recipe = RECIPES[recipe]
    return replace(recipe, **overrides) if overrides else recipe


def kv_fp8_train(recipe: str | PrecisionRecipe, kv_fp8: bool) -> bool:
    """Whether the training forward quantizes K and V like the FP8 KV cache (``forward_packed(..., kv_fp8=True)``).

    With ``kv_fp8`` the rollout engine stores its cache in FP8 under every valid recipe; the training forward
    attends over the same quantized values under a recipe that trains in FP8 (``jet``: one precision flow) and not
    under ``fp8-rollout`` (the rollout-only cache peers ship). A ``ValueError`` for ``kv_fp8`` under a recipe that
    rolls out in BF16 (``bf16``, the reference run). The one statement of this rule: the run config and the
    benchmarks' arms both ask here.
    """
    recipe = get_recipe(recipe)
    if kv_fp8 and not recipe.rollout_fp8:
        fp8 = [name for name, r in RECIPES.items() if r.rollout_fp8]
        raise ValueError(f"the FP8 KV cache stores the rollout's K and V in FP8, but recipe {recipe.name!r} rolls out "
                         f"in BF16; use a recipe that rolls out in FP8 ({fp8}: 'jet' quantizes K/V in rollout and "
                         f"training alike, 'fp8-rollout' on the rollout side only)")
    return kv_fp8 and recipe.train_fp8


def apply_recipe(model: nn.Module, recipe: str | PrecisionRecipe) -> nn.Module:
    """Swap the model's linear layers to match ``recipe``, in place, and return the model.

    Linear layers whose names match ``recipe.exclude`` (embeddings, LM head by default) stay plain.
    Parameters are shared, never copied, so an optimizer built before the swap stays valid. Reversible:
    applying ``"bf16"`` turns every ``FP8Linear`` back into ``nn.Linear``.
    """
    recipe = get_recipe(recipe)
    if isinstance(model, nn.Linear):
        raise TypeError("apply_recipe swaps the linear layers inside a model; wrap a bare nn.Linear in a module")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not isinstance(child, nn.Linear):
                continue
            if recipe.uses_fp8 and not recipe.excludes(full):
                new = child if isinstance(child, FP8Linear) else FP8Linear.from_linear(child)
                if new.weight_released and not (recipe.rollout_fp8 and recipe.train_fp8):
                    raise ValueError(f"layer {full!r} dropped its BF16 weight (its values are its optimizer's fp32 "
                                     f"master), so a side without FP8 ({recipe.name}) would read a placeholder: "
                                     f"change the recipe before training starts")
                new.fp8_rollout, new.fp8_train = recipe.rollout_fp8, recipe.train_fp8
                new.pow2_scale, new.check_finite = recipe.pow2_scale, recipe.check_finite
                new.invalidate_weight_cache()
            elif isinstance(child, FP8Linear):
                new = child.to_linear()
            else:
                continue
            setattr(module, child_name, new)
    model.precision_recipe = recipe  # type: ignore[attr-defined]
    return model


def fp8_linears(model: nn.Module) -> list[FP8Linear]:
    """The model's FP8Linear layers."""
    return [m for m in model.modules() if isinstance(m, FP8Linear)]


def fp8_weight_bytes(model: nn.Module) -> int:
    """Bytes of the FP8 weight copies ``model``'s layers hold (data and scales, each storage counted once): what
    an FP8 recipe keeps beyond the model's own parameters."""
    storages = {}
    for layer in fp8_linears(model):
        for q in layer.cached_fp8_tensors():
            for t in (q.data, q.scale):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def refresh_fp8_weights(model: nn.Module, eager: bool = False) -> int:
    """Drop every cached quantized weight and stacked BF16 weight (after an update the version counter may not
    show, e.g. a fused optimizer or a weight load through ``.data``); with ``eager`` make again now what was cached
    (each layer's own weight, the stacked weights of the groups it leads), into the same buffers. Returns the
    number of FP8 layers refreshed."""
    layers = fp8_linears(model)
    for layer in layers:  # every layer first: a group is stale once any of its members is
        layer.invalidate_weight_cache()
    for module in model.modules():
        invalidate_bf16_stacks(module)
        if eager:
            bf16_stacks(module)
    if eager:
        for layer in layers:
            layer.refresh_cached_weights()
    return len(layers)


def check_exact(model: nn.Module) -> None:
    """Raise unless exact on-policy mode makes sense for ``model``'s recipe: both sides in the same precision
    (``bf16``, ``jet``). Under ``fp8-rollout`` the rollout runs FP8 and the training BF16, two different
    policies whose log-probabilities no summation order can make equal."""
    mixed = [name for name, m in model.named_modules() if isinstance(m, FP8Linear) and m.fp8_rollout != m.fp8_train]
    if mixed:
        raise ValueError(f"exact mode needs the same precision on the rollout and training sides (recipes bf16 and "
                         f"jet); layer {mixed[0]!r} rolls out and trains in different precisions (fp8-rollout), so "
                         f"the rollout's log-probabilities cannot equal the trainer's")


__all__ = ["check_exact", "kv_fp8_train", "PrecisionRecipe", "RECIPES", "get_recipe", "apply_recipe",
           "fp8_linears", "fp8_weight_bytes", "refresh_fp8_weights"]
