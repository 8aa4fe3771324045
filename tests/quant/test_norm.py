"""Fused residual add + RMSNorm (+ 1x128 FP8 output): reference path, Triton kernels, autograd.

* CPU: the reference path is bitwise the model's unfused formulas (forward and autograd), dispatch picks
  it on CPU, bad inputs raise clear errors.
* CPU, Triton interpreter (a child process with ``TRITON_INTERPRET=1``): the kernels against the
  reference, forward and backward, whole-row and chunked tiles, with and without residual and FP8.
* GPU (``gpu`` marker): the same at realistic shapes, auto dispatch and CUDA-graph capture.

Tolerances (relative Frobenius norm of the difference):

* ``out``: the kernel sums the squares in another order than torch, so ``rstd`` may differ by a few fp32
  ulps; that can flip the rounding of ``normed`` and ``out`` by one ulp of their dtype where a value sits on
  a rounding edge, never more: bounded by the dtype's relative ulp (bf16 2^-8, fp16 2^-10) and, in fp32,
  by a few ulps (1e-6). The residual stream (an add, no reduction) and the FP8 bytes and scales (derived
  from the returned ``out``) must be bitwise equal.
* gradients: the kernel computes the backward in fp32 with no intermediate rounding, the reference's
  autograd rounds ``g * w``, the normalised-value gradient and each ``g * normed`` to the activation
  dtype (2^-9 relative each, partly amplified by the projection in the x-gradient): 1e-2 for bf16/fp16;
  fp32 differs only by summation order over D (1e-5).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from jetrl.quant import reference as R
from jetrl.quant.norm import NormOutput, rms_norm, rms_norm_reference

from interpreted import run_interpreted

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
OUT_TOL = {"bfloat16": 2.0**-8, "float16": 2.0**-10, "float32": 1e-6}
GRAD_TOL = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-5}

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (pip install triton)")


def unfused(x, weight, eps, residual=None):
    """The decoder's unfused code: residual add, then RMSNorm.forward of jetrl.models.transformer."""
    h = x + residual if residual is not None else x
    in_dtype = h.dtype
    h32 = h.float()
    h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h32.to(in_dtype), h


def _inputs(shape, dtype, gen, wdtype=None):
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    r = torch.randn(shape, generator=gen).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(wdtype or dtype)
    return x, r, w


def _fp8_bitwise(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# --------------------------------------------------------------------------------------------------
# reference path on CPU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 5), (7, 128), (2, 3, 200), (64, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_reference_is_bitwise_the_unfused_model_code(gen, shape, dtype, with_residual):
    x, r, w = _inputs(shape, dtype, gen)
    res = r if with_residual else None
    got = rms_norm_reference(x, w, EPS, res)
    want, h = unfused(x, w, EPS, res)
    assert isinstance(got, NormOutput)
    assert got.out.dtype == want.dtype and got.out.shape == x.shape
    assert torch.equal(got.out, want)
    assert not torch.isnan(got.out).any()
    assert got.out_fp8 is None
    if with_residual:
        assert torch.equal(got.residual, h)
    else:
        assert got.residual is None
    # the public function picks the reference on CPU: same bits
    auto = rms_norm(x, w, EPS, res)
    assert torch.equal(auto.out, want)


def test_reference_follows_torch_promotion_for_a_weight_of_another_dtype(gen):
    x, _, w = _inputs((5, 96), torch.bfloat16, gen, wdtype=torch.float32)
    got = rms_norm(x, w, EPS)
    want, _ = unfused(x, w, EPS)
    assert got.out.dtype == torch.float32
    assert torch.equal(got.out, want)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(3, 4, 300), (9, 128), (2, 64)])
