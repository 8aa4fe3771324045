"""One FP8Linear training step on the CUDA backend checked against the reference backend (the GPU tests' shared
check): gradients finite and within 4e-3 relative error (the FP8 GEMMs differ from the reference only in fp32
summation order and BF16 output rounding: orders of magnitude below a wrong scale or block)."""

from __future__ import annotations

from typing import Callable

import torch

from jetrl.quant import FP8Linear, use_backend


def step_matches_reference(m: int, monkeypatch, step: Callable | None = None) -> None:
    """A seeded ``FP8Linear(1536, 896)`` forward + backward at ``m`` tokens on CUDA through ``step(layer, x, gy)``
    (default: plain; the caller's spies, set with ``monkeypatch``, see its GEMMs), then ``monkeypatch.undo()`` and
    the same step on the reference backend; compares the input, weight and bias gradients."""
    torch.manual_seed(m)
    layer = FP8Linear(1536, 896, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, 1536, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(m, 896, device="cuda", dtype=torch.bfloat16)
    xi = x.clone().requires_grad_()
    (step or (lambda layer, x, gy: layer(x).backward(gy)))(layer, xi, gy)
    got = (xi.grad.float(), layer.weight.grad.float().clone(), layer.bias.grad.float().clone())
    monkeypatch.undo()
    layer.weight.grad = layer.bias.grad = None
    with use_backend("reference"):
        layer.invalidate_weight_cache()
        xr = x.clone().requires_grad_()
        layer(xr).backward(gy)
    refs = (xr.grad.float(), layer.weight.grad.float(), layer.bias.grad.float())
    for out, ref, what in zip(got, refs, ("grad_input", "grad_weight", "grad_bias")):
        assert torch.isfinite(out).all(), what
        rel = float((out - ref).norm() / ref.norm())
        assert rel < 4e-3, f"{what}: relative error {rel:.2e} between backends"
