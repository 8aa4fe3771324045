"""Plain linears that read the same input (q/k/v, gate/up under ``bf16``) as one GEMM over their stacked weight
when decoding on a GPU: the outputs are the layers' own, only decode-sized no-grad CUDA inputs take the stack (the
CPU runs the layers one by one), the stack follows every weight version into the same buffers (CPU), and the decode
graphs' key names it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from jetrl.models.cuda_graphs import storage_key
from jetrl.quant import FP8Linear, bf16_stacks, grouped_linear, linears_shared_input, refresh_fp8_weights
from jetrl.quant.kernels.tuning import DECODE_GEMM_MAX_M
from jetrl.quant.weight_cache import bf16_stacked


def _layers(widths, k=200, bias=True, dtype=torch.bfloat16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for n in widths:
        layer = nn.Linear(k, n, bias=bias, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
            if bias:
                layer.bias.copy_(torch.randn(n, generator=g) * 0.1)
        layers.append(layer.to(device))
    return tuple(layers)


def _one_by_one(layers, x):
    return torch.cat([layer(x) for layer in layers], dim=1)


def _close(a, b, dtype):
    assert torch.isfinite(a).all()
    rel = float((a.double() - b.double()).norm() / b.double().norm())
    # the same products summed in another blocking (one GEMM of the stacked width): fp32 rounding in fp32; in BF16
    # an output may round to the neighbouring BF16 value (2^-8 relative), so the norm of the differences stays below
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    assert rel < tol, f"relative difference {rel:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("widths, bias", [((192, 64, 64), True), ((333, 333), False)])
@pytest.mark.parametrize("m", [1, 77, DECODE_GEMM_MAX_M])
def test_decode_sized_inputs_run_one_stacked_gemm_with_the_layers_outputs(widths, bias, m, dtype):
    layers = _layers(widths, bias=bias, dtype=dtype, seed=m, device="cuda")
    x = torch.randn(m, 200, generator=torch.Generator().manual_seed(100 + m)).to("cuda", dtype)
    with torch.no_grad():
        out = grouped_linear(layers, x)
        parts = linears_shared_input(layers, x)
        ref = _one_by_one(layers, x)
    assert out is not None and out.shape == (m, sum(widths)) and out.dtype == dtype
    _close(out, ref, dtype)
    assert torch.equal(torch.cat(parts, dim=1), out)
    (stack,) = bf16_stacks(layers[0])
    assert torch.equal(stack.weight, torch.cat([layer.weight for layer in layers]))
    assert all(not bf16_stacks(layer) for layer in layers[1:])


def test_the_cpu_runs_the_layers_one_by_one():
    """The CPU's GEMMs give a row the same bits whatever rows share the call, which the stacked weight's would not
    keep (bf16's on-policy check on the CPU)."""
    layers = _layers((192, 64, 64))
    with torch.no_grad():
        assert grouped_linear(layers, torch.randn(5, 200).bfloat16()) is None
    assert not bf16_stacks(layers[0])


@pytest.mark.gpu
def test_training_prefill_and_exact_inputs_run_the_layers_one_by_one():
    layers = _layers((192, 64, 64), device="cuda")
    x = torch.randn(DECODE_GEMM_MAX_M + 1, 200, device="cuda").bfloat16()
    with torch.no_grad():
        assert grouped_linear(layers, x) is None  # a prefill or a training forward
        assert grouped_linear(layers, x[:5], exact=True) is None  # each layer's batch-invariant GEMM
    assert grouped_linear(layers, x[:5]) is None  # with grad: each layer its own weight gradient
    assert not bf16_stacks(layers[0])


@pytest.mark.gpu
def test_layers_that_cannot_stack_run_one_by_one():
    x = torch.randn(9, 200, device="cuda").bfloat16()
    mixed_bias = _layers((64,), device="cuda") + _layers((64,), bias=False, device="cuda")
    fp8_member = _layers((128,), device="cuda") + (FP8Linear(200, 128, dtype=torch.bfloat16, device="cuda"),)
    wider = _layers((64,), device="cuda") + _layers((64,), k=256, device="cuda")
    with torch.no_grad():
        for layers in (mixed_bias, fp8_member, wider):
            assert grouped_linear(layers, x) is None
            assert not bf16_stacks(layers[0])
        assert grouped_linear(_layers((64, 64), device="cuda"), x.float()) is None  # not the weights' dtype


def _stacked(layers):
    return torch.cat([layer.weight for layer in layers]), torch.cat([layer.bias for layer in layers])


def test_the_stack_follows_each_weight_version_in_its_own_buffers():
    """The stack's mechanics (the same on any device): a copy of the members, bitwise, made again into its own
    buffers when a weight moves in place, and, behind the version counter, after the refresh the optimizer runs."""
    layers = _layers((192, 64, 64))
    model = nn.ModuleList(layers)
    with torch.no_grad():
        stack = bf16_stacked(layers)
        pointers = (stack.weight.data_ptr(), stack.bias.data_ptr())
        assert all(torch.equal(a, b) for a, b in zip((stack.weight, stack.bias), _stacked(layers)))
        layers[1].weight.mul_(-2.0)  # in place: the version counter moves
        layers[2].bias.add_(1.0)
        assert bf16_stacked(layers) is stack
        assert all(torch.equal(a, b) for a, b in zip((stack.weight, stack.bias), _stacked(layers)))
        layers[0].weight.data.copy_(torch.randn(192, 200))  # behind the version counter
        refresh_fp8_weights(model)
        assert torch.equal(bf16_stacked(layers).weight, _stacked(layers)[0])
        layers[2].weight.data.zero_()
        refresh_fp8_weights(model, eager=True)  # copied now, before any forward
        assert torch.equal(stack.weight[256:], torch.zeros(64, 200, dtype=torch.bfloat16))
    assert bf16_stacks(layers[0]) == [stack] and not bf16_stacks(layers[1])
    assert (stack.weight.data_ptr(), stack.bias.data_ptr()) == pointers


def test_the_graphs_key_names_the_stacks_and_brings_them_current():
    layers = _layers((64, 64), bias=False)
    model = nn.ModuleList(layers)
    before = storage_key(model, grads=False, transposes=False)
    with torch.no_grad():
        bf16_stacked(layers)  # as a decode step on the GPU makes it
    key = storage_key(model, grads=False, transposes=False)
    assert key != before and bf16_stacks(layers[0])[0].weight.data_ptr() in key
    with torch.no_grad():
        layers[0].weight.mul_(0.5)
    assert storage_key(model, grads=False, transposes=False) == key  # the graphs stay valid ...
    assert torch.equal(bf16_stacks(layers[0])[0].weight[:64], layers[0].weight)  # ... and read the new weight


def test_groups_of_wide_members_are_not_stacked():
    """A member of at most BF16_STACK_MAX_MEMBER_BYTES makes the group's one GEMM pay; members that all read more
    run at about copy speed on their own, and a second copy of their weights would buy nothing."""
    from jetrl.quant.weight_cache import BF16_STACK_MAX_MEMBER_BYTES, _bf16_stackable

    k = 2048
    rows = BF16_STACK_MAX_MEMBER_BYTES // (2 * k)  # a member of exactly the bound, in BF16

    def linears(*widths):
        return tuple(nn.Linear(k, n, bias=False, device="meta", dtype=torch.bfloat16) for n in widths)

    x = torch.empty(9, k, device="meta", dtype=torch.bfloat16)
    assert not _bf16_stackable(linears(rows + 1, rows + 1), x)
    assert _bf16_stackable(linears(rows + 1, rows), x) and _bf16_stackable(linears(rows, rows + 1, rows + 1), x)
    assert _bf16_stackable(linears(4 * rows, 16, 16), x)  # q/k/v with narrow k and v