def test_reference_fp8_is_the_act_quantization_of_out(gen, shape, pow2):
    x, r, w = _inputs(shape, torch.bfloat16, gen)
    got = rms_norm(x, w, EPS, r, quantize=True, pow2_scale=pow2)
    d = shape[-1]
    data, scale = R.quantize(got.out.reshape(-1, d), (1, 128), pow2)
    assert got.out_fp8.block == (1, 128)
    assert _fp8_bitwise(got.out_fp8.data, data)
    assert torch.equal(got.out_fp8.scale, scale)
    assert not got.out_fp8.data.requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_gradients_are_autograd_of_the_unfused_code(gen, dtype):
    x, r, w = _inputs((6, 200), dtype, gen)
    g_out, g_res = torch.randn(6, 200, generator=gen).to(dtype), torch.randn(6, 200, generator=gen).to(dtype)
    grads = []
    for fn in (lambda *a: tuple(rms_norm(*a, quantize=True)[:2]), unfused):
        xi, ri, wi = (t.clone().requires_grad_() for t in (x, r, w))
        out, h = fn(xi, wi, EPS, ri)
        ((out.float() * g_out.float()).sum() + (h.float() * g_res.float()).sum()).backward()
        grads.append((xi.grad, ri.grad, wi.grad))
    for a, b in zip(*grads):
        assert a is not None and torch.equal(a, b)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x, w, r: rms_norm(x, w[:-1], EPS), ValueError, "weight must have shape"),
        (lambda x, w, r: rms_norm(x, w[None], EPS), ValueError, "weight must have shape"),
        (lambda x, w, r: rms_norm(x, w, EPS, r[:-1]), ValueError, "residual shape"),
        (lambda x, w, r: rms_norm(x, w, EPS, r.half()), TypeError, "residual dtype"),
        (lambda x, w, r: rms_norm(x.int(), w, EPS), TypeError, "bf16/fp16/fp32"),
        (lambda x, w, r: rms_norm(x[:, :0], w[:0], EPS), ValueError, "non-empty last dimension"),
        (lambda x, w, r: rms_norm(x, w, -1.0), ValueError, "eps"),
        (lambda x, w, r: rms_norm(x, w, "1e-6"), ValueError, "eps"),
        (lambda x, w, r: rms_norm(x.numpy(), w, EPS), TypeError, "x must be a torch.Tensor"),
        (lambda x, w, r: rms_norm(x, w, EPS, impl="cuda"), ValueError, "impl must be one of"),
        (lambda x, w, r: rms_norm(x.double(), w.double(), EPS, impl="triton"), TypeError, "Triton kernels take"),
        (lambda x, w, r: rms_norm(x, w, EPS, impl="triton"), ValueError, "needs CUDA tensors"),
    ],
)
def test_bad_inputs_raise_clear_errors(gen, monkeypatch, call, error, match):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, r, w = _inputs((4, 64), torch.float32, gen)
    with pytest.raises(error, match=match):
        call(x, w, r)


# --------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (child process)

