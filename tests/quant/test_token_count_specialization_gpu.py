"""A new token count compiles nothing: every kernel of a training step and of a rollout compiles once per recipe.

Triton specializes integer arguments on their divisibility by 16 (and on == 1) unless told not to. A real run's
micro-batches and decode batches have every token count, so a kernel specialized on one (or on a stride derived
from it) compiles again whenever the count's divisibility changes, mid-run: seconds per step (the update's
per-step times swung 2.6 -> 5.6 s at 1.5B). The kernels therefore take token counts and the strides that follow
them with ``do_not_specialize`` / ``do_not_specialize_on_alignment``. One kernel keeps M's specialization by design:
the split-K decode GEMM, which the rollout replays at its CUDA graphs' batch sizes (1, 2, 4, 8, then multiples of
16), where the aligned variant is the faster one (BENCHMARKS.md, "Shape conditions"); its variants are bounded (M
and its scales' row stride divisible by 16 or not, and its split-K config by M) and all of them compile in a run's first rollout, where
the batch shrinks through every graph size. The test leaves it out (:data:`SPECIALIZED_ON_M`). This test warms every path at one count per
size class and then runs counts of every divisibility (4, 16, 48, 128, 1,000, 4,096, 777): no kernel may gain a
compiled variant.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import jetrl.models as jm
import jetrl.quant.kernels as kernels_pkg

pytestmark = pytest.mark.gpu

CFG = dict(model_type="qwen2", vocab_size=1000, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
           num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)


# kernels that keep M's specialization by design (see the module docstring)
SPECIALIZED_ON_M = {"gemm_decode_triton._fp8_decode_gemm_kernel"}


def _jit_functions():
    """Every Triton/Gluon kernel of :mod:`jetrl.quant.kernels` (module-level, and the lazily built Gluon ones)."""
    from triton.runtime.jit import JITFunction

    found = {}
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        module = importlib.import_module(f"{kernels_pkg.__name__}.{info.name}")
        values = list(vars(module).values())
        if callable(getattr(module, "_kernels", None)):
            values += list(module._kernels())
        for value in values:
            if isinstance(value, JITFunction):
                found[f"{info.name}.{value.fn.__name__}"] = value
    return found


def _variants(functions) -> dict[str, int]:
    """Compiled variants per kernel: the entries of each device's kernel cache (the tuple's first item)."""
    return {name: sum(len(cache[0]) for cache in fn.device_caches.values()) for name, fn in functions.items()}


def _train_step(model, lengths):
    gen = torch.Generator(device="cuda").manual_seed(sum(lengths))
    total = sum(lengths)
    ids = torch.randint(2, CFG["vocab_size"], (total,), device="cuda", generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths]).cuda()
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    lp, _ = jm.token_logprobs(model, ids, pos, cu, max(lengths), torch.roll(ids, -1))
    assert torch.isfinite(lp).all()
    lp.sum().backward()
    model.zero_grad(set_to_none=True)


def _rollout_forward(model, lengths):
    """The rollout side's forward (decode-sized counts take the split-K decode GEMM)."""
    from jetrl.quant import precision_side

    total = sum(lengths)
    ids = torch.randint(2, CFG["vocab_size"], (total,), device="cuda")
    pos = torch.cat([torch.arange(n) for n in lengths]).cuda()
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    with torch.no_grad(), precision_side("rollout"):
        hidden = model.forward_packed(ids, pos, cu, max(lengths))
    assert torch.isfinite(hidden.float()).all()


@pytest.mark.parametrize("recipe", ["jet", "bf16"])
def test_a_new_token_count_compiles_no_kernel(recipe):
    functions = _jit_functions()
    assert len(functions) >= 20, sorted(functions)
    model = jm.build_model(CFG, dtype=torch.bfloat16, device="cuda", recipe=recipe, seed=3)
    # warm-up: one count per size class (small-M kernels pick their row tile by the next power of two of M, and
    # a decode-sized M takes the decode GEMM: bounded classes, all met in a run's first rollout), then 1,001 tokens
    for count in (1, 2, 3, 5, 9, 17, 33, 65):
        _train_step(model, [count])
        _rollout_forward(model, [1] * count)
    for count in (13, 16, 48):
        _rollout_forward(model, [1] * count)
        _train_step(model, [count])
    _train_step(model, [300, 701])
    _train_step(model, [2000, 2097])  # the norm backward's row tiles per program: a power of two by M's size
    before = _variants(functions)
    # the same classes at counts of every divisibility by 16
    for lengths in ([4], [16], [32], [48], [100, 28], [999, 1], [4000, 96], [777], [5, 6, 7]):
        _train_step(model, lengths)
    for lengths in ([1] * 32, [1] * 64, [7] * 5, [2, 2], [1] * 29):
        _rollout_forward(model, lengths)
    torch.cuda.synchronize()
    after = _variants(functions)
    assert SPECIALIZED_ON_M <= set(functions)
    grown = {name: (before[name], after[name]) for name in functions
             if after[name] != before[name] and name not in SPECIALIZED_ON_M}
    assert not grown, f"kernels compiled again for another token count (before, after): {grown}"
    assert sum(before.values()) > (5 if recipe == "jet" else 1), before  # the path ran Triton kernels at all
