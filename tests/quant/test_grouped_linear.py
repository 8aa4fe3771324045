"""Linears sharing an input (q/k/v, gate/up) as one stacked FP8 linear (CPU, reference backend): the members'
rows of the stacked weight are their own quantization bitwise, outputs and gradients equal the layers run one by
one, the buffers stay put across weight versions, and an eager refresh re-quantizes the group alone."""

from __future__ import annotations

import pytest
import torch

from jetrl.quant import FP8Linear, grouped_linear, linears_shared_input, refresh_fp8_weights
from jetrl.quant import reference as R
from jetrl.quant.formats import WEIGHT
from jetrl.quant.linear import groupable
from jetrl.quant.weight_cache import _group_cache, _member_weights, _stacked_weights


def _layers(widths, k=256, bias=True, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for n in widths:
        layer = FP8Linear(k, n, bias=bias, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
            if bias:
                layer.bias.copy_(torch.randn(n, generator=g) * 0.1)
        layers.append(layer)
    return tuple(layers)


def _close(a, b, what):
    assert torch.isfinite(a).all(), what
    rel = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
    # the same FP8 operands and fp32 products, summed in another blocking (one GEMM of the stacked width, or
    # three DGrads added): fp32 rounding, far below 1e-5 relative
    assert rel < 1e-5, f"{what}: relative difference {rel:.2e}"


@pytest.mark.parametrize("widths, bias", [((384, 128, 128), True), ((256, 256), False)])
@pytest.mark.parametrize("m", [1, 77, 300])
def test_stacked_linear_equals_the_layers_one_by_one(widths, bias, m):
    layers = _layers(widths, bias=bias, seed=m)
    assert groupable(layers)
    g = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, 256, generator=g)
    dys = [torch.randn(m, n, generator=g) for n in widths]
    # one by one
    x1 = x.clone().requires_grad_()
    outs1 = [layer(x1) for layer in layers]
    sum(float(0) + (o * dy).sum() for o, dy in zip(outs1, dys)).backward()
    ref = ([o.detach() for o in outs1], x1.grad, [l.weight.grad.clone() for l in layers],
           [l.bias.grad.clone() for l in layers] if bias else [])
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    # stacked
    x2 = x.clone().requires_grad_()
    outs2 = linears_shared_input(layers, x2)
    assert len(outs2) == len(widths) and all(o.shape == (m, n) for o, n in zip(outs2, widths))
    sum((o * dy).sum() for o, dy in zip(outs2, dys)).backward()
    for a, b in zip(outs2, ref[0]):
        _close(a.detach(), b, "output")
    _close(x2.grad, ref[1], "grad_input")
    for layer, gw in zip(layers, ref[2]):
        _close(layer.weight.grad, gw, "grad_weight")
    for layer, gb in zip(layers, ref[3]):
        _close(layer.bias.grad, gb, "grad_bias")


def test_members_rows_are_their_own_quantization_and_buffers_stay():
    layers = _layers((384, 128, 128))
    qw, qw_t = _stacked_weights(_group_cache(layers), layers, with_transpose=True)
    for layer, member in zip(layers, _member_weights(qw, layers)):
        own = R.quantize_tensor(layer.weight.detach(), WEIGHT)
        assert torch.equal(member.data.view(torch.uint8), own.data.view(torch.uint8))
        assert torch.equal(member.scale, own.scale)
    assert torch.equal(qw_t.data.view(torch.uint8), qw.data.t().contiguous().view(torch.uint8))
    pointers = (qw.data.data_ptr(), qw.scale.data_ptr(), qw_t.data.data_ptr())
    with torch.no_grad():
        layers[1].weight.mul_(2.0)  # a new weight version of one member: the group re-quantizes, in place
    qw2, qw2_t = _stacked_weights(_group_cache(layers), layers, with_transpose=True)
    assert (qw2.data.data_ptr(), qw2.scale.data_ptr(), qw2_t.data.data_ptr()) == pointers
    member = _member_weights(qw2, layers)[1]
    assert torch.equal(member.data.view(torch.uint8), R.quantize_tensor(layers[1].weight.detach(), WEIGHT).data.view(torch.uint8))
    # the layers' own caches were never made: the group's weight is the only FP8 copy
    assert all(layer._qweight is None for layer in layers)


def test_eager_refresh_requantizes_the_group_only():
    layers = _layers((256, 256), bias=False)
    model = torch.nn.ModuleList(layers)
    x = torch.randn(5, 256)
    with torch.no_grad():
        before = grouped_linear(layers, x)
        for layer in layers:
            layer.weight.data.mul_(-1.0)  # behind autograd's back: the version counter does not move
    assert refresh_fp8_weights(model, eager=True) == 2
    cache = next(iter(layers[0]._group_caches.values()))
    assert cache._qweight_key == tuple(layer.weight_key() for layer in layers)  # fresh: made by the refresh
    with torch.no_grad():
        after = grouped_linear(layers, x)
    assert torch.allclose(after, -before, rtol=1e-6, atol=1e-7)
    assert all(layer._qweight is None for layer in layers)


def test_not_grouped_where_the_layers_differ():
    assert not groupable(_layers((384, 100)))  # a width that is not whole tiles
    mixed = _layers((256, 256))
    mixed[1].fp8_train = mixed[1].fp8_rollout = False
    assert not groupable(mixed)
    assert grouped_linear(mixed, torch.randn(3, 256)) is None
    assert not groupable(_layers((256,)))


def test_backward_on_another_thread_runs_under_the_forwards_context(monkeypatch):
    """Autograd runs a CUDA backward on its own device threads, which start with empty context variables; the FP8
    backward runs in the forward's (here: a fused-implementation choice forced around the forward, read by a spy
    backend in the backward, which runs on a fresh thread as on the GPU)."""
    import threading

    from jetrl.quant import backend
    from jetrl.quant.backend import ReferenceBackend, _FORCED, fused_impl, use_backend

    seen = []

    class Spy(ReferenceBackend):
        def gemm(self, a, b, out_dtype=torch.bfloat16):
            seen.append(_FORCED.get())
            return super().gemm(a, b, out_dtype)

    monkeypatch.setitem(backend._INSTANCES, "reference", Spy())  # the reference backend, spied on
    layer = _layers((256,), bias=False)[0]
    x = torch.randn(7, 256, requires_grad=True)
    with use_backend("reference"):  # process-wide
        with fused_impl("reference"):  # a context variable: the forward's
            y = layer(x)
        seen.clear()
        thread = threading.Thread(target=lambda: y.sum().backward())
        thread.start()
        thread.join()
    assert seen == ["reference", "reference"]  # DGrad and WGrad, under the forward's forced choice
    assert x.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("grouped", [True, False])
def test_without_a_cached_transpose_the_gradients_are_the_same_bits(grouped):
    """``cache_weight_t`` off (the default) keeps no W^T: DGrad transposes W's FP8 tiles per backward, the bytes a
    cached W^T holds, so every gradient is bitwise the cached run's; the caches hold one FP8 copy instead of two."""
    from jetrl.quant.kernels import tuning

    runs = {}
    for cache in (True, False):
        layers = _layers((256, 128), bias=True, seed=11)
        x = torch.randn(77, 256, generator=torch.Generator().manual_seed(12), requires_grad=True)
        with tuning.override(cache_weight_t=cache):
            out = grouped_linear(layers, x) if grouped else torch.cat([layer(x) for layer in layers], dim=1)
            (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
        grads = [x.grad] + [p.grad for layer in layers for p in (layer.weight, layer.bias)]
        assert all(torch.isfinite(g).all() for g in grads)
        if grouped:
            held = [c._qweight_t for c in layers[0]._group_caches.values()]
        else:
            held = [layer._qweight_t for layer in layers]
        assert all((t is not None) == cache for t in held), held
        runs[cache] = grads
    for with_cache, without in zip(runs[True], runs[False]):
        assert torch.equal(with_cache, without)


@pytest.mark.parametrize("grouped", [True, False])
def test_an_eager_refresh_keeps_a_cached_transpose_in_its_buffers(grouped):
    """With ``cache_weight_t`` on, the refresh after an update (``refresh_fp8_weights(eager=True)``, what the trainer
    runs) re-quantizes W^T with W into the same buffers: the update's CUDA graphs, keyed on those storages
    (``storage_key(transposes=True)``), are not captured again every step; the next backward reads the new
    weight's W^T, bitwise a fresh run's gradients."""
    from jetrl.models.cuda_graphs import storage_key
    from jetrl.quant.kernels import tuning

    def step(layers, x):
        out = grouped_linear(layers, x) if grouped else torch.cat([layer(x) for layer in layers], dim=1)
        (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
        return [x.grad] + [p.grad for layer in layers for p in (layer.weight, layer.bias)]

    seed = int(torch.randint(0, 2**31, ()))  # fresh inputs per run
    x = torch.randn(77, 256, generator=torch.Generator().manual_seed(seed))
    layers = _layers((256, 128), bias=True, seed=seed)
    model = torch.nn.ModuleList(layers)
    with tuning.override(cache_weight_t=True):
        step(layers, x.clone().requires_grad_())
        key = storage_key(model, grads=False, transposes=True)
        with torch.no_grad():
            for layer in layers:
                layer.weight.add_(torch.randn_like(layer.weight) * 0.01)
            model.zero_grad()
        refresh_fp8_weights(model, eager=True)
        assert storage_key(model, grads=False, transposes=True) == key
        grads = step(layers, x.clone().requires_grad_())
        fresh = _layers((256, 128), bias=True, seed=seed)
        with torch.no_grad():
            for new, old in zip(fresh, layers):
                new.weight.copy_(old.weight)
        expected = step(fresh, x.clone().requires_grad_())
    for got, want in zip(grads, expected):
        assert torch.isfinite(want).all() and torch.equal(got, want)


def test_current_fp8_tensors_refreshes_in_place_and_copies_nothing_new():
    """What the rollout's CUDA graphs are keyed on: the FP8 weights the layers hold, brought to the current weight
    version in their own buffers. A grouped member holds no copy of its own (its rows live in the group's stacked
    weight), and asking for the current tensors must not make one (a second FP8 copy of q/k/v and gate/up)."""
    from jetrl.quant import fp8_weight_bytes

    layers = _layers((256, 128), bias=False, seed=5)
    model = torch.nn.ModuleList(layers)
    with torch.no_grad():
        grouped_linear(layers, torch.randn(9, 256))
    held = fp8_weight_bytes(model)
    assert held == (256 + 128) * 256 + 3 * 2 * 4  # one E4M3 byte per weight, the stacked weight's scales
    before = [q.data.data_ptr() for layer in layers for q in layer.current_fp8_tensors()]
    assert all(layer._qweight is None for layer in layers) and fp8_weight_bytes(model) == held
    with torch.no_grad():
        layers[1].weight.mul_(3.0)  # a new version: the group's weight is stale
    fresh = [q for layer in layers for q in layer.current_fp8_tensors()]
    assert [q.data.data_ptr() for q in fresh] == before  # re-quantized in place
    rows = _member_weights(fresh[0], layers)[1]
    own = R.quantize_tensor(layers[1].weight.detach(), WEIGHT)
    assert torch.equal(rows.data.view(torch.uint8), own.data.view(torch.uint8))
    assert fp8_weight_bytes(model) == held


def test_current_fp8_tensors_without_transposes_lists_the_forward_weights_only():
    """The rollout keys its decode graphs on the weights a forward reads: a W^T cached by the update
    (``cache_weight_t``) must not change that key, or the graphs would be captured again after the first update."""
    from jetrl.quant.kernels import tuning

    layers = _layers((256, 128), bias=False, seed=6)
    x = torch.randn(9, 256)
    with torch.no_grad():
        grouped_linear(layers, x)
    before = [q.data.data_ptr() for q in layers[0].current_fp8_tensors(transposes=False)]
    with tuning.override(cache_weight_t=True):
        grouped_linear(layers, x.clone().requires_grad_()).sum().backward()
    assert len(layers[0].current_fp8_tensors()) == 2  # W and the update's W^T
    assert [q.data.data_ptr() for q in layers[0].current_fp8_tensors(transposes=False)] == before