_CHILD = r'''
import json, sys
import torch
from jetrl.quant import reference as R
from jetrl.quant.kernels import norm_triton as NT
from jetrl.quant.norm import rms_norm

EPS = 1e-6
g = torch.Generator().manual_seed(11)

def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))

def fp8_same(t, out):
    data, scale = R.quantize(out.reshape(-1, out.shape[-1]), (1, 128), t["pow2"])
    return (t["q"].data.shape == data.shape and torch.equal(t["q"].data.view(torch.uint8), data.view(torch.uint8))
            and torch.equal(t["q"].scale, scale))

def run(shape, dtype, wdtype, with_res, quantize, pow2, zero_row, noncontig, grads="all", tiles=None):
    """Triton against the reference. ``tiles`` (forward, backward ``max_tile``) drives the kernel wrappers
    directly with those tile limits (rows longer than them walked in chunks); None: through ``rms_norm``
    and its autograd function, with the default tiles."""
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(wdtype)
    if zero_row:
        x[0] = 0
        r[0] = 0
    g_out = torch.randn(shape, generator=g).to(torch.promote_types(dtype, wdtype))
    g_res = torch.randn(shape, generator=g).to(dtype)
    res = {}
    for impl in ("triton", "reference"):
        if impl == "triton" and tiles is not None:
            assert grads == "all" and not noncontig
            res[impl] = run_tiled(x, r if with_res else None, w, quantize, pow2, g_out, g_res, tiles)
            continue
        xi, ri, wi = (t.clone().requires_grad_() for t in (x, r, w))
        if noncontig:  # rows of a wider leaf: unit last stride, row stride 2D (a clone of a slice is contiguous)
            xi = torch.cat([x, x], -1).requires_grad_()
        if grads == "weight":
            xi.requires_grad_(False)
            ri.requires_grad_(False)
        x_in = xi[..., : shape[-1]] if noncontig else xi
        o = rms_norm(x_in, wi, EPS, ri if with_res else None, quantize=quantize, pow2_scale=pow2, impl=impl)
        loss = 0
        if grads != "residual_only":
            loss = (o.out.float() * g_out.float()).sum()
        if with_res and grads in ("all", "residual_only"):
            loss = loss + (o.residual.float() * g_res.float()).sum()
        loss.backward()
        res[impl] = dict(out=o.out.detach(), h=o.residual, q=o.out_fp8, pow2=pow2,
                         dx=xi.grad[..., : shape[-1]] if noncontig else xi.grad, dr=ri.grad if with_res else None,
                         dw=wi.grad)
    t, f = res["triton"], res["reference"]
    rep = {"dtype": str(dtype)[6:], "out_rel": rel(t["out"], f["out"]), "out_dtype": t["out"].dtype == f["out"].dtype,
           "shape": list(t["out"].shape) == list(shape), "nan": bool(torch.isnan(t["out"].float()).any())}
    rep["residual"] = (t["h"] is None and f["h"] is None) if not with_res else torch.equal(t["h"], f["h"])
    if quantize:
        rep["fp8"] = fp8_same(t, t["out"]) and not t["q"].data.requires_grad
    for k in ("dx", "dr", "dw"):
        if f[k] is not None or t[k] is not None:
            ok = t[k] is not None and f[k] is not None and t[k].dtype == f[k].dtype
            rep[k] = rel(t[k], f[k]) if ok else None
            rep[k + "_nan"] = bool(torch.isnan(t[k].float()).any()) if t[k] is not None else True
    return rep

def run_tiled(x, r, w, quantize, pow2, g_out, g_res, tiles):
    """The kernels' forward and backward with explicit tile limits, fed the gradients that autograd of
    ``(out.float() * g_out.float()).sum() + (residual.float() * g_res.float()).sum()`` passes to them."""
    shape, d = x.shape, x.shape[-1]
    x2 = x.reshape(-1, d)
    r2 = r.reshape(-1, d) if r is not None else None
    out, h, rstd, q = NT.rms_norm_forward(x2, r2, w, EPS, quantize, pow2, max_tile=tiles[0])
    dh, dw = NT.rms_norm_backward(g_out.reshape(-1, d).to(out.dtype), g_res.reshape(-1, d) if r is not None else None,
                                  h if r is not None else x2, w, rstd, max_tile=tiles[1])
    return dict(out=out.view(shape), h=h.view(shape) if h is not None else None, q=q, pow2=pow2,
                dx=dh.view(shape), dr=dh.view(shape) if r is not None else None, dw=dw)

cases = {}
for tiles in (None, (128, 128)):  # whole rows in registers (defaults) / rows walked in 128-wide chunks
    label = "default" if tiles is None else tiles[0]
    for shape in [(1, 5), (7, 128), (33, 200), (3, 300), (40, 64), (2, 3, 136)]:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for with_res in (True, False):
                q = shape[-1] != 64 or with_res
                key = f"tile{label}-{shape}-{str(dtype)[6:]}-res{int(with_res)}"
                cases[key] = run(shape, dtype, dtype, with_res, q, dtype == torch.float16, False, False, tiles=tiles)
    cases[f"tile{label}-zero-row-pow2"] = run((5, 260), torch.bfloat16, torch.bfloat16, True, True, True, True, False,
                                              tiles=tiles)
cases["weight-fp32-x-bf16"] = run((9, 200), torch.bfloat16, torch.float32, True, True, False, False, False)
cases["tile128-weight-fp32-x-bf16"] = run((9, 200), torch.bfloat16, torch.float32, True, True, False, False, False,
                                          tiles=(128, 128))
cases["noncontiguous-rows"] = run((6, 130), torch.bfloat16, torch.bfloat16, True, True, False, False, True)
cases["noncontiguous-rows-no-residual"] = run((6, 130), torch.bfloat16, torch.bfloat16, False, True, False, False,
                                              True)
cases["weight-grad-only"] = run((12, 96), torch.float32, torch.float32, True, False, False, False, False, "weight")
cases["residual-output-only"] = run((12, 96), torch.bfloat16, torch.bfloat16, True, False, False, False, False,
                                    "residual_only")

# x and residual from one leaf: the one gradient tensor returned for both must accumulate correctly
shared = {}
for impl in ("triton", "reference"):
    gg = torch.Generator().manual_seed(5)
    a = torch.randn(10, 200, generator=gg).requires_grad_()
    w = (1 + 0.2 * torch.randn(200, generator=gg)).requires_grad_()
    o = rms_norm(a * 2, w, EPS, a * 3, impl=impl)
    (o.out * torch.randn(10, 200, generator=gg)).sum().add((o.residual * o.residual).sum()).backward()
    shared[impl] = a.grad
cases["shared-leaf"] = {"dtype": "float32", "dx": rel(shared["triton"], shared["reference"]), "dx_nan": False,
                        "out_rel": 0.0, "out_dtype": True, "shape": True, "nan": False, "residual": True}

# no rows
x = torch.randn(0, 64)
o = rms_norm(x, torch.randn(64), EPS, torch.randn(0, 64), quantize=True, impl="triton")
empty = o.out.shape == (0, 64) and o.residual.shape == (0, 64) and tuple(o.out_fp8.scale.shape) == (0, 1)
json.dump({"cases": cases, "empty": empty}, sys.stdout)
'''


@needs_triton
def test_tile_limits_are_parameters_defaulting_to_the_module_constants():
    import inspect

    from jetrl.quant.kernels import norm_triton as NT

    for fn, default in ((NT.rms_norm_forward, NT.MAX_FWD_TILE), (NT.rms_norm_backward, NT.MAX_BWD_TILE)):
        param = inspect.signature(fn).parameters["max_tile"]
        assert param.kind is param.KEYWORD_ONLY and param.default == default
    x, w = torch.randn(2, 256), torch.ones(256)
    for bad in (64, 192, 0, 128.0, True):  # below one 1x128 group, not a power of two, not an int
        with pytest.raises(ValueError, match="max_tile"):
            NT.rms_norm_forward(x, None, w, EPS, max_tile=bad)
        with pytest.raises(ValueError, match="max_tile"):
            NT.rms_norm_backward(x, None, x, w, torch.ones(2), max_tile=bad)


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "norm kernels")


@needs_triton
def test_interpreted_forward_matches_reference(interpreted):
    cases = interpreted["cases"]
    assert len(cases) >= 70
    bad = {k: c for k, c in cases.items()
           if c["nan"] or not c["shape"] or not c["out_dtype"] or not c["residual"]
           or not c["out_rel"] <= OUT_TOL[c["dtype"]]}
    assert not bad, f"forward differs from the reference: {bad}"


@needs_triton
def test_interpreted_fp8_bitwise_equals_quantizing_out(interpreted):
    cases = {k: c for k, c in interpreted["cases"].items() if "fp8" in c}
    assert len(cases) >= 30
    bad = [k for k, c in cases.items() if not c["fp8"]]
    assert not bad, f"FP8 of out differs from reference.quantize(out): {bad}"


@needs_triton
def test_interpreted_backward_matches_reference_autograd(interpreted):
    checked = 0
    bad = {}
    for key, c in interpreted["cases"].items():
        for k in ("dx", "dr", "dw"):
            if k in c:
                checked += 1
                if c[k + "_nan"] or c[k] is None or not c[k] <= GRAD_TOL[c["dtype"]]:
                    bad[f"{key}:{k}"] = c[k]
    assert checked >= 150
    assert not bad, f"gradients differ from autograd of the reference: {bad}"


@needs_triton
def test_interpreted_empty_input(interpreted):
    assert interpreted["empty"]


# --------------------------------------------------------------------------------------------------
# GPU: the kernels at realistic shapes


def _cuda_inputs(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(shape, generator=g, device="cuda") * 3).to(dtype)
    r = torch.randn(shape, generator=g, device="cuda").to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g, device="cuda")).to(dtype)
    return x, r, w


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("d", [128, 1536, 4096, 5120, 14336, 16384, 20000])
@pytest.mark.parametrize("m", [1, 64, 4096])
def test_gpu_forward_matches_reference(m, d, with_residual, pow2):
    x, r, w = _cuda_inputs((m, d), torch.bfloat16, seed=m * 7 + d)
    res = r if with_residual else None
    t = rms_norm(x, w, EPS, res, quantize=True, pow2_scale=pow2, impl="triton")
    f = rms_norm(x, w, EPS, res, quantize=True, pow2_scale=pow2, impl="reference")
    assert not torch.isnan(t.out).any()
    assert _rel(t.out, f.out) <= OUT_TOL["bfloat16"]
    # one-ulp flips only where a value sits on a rounding edge: a small fraction of the elements
    assert (t.out != f.out).float().mean().item() <= 0.01
    if with_residual:
        assert torch.equal(t.residual, f.residual)
    data, scale = R.quantize(t.out, (1, 128), pow2)
    assert _fp8_bitwise(t.out_fp8.data, data)
    assert torch.equal(t.out_fp8.scale, scale)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_forward_other_dtypes(dtype):
    x, r, w = _cuda_inputs((333, 4096), dtype, seed=3)
    t = rms_norm(x, w, EPS, r, quantize=True, impl="triton")
    f = rms_norm(x, w, EPS, r, quantize=True, impl="reference")
    assert _rel(t.out, f.out) <= OUT_TOL[str(dtype)[6:]]
    assert torch.equal(t.residual, f.residual)
    data, scale = R.quantize(t.out, (1, 128))
    assert _fp8_bitwise(t.out_fp8.data, data) and torch.equal(t.out_fp8.scale, scale)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, d", [(1, 4096), (64, 128), (4096, 4096), (4096, 128), (300, 14336), (64, 16384),
                                  (64, 20000)])
def test_gpu_backward_matches_reference_autograd(m, d, dtype):
    x, r, w = _cuda_inputs((m, d), dtype, seed=m + d)
    g = torch.Generator(device="cuda").manual_seed(1)
    g_out = torch.randn(m, d, generator=g, device="cuda").to(dtype)
    g_res = torch.randn(m, d, generator=g, device="cuda").to(dtype)
    grads = {}
    for impl in ("triton", "reference"):
        xi, ri, wi = (t.clone().requires_grad_() for t in (x, r, w))
        o = rms_norm(xi, wi, EPS, ri, quantize=True, impl=impl)
        ((o.out.float() * g_out.float()).sum() + (o.residual.float() * g_res.float()).sum()).backward()
        grads[impl] = (xi.grad, ri.grad, wi.grad)
    # the weight gradient sums m products: fp32 reorderings grow with m (and bf16 reference rounding)
    tol = GRAD_TOL[str(dtype)[6:]]
    for name, a, b in zip(("dx", "dresidual", "dweight"), grads["triton"], grads["reference"]):
        assert a.dtype == b.dtype and not torch.isnan(a).any(), name
        assert _rel(a, b) <= (tol if dtype != torch.float32 or name != "dweight" else 1e-4), name


@pytest.mark.gpu
@needs_triton
def test_gpu_per_head_norm_keeps_shape():
    """Qwen3's q/k norm: (tokens, heads, head_dim=128)."""
    x, _, w = _cuda_inputs((77, 32, 128), torch.bfloat16, seed=9)
    t = rms_norm(x, w, EPS, impl="triton")
    f = rms_norm(x, w, EPS, impl="reference")
    assert t.out.shape == x.shape and t.residual is None
    assert _rel(t.out, f.out) <= OUT_TOL["bfloat16"]


@pytest.mark.gpu
@needs_triton
def test_gpu_auto_dispatch_uses_the_kernels_on_the_cuda_backend():
    from jetrl.quant import get_backend

    if get_backend("cuda").name != "cuda":
        pytest.skip("the FP8 backend of this GPU is not 'cuda' (needs sm_90+)")
    x, r, w = _cuda_inputs((64, 4096), torch.bfloat16, seed=4)
    auto = rms_norm(x, w, EPS, r, quantize=True)
    t = rms_norm(x, w, EPS, r, quantize=True, impl="triton")
    assert torch.equal(auto.out, t.out) and torch.equal(auto.residual, t.residual)
    assert _fp8_bitwise(auto.out_fp8.data, t.out_fp8.data)


@pytest.mark.gpu
@needs_triton
def test_gpu_cuda_graph_replay_equals_eager():
    x, r, w = _cuda_inputs((16, 4096), torch.bfloat16, seed=5)
    eager = rms_norm(x, w, EPS, r, quantize=True, impl="triton")  # also compiles before capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rms_norm(x, w, EPS, r, quantize=True, impl="triton")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rms_norm(x, w, EPS, r, quantize=True, impl="triton")
    x2, r2, _ = _cuda_inputs((16, 4096), torch.bfloat16, seed=6)
    x.copy_(x2)
    r.copy_(r2)
    graph.replay()
    want = rms_norm(x2, w, EPS, r2, quantize=True, impl="triton")
    assert torch.equal(captured.out, want.out) and torch.equal(captured.residual, want.residual)
    assert _fp8_bitwise(captured.out_fp8.data, want.out_fp8.data)
    assert not torch.equal(captured.out, eager.out)
