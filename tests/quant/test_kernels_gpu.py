"""The CUDA FP8 backend on the GPU against the PyTorch reference on the same GPU.

Quantization: FP8 bytes and scales identical (zero blocks, saturation, partial blocks, odd shapes,
power-of-two scales). GEMMs (cuBLAS and Triton paths): to output rounding. FP8Linear forward and
backward: the "cuda" backend equals the "reference" backend on the same inputs.
"""

from __future__ import annotations

import pytest
import torch

from jetrl.quant import ACT, TOKEN, WEIGHT, FP8Linear, Fp8Tensor, use_backend
from jetrl.quant import reference as R
from jetrl.quant.kernels import tuning
from linear_check import step_matches_reference

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1), (7, 5), (130, 300), (256, 256), (3, 129), (129, 4096), (1000, 1000), (4096, 512)]
DTYPES = [torch.bfloat16, torch.float32, torch.float16]


@pytest.fixture(scope="module")
def cuda_backend():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the FP8 kernels need a Hopper (sm_90+) GPU")
    from jetrl.quant.kernels.cuda_backend import CudaBackend

    return CudaBackend()


def _input(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    # mixed magnitudes along K so blocks differ; then an all-zero row, a huge and a tiny value
    x = torch.randn(m, k, generator=g, device="cuda") * torch.logspace(-5, 5, k, device="cuda")
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype)
    if m > 2 and k > 3:
        x[1] = 0
        x[2, 3] = 6e4 if dtype == torch.float16 else 1e30
        x[2, 0] = 0 if dtype == torch.float16 else -1e-30
    return x


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return a.shape == b.shape and bool(torch.equal(a, b))


def _same(t: Fp8Tensor, ref: Fp8Tensor) -> None:
    assert t.block == ref.block
    assert not torch.isnan(t.data.float()).any()
    assert _bitwise(t.data, ref.data), "FP8 bytes differ from the reference"
    assert _bitwise(t.scale, ref.scale), "scales differ from the reference"


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [ACT, TOKEN, WEIGHT])
def test_quantize_bitwise(cuda_backend, block, shape, dtype, pow2):
    x = _input(*shape, dtype, seed=hash((block, shape)) % 1000)
    _same(cuda_backend.quantize(x, block, pow2), R.quantize_tensor(x, block, pow2))


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_act_and_token_and_requant_and_weight_pair(cuda_backend, shape, pow2):
    x = _input(*shape, torch.bfloat16, seed=11)
    for gluon in (True, False):  # the Gluon one-pass kernel, or the Triton fallback (two kernels)
        with tuning.override(gluon=gluon):
            q_act, q_tok = cuda_backend.quantize_act_and_token(x, pow2)
        _same(q_act, R.quantize_tensor(x, ACT, pow2))
        _same(q_tok, R.quantize_tensor(x, TOKEN, pow2))
    ref_act = R.quantize_tensor(x, ACT, pow2)
    _same(cuda_backend.requantize(ref_act, TOKEN, pow2), R.requantize(ref_act, TOKEN, pow2))
    qw, qw_t = cuda_backend.quantize_weight_pair(x, pow2)
    ref_w = R.quantize_tensor(x, WEIGHT, pow2)
    _same(qw, ref_w)
    assert qw_t.data.is_contiguous()
    _same(qw_t, ref_w.t())
    again = cuda_backend.transpose_weight(qw)  # W^T from W's FP8 tiles (DGrad without a cached W^T)
    assert again.data.is_contiguous()
    _same(again, ref_w.t())
    assert torch.equal(again.scale, qw_t.scale) and again.scale.stride() == qw_t.scale.stride()  # cuBLAS's layout


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(130, 300), (3, 129), (1000, 1000), (4096, 512)])
def test_quantize_kernels_bitwise_at_tuned_tiles(cuda_backend, shape, dtype, pow2):
    """Every Triton quantization kernel at the default tiles and warps and at the others the benchmark sweeps
    (passed to the launchers), on inputs with partial blocks, a zero row, saturation and signed zeros: the
    reference's bytes."""
    from jetrl.quant.kernels import quantize_triton as tk

    x = _input(*shape, dtype, seed=5)
    x[0, : min(5, shape[1])] = -0.0
    ra, rt, rw = (R.quantize_tensor(x, b, pow2) for b in (ACT, TOKEN, WEIGHT))
    qa = R.quantize_tensor(x, ACT, pow2)
    rq = R.requantize(qa, TOKEN, pow2)
    # (1x128 kernel, 128x128 kernel, 128x1 kernel, requantizer) launches: the defaults, then others
    for act, weight, token, requant in (
            ({}, {}, {}, {}),
            (dict(block_m=64, num_warps=8), dict(num_warps=8), dict(num_warps=2), dict(num_warps=2)),
            ({}, {}, dict(block_k=64, num_warps=4), dict(block_k=64, num_warps=4))):
        d, s = tk.quantize_act_1x128(x, pow2, **act)
        _same(Fp8Tensor(d, s, ACT), ra)
        d, s, dt = tk.quantize_weight_128x128(x, pow2, emit_t=True, **weight)
        _same(Fp8Tensor(d, s, WEIGHT), rw)
        assert _bitwise(dt, rw.data.t())
        td, ts = tk.quantize_token_128x1(x, pow2, **token)
        _same(Fp8Tensor(td, ts, TOKEN), rt)
        td, ts = tk.requantize_act_to_token(qa.data, qa.scale, pow2, **requant)
        _same(Fp8Tensor(td, ts, TOKEN), rq)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(130, 300), (3, 129), (1000, 1000), (4096, 512), (256, 4096)])
def test_gluon_requant_bitwise(cuda_backend, shape, pow2):
    """The Gluon requant kernel (the tile staged in shared memory, one whole column per thread) on partial
    blocks, a zero row, saturation and signed zeros: the reference's bytes."""
    from jetrl.quant.kernels import quantize_gluon as rg

    x = _input(*shape, torch.bfloat16, seed=17)
    x[0, : min(5, shape[1])] = -0.0
    x[-1, :] = 0.0
    qa = R.quantize_tensor(x, ACT, pow2)
    td, ts = rg.requantize_act_to_token(qa.data, qa.scale, pow2)
    _same(Fp8Tensor(td, ts, TOKEN), R.requantize(qa, TOKEN, pow2))


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(130, 300), (3, 129), (1000, 1000), (4096, 512)])
def test_gluon_token_and_one_pass_bitwise(cuda_backend, shape, dtype, pow2):
    """The Gluon 128x1 kernel and the one-pass 1x128 + 128x1 kernel on a float input: the reference's bytes."""
    from jetrl.quant.kernels import quantize_gluon as tg

    x = _input(*shape, dtype, seed=23)
    x[0, : min(5, shape[1])] = -0.0
    ra, rt = R.quantize_tensor(x, ACT, pow2), R.quantize_tensor(x, TOKEN, pow2)
    td, ts = tg.quantize_token_128x1(x, pow2)
    _same(Fp8Tensor(td, ts, TOKEN), rt)
    d, s, td, ts = tg.quantize_act_and_token(x, pow2)
    _same(Fp8Tensor(d, s, ACT), ra)
    _same(Fp8Tensor(td, ts, TOKEN), rt)


def test_gluon_kernels_reject_strided_rows(cuda_backend):
    from jetrl.quant.kernels import quantize_gluon as tg

    x = _input(256, 256, torch.bfloat16, seed=3).t()
    with pytest.raises(ValueError, match="unit stride"):
        tg.quantize_token_128x1(x)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        tg.quantize_token_128x1(x.contiguous().to(torch.int32))


@pytest.mark.parametrize("gluon", [False, True])
def test_both_128x1_kernel_families_through_the_backend(cuda_backend, gluon):
    """Either family of 128x1 kernels behind the backend (Gluon is the default; ``tuning.gluon=False`` the
    Triton fallback), grad_out's two blockings, and a strided input (which the Gluon kernels leave to Triton):
    the reference's bytes."""
    x = _input(512, 384, torch.bfloat16, seed=19)
    qa = R.quantize_tensor(x, ACT)
    xt = _input(384, 512, torch.bfloat16, seed=20).t()
    with tuning.override(gluon=gluon):
        _same(cuda_backend.requantize(qa, TOKEN), R.requantize(qa, TOKEN))
        _same(cuda_backend.quantize(x, TOKEN), R.quantize_tensor(x, TOKEN))
        _same(cuda_backend.quantize(xt, TOKEN), R.quantize_tensor(xt, TOKEN))
        for inp in (x, xt):  # strided rows: the Gluon one-pass kernel leaves them to the two Triton kernels
            act, tok = cuda_backend.quantize_act_and_token(inp)
            _same(act, R.quantize_tensor(inp, ACT))
            _same(tok, R.quantize_tensor(inp, TOKEN))


@pytest.mark.parametrize("pow2", [False, True])
def test_inf_blocks_like_the_reference(cuda_backend, pow2):
    """A block holding an inf has scale inf: x / inf is +-0 and inf / inf NaN, as the reference divides."""
    from jetrl.quant.kernels import quantize_triton as tk

    x = torch.randn(260, 300, device="cuda")
    x[5, 7], x[9, 200], x[5, 8] = float("inf"), -float("inf"), -0.0
    for block, got in ((ACT, tk.quantize_act_1x128(x, pow2)), (TOKEN, tk.quantize_token_128x1(x, pow2)),
                       (WEIGHT, tk.quantize_weight_128x128(x, pow2, emit_t=True)[:2])):
        ref = R.quantize_tensor(x, block, pow2)
        assert _bitwise(got[0], ref.data) and _bitwise(got[1], ref.scale)


def test_quantize_noncontiguous_and_float64(cuda_backend):
    x = torch.randn(300, 260, device="cuda").t()  # (260, 300) with strides (1, 260)
    _same(cuda_backend.quantize(x, ACT), R.quantize_tensor(x, ACT))
    x = torch.randn(200, 300, device="cuda", dtype=torch.float64)
    _same(cuda_backend.quantize(x, TOKEN), R.quantize_tensor(x, TOKEN))


def _gemm_tolerance(a: Fp8Tensor, b: Fp8Tensor, ref: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Half an output ulp of the result plus accumulation error. Hopper FP8 MMAs keep about 14 bits
    while they accumulate inside a 128-wide K block (measured here: ~2^-14 of sum |a||b| for cuBLAS at
    K=512); 2^-11 of sum |a||b| bounds that with margin, while a wrong scale or block misses by orders
    of magnitude (|a @ b| is ~sqrt(K) times smaller than sum |a||b| only, not 2^11)."""
    ulp = 2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -23
    absprod = a.dequantize().double().abs() @ b.dequantize().double().abs().t()
    return ref.abs() * ulp + absprod * 2.0 ** -11


@pytest.mark.parametrize("path", ["cublas", "triton", "decode"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mnk", [(1, 256, 384), (64, 4096, 4096), (130, 256, 512), (512, 384, 1024),
                                 (30, 200, 300), (1000, 272, 640)])
@pytest.mark.parametrize("b_block", [WEIGHT, ACT])
def test_gemm_to_output_rounding(cuda_backend, b_block, mnk, out_dtype, path):
    from jetrl.quant.kernels import cuda_backend as cuda_mod

    m, n, k = mnk
    with tuning.override(gemm=path):
        g = torch.Generator(device="cuda").manual_seed(m + n + k)
        a = R.quantize_tensor(torch.randn(m, k, generator=g, device="cuda"), ACT)
        b = R.quantize_tensor(torch.randn(n, k, generator=g, device="cuda"), b_block)
        out = cuda_backend.gemm(a, b, out_dtype)
        assert out.dtype == out_dtype and out.shape == (m, n)
        ref = a.dequantize().double() @ b.dequantize().double().t()
        err = (out.double() - ref).abs()
        tol = _gemm_tolerance(a, b, ref, out_dtype)
        assert torch.isfinite(out).all()
        assert bool((err <= tol).all()), f"{cuda_mod.gemm_path(a, b)} GEMM: max excess {(err - tol).max().item()}"


@pytest.mark.parametrize("mnk", [(1, 6144, 4096), (16, 4096, 4096), (64, 28672, 4096), (64, 4096, 14336),
                                 (37, 1000, 1100)])
@tuning.override(deepgemm_decode_max_m=0)  # the backend's GEMM on the decode kernel where DeepGEMM loads too
def test_decode_gemm_deterministic_split_k(cuda_backend, mnk):
    """The split-K decode GEMM: within output rounding of the exact product, bitwise equal across calls,
    across split counts' own repeated runs, and inside a CUDA graph (the counters reset themselves)."""
    from jetrl.quant.kernels import gemm_decode_triton as dk

    m, n, k = mnk
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    a = R.quantize_tensor(torch.randn(m, k, generator=g, device="cuda"), ACT)
    b = R.quantize_tensor(torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16), WEIGHT)
    ref = a.dequantize().double() @ b.dequantize().double().t()
    tol = _gemm_tolerance(a, b, ref, torch.bfloat16)
    for split in (1, 3, 8):
        cfg = dk.DecodeGemmConfig(block_n=64, split_k=split)
        first = dk.fp8_decode_gemm(a.data, a.scale, b.data, b.scale, 128, torch.bfloat16, cfg)
        assert bool(((first.double() - ref).abs() <= tol).all()), f"split {split}"
        for _ in range(3):
            assert torch.equal(dk.fp8_decode_gemm(a.data, a.scale, b.data, b.scale, 128, torch.bfloat16, cfg), first)
    out = cuda_backend.gemm(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cuda_backend.gemm(a, b)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, out)


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("bias", [False, True])
@tuning.override(deepgemm_decode_max_m=0)  # the grouped decode launch, where DeepGEMM loads too
def test_grouped_decode_gemm_equals_one_by_one(cuda_backend, m, bias):
    """q/k/v-like weights sharing an input: one launch, each slice bitwise the single GEMM (+ bias) run with
    the grouped launch's split (the default split depends on the total width, so it can differ from a lone
    call's: then the two sum K in different orders)."""
    from jetrl.quant.kernels import gemm_decode_triton as dk

    g = torch.Generator(device="cuda").manual_seed(m + 11 * bias)
    a = cuda_backend.quantize(torch.randn(m, 4096, generator=g, device="cuda", dtype=torch.bfloat16), ACT)
    ws = [cuda_backend.quantize(torch.randn(n, 4096, generator=g, device="cuda", dtype=torch.bfloat16), WEIGHT)
          for n in (4096, 1024, 1024)]
    bs = [torch.randn(w.shape[0], generator=g, device="cuda", dtype=torch.bfloat16) if bias else None for w in ws]
    out = cuda_backend.grouped_gemm(a, ws, bs)
    assert out is not None and out.shape == (m, 6144)
    cfg = dk.default_decode_config(m, 6144, 4096, a.data.device, grouped=True)
    one = [dk.fp8_decode_gemm(a.data, a.scale, w.data, w.scale, 128, torch.bfloat16, cfg) for w in ws]
    one = torch.cat([y + b if b is not None else y for y, b in zip(one, bs)], dim=1)
    assert torch.isfinite(out.float()).all() and torch.equal(out, one)


def _skip_if_too_big(fn):
    """Run ``fn``; a variant whose tiles do not fit in shared memory at this M is skipped, not failed (the
    sweep reports it the same way and never picks it)."""
    try:
        return fn()
    except Exception as exc:
        if type(exc).__name__ == "OutOfResources":
            pytest.skip(f"variant does not fit in shared memory here: {exc}")
        raise


# the tuning variants the benchmark sweeps: K blocks per iteration, TMA loads, row tiles, wide column tiles
DECODE_VARIANTS = [dict(k_unroll=2), dict(tma=True), dict(tma=True, k_unroll=2, num_stages=4),
                   dict(block_n=128, num_warps=8, tma=True), dict(block_n=256, num_warps=8),
                   dict(block_m=64, num_warps=8, tma=True), dict(block_n=32, k_unroll=4)]


@pytest.mark.parametrize("variant", range(len(DECODE_VARIANTS)))
@pytest.mark.parametrize("mnk", [(16, 4096, 4096), (64, 1000, 1104), (256, 4096, 14336), (37, 300, 1100)])
def test_decode_gemm_variants(cuda_backend, mnk, variant):
    """Every tuning variant of the decode GEMM (1 and 3 K splits): within output rounding of the exact
    product, bitwise equal across calls and inside a CUDA graph; K = 1104 (a partial K block) and 1100 (no
    TMA: K % 16 != 0, pointer loads instead) cover the edges."""
    from jetrl.quant.kernels import gemm_decode_triton as dk

    m, n, k = mnk
    g = torch.Generator(device="cuda").manual_seed(m * 5 + n + variant)
    a = cuda_backend.quantize(torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16), ACT)
    b = cuda_backend.quantize(torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16), WEIGHT)
    ref = a.dequantize().double() @ b.dequantize().double().t()
    tol = _gemm_tolerance(a, b, ref, torch.bfloat16)
    for split in (1, 3):
        cfg = dk.DecodeGemmConfig(**{"split_k": split, **DECODE_VARIANTS[variant]})
        first = _skip_if_too_big(lambda: dk.fp8_decode_gemm(a.data, a.scale, b.data, b.scale, 128, torch.bfloat16, cfg))
        assert bool(((first.double() - ref).abs() <= tol).all()), f"{cfg.name}"
        assert torch.equal(dk.fp8_decode_gemm(a.data, a.scale, b.data, b.scale, 128, torch.bfloat16, cfg), first)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = dk.fp8_decode_gemm(a.data, a.scale, b.data, b.scale, 128, torch.bfloat16, cfg)
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, first), f"{cfg.name} in a CUDA graph"
    assert int(dk._locks(a.data.device).abs().sum()) == 0


def _shape_config_cases():
    lower = {32: 1, 64: 33, 128: 65, 256: 129}
    return [(key, m) for key in tuning.current().decode_shape_configs for m in (lower[key[0]], key[0])]


# how the grouped entries' total widths split into weights (q/k/v or gate/up of the measured models)
GROUPED_SPLITS = {6144: (4096, 1024, 1024), 2048: (1536, 256, 256), 17920: (8960, 8960), 28672: (14336, 14336),
                  1152: (896, 128, 128), 9728: (4864, 4864)}


@pytest.mark.parametrize("key,m", _shape_config_cases(), ids=lambda v: str(v))
def test_measured_shape_configs_compute_their_shapes(cuda_backend, key, m):
    """Every per-shape decode config, at both ends of its row bucket, on the shape it was measured for: within
    output rounding of the exact product; grouped entries bitwise equal to their one-by-one calls."""
    from jetrl.quant.kernels import gemm_decode_triton as dk

    _, n, k, grouped = key
    cfg = tuning.current().decode_shape_configs[key]
    assert dk.default_decode_config(m, n, k, torch.device("cuda"), grouped=grouped) == cfg
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = cuda_backend.quantize(torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16), ACT)
    ns = GROUPED_SPLITS[n] if grouped else (n,)
    ws = [cuda_backend.quantize(torch.randn(w, k, generator=g, device="cuda", dtype=torch.bfloat16), WEIGHT)
          for w in ns]
    one = [dk.fp8_decode_gemm(a.data, a.scale, w.data, w.scale, 128, torch.bfloat16, cfg) for w in ws]
    for w, out in zip(ws, one):
        ref = a.dequantize().double() @ w.dequantize().double().t()
        assert bool(((out.double() - ref).abs() <= _gemm_tolerance(a, w, ref, torch.bfloat16)).all()), cfg.name
    if grouped:
        out = dk.fp8_decode_gemm_grouped(a.data, a.scale, [(w.data, w.scale, None) for w in ws], torch.bfloat16, cfg)
        assert torch.equal(out, torch.cat(one, dim=1)), cfg.name


@pytest.mark.parametrize("m", [32, 128, 256])
@pytest.mark.parametrize("variant", [0, 1, 3, 5])
def test_grouped_decode_gemm_variants_equal_one_by_one(cuda_backend, m, variant):
    """Grouped q/k/v (with biases) through each variant, TMA descriptors per weight included: bitwise the
    one-by-one calls with the same config."""
    from jetrl.quant.kernels import gemm_decode_triton as dk

    g = torch.Generator(device="cuda").manual_seed(m + variant)
    a = cuda_backend.quantize(torch.randn(m, 4096, generator=g, device="cuda", dtype=torch.bfloat16), ACT)
    ws = [cuda_backend.quantize(torch.randn(n, 4096, generator=g, device="cuda", dtype=torch.bfloat16), WEIGHT)
          for n in (4096, 1024, 1024)]
    bs = [torch.randn(w.shape[0], generator=g, device="cuda", dtype=torch.bfloat16) for w in ws]
    cfg = dk.DecodeGemmConfig(**{"split_k": 2, **DECODE_VARIANTS[variant]})
    out = _skip_if_too_big(lambda: dk.fp8_decode_gemm_grouped(a.data, a.scale, [(w.data, w.scale, b) for w, b in
                                                                 zip(ws, bs)], torch.bfloat16, cfg))
    one = [dk.fp8_decode_gemm(a.data, a.scale, w.data, w.scale, 128, torch.bfloat16, cfg) + b for w, b in zip(ws, bs)]
    assert torch.isfinite(out.float()).all() and torch.equal(out, torch.cat(one, dim=1))


@tuning.override(gemm="auto", deepgemm_decode_max_m=0, decode_max_m=64, grouped_decode_max_m=256,
                 decode_max_m_by_shape={(1024, 4096): 128, ("grouped", 6144, 4096): 128})
def test_decode_routing_bounds(cuda_backend):
    """Without DeepGEMM's rule, single GEMMs up to decode_max_m, grouped launches up to grouped_decode_max_m and
    per-shape entries go to the decode kernel; M > 256 never does; a grouped launch past its bound returns None."""
    from jetrl.quant.kernels import cuda_backend as cuda_mod

    g = torch.Generator(device="cuda").manual_seed(9)
    ws = [cuda_backend.quantize(torch.randn(n, 4096, generator=g, device="cuda", dtype=torch.bfloat16), WEIGHT)
          for n in (4096, 1024, 1024)]
    for m, single, kv, qkv, gate_up in [(64, "decode", "decode", "decode", "decode"),
                                         (128, "cublas", "decode", "decode", "decode"),
                                         (256, "cublas", "cublas", "cublas", "decode"),
                                         (512, "cublas", "cublas", "cublas", "cublas")]:
        a = cuda_backend.quantize(torch.randn(m, 4096, generator=g, device="cuda", dtype=torch.bfloat16), ACT)
        assert cuda_mod.gemm_path(a, ws[0]) == single and cuda_mod.gemm_path(a, ws[1]) == kv
        assert cuda_mod.gemm_path(a, ws[0], grouped_n=6144) == qkv
        assert cuda_mod.gemm_path(a, ws[0], grouped_n=2 * 14336) == gate_up
        out = cuda_backend.grouped_gemm(a, ws, [None] * 3)
        assert (out is not None) == (qkv == "decode")
        if out is not None:
            assert out.shape == (m, 6144) and torch.isfinite(out.float()).all()


def test_dgrad_operand_row_major_transposed_weight(cuda_backend):
    """DGrad: dy (1x128) @ W through the cached row-major W^T equals the transposed-view operand."""
    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(384, 512, generator=g, device="cuda", dtype=torch.bfloat16)
    dy = R.quantize_tensor(torch.randn(256, 384, generator=g, device="cuda"), ACT)
    qw, qw_t = cuda_backend.quantize_weight_pair(w)
    out = cuda_backend.gemm(dy, qw_t, torch.float32)
    ref = R.gemm(dy, R.quantize_tensor(w, WEIGHT).t(), torch.float32).double()
    assert bool(((out.double() - ref).abs() <= _gemm_tolerance(dy, qw.t(), ref, torch.float32)).all())


@pytest.mark.parametrize("shape", [(256, 384, 512), (77, 200, 300), (4, 2048, 1024)])
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_cuda_equals_reference_backend(cuda_backend, shape, bias):
    m, n, k = shape
    torch.manual_seed(m + n)
    layer = FP8Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, m, k, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(2, m, n, device="cuda", dtype=torch.bfloat16)
    results = {}
    for name in ("reference", "cuda"):
        with use_backend(name):
            layer.invalidate_weight_cache()
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.backward(gy)
            results[name] = (y.detach().float(), xi.grad.float(), layer.weight.grad.float().clone())
            layer.weight.grad = None
            if bias:
                layer.bias.grad = None
    for ref, out, what in zip(results["reference"], results["cuda"], ("output", "grad_input", "grad_weight")):
        assert torch.isfinite(out).all(), what
        # same quantized operands, GEMMs equal to BF16 output rounding: a few 2^-8 relative per element
        # plus accumulation-order noise; the relative norm error of a correct kernel is ~1e-3
        rel = float((out - ref).norm() / ref.norm())
        assert rel < 4e-3, f"{what}: relative error {rel:.2e} between backends"


def test_cuda_backend_rejects_cpu_tensors(cuda_backend):
    with pytest.raises(ValueError, match="CUDA tensors"):
        cuda_backend.quantize(torch.randn(4, 128), ACT)


UNALIGNED_TOKENS = (1, 3, 127, 129, 1001, 15288)


@pytest.mark.parametrize("gluon", [True, False])
@pytest.mark.parametrize("m", UNALIGNED_TOKENS)
def test_whole_block_token_operands_bitwise(cuda_backend, m, gluon):
    """WGrad's 128x1 operands at any token count: the reference of the zero-padded input (x's own bytes and scales,
    zeros past them), by both kernel families, and grad_out's 1x128 blocking unchanged beside them."""
    x = _input(m, 384, torch.bfloat16, seed=m)
    ref_tok = R.quantize_tensor(x, TOKEN, whole_blocks=True)
    qa = R.quantize_tensor(x, ACT)
    with tuning.override(gluon=gluon):
        _same(cuda_backend.quantize(x, TOKEN, whole_blocks=True), ref_tok)
        _same(cuda_backend.requantize(qa, TOKEN, whole_blocks=True), R.requantize(qa, TOKEN, whole_blocks=True))
        act, tok = cuda_backend.quantize_act_and_token(x, whole_blocks=True)
    _same(act, qa)
    _same(tok, ref_tok)
    assert tok.shape[0] % 128 == 0


@pytest.mark.parametrize("m", UNALIGNED_TOKENS)
def test_fp8_linear_takes_cublas_for_every_gemm_at_any_token_count(cuda_backend, m, monkeypatch):
    """Fprop, DGrad and WGrad of a training step at an unaligned token count run the fast routes on the producers'
    buffers: WGrad on cuBLAS's blockwise GEMM (its contraction is over tokens), Fprop and DGrad on cuBLAS or, at a
    decode-sized M, the decode GEMM; no Triton fallback GEMM, no padded copy of an operand. The result is the
    reference backend's to output rounding."""
    from jetrl.quant.kernels import gemm_decode_triton, gemm_scaled_mm, gemm_triton

    calls = {"cublas": [], "decode": 0}
    real_mm, real_decode = gemm_scaled_mm.blockwise_scaled_mm, gemm_decode_triton.fp8_decode_gemm

    def cublas(a, b, *args, **kw):
        calls["cublas"].append(b.block)
        return real_mm(a, b, *args, **kw)

    def decode(*args, **kw):
        calls["decode"] += 1
        return real_decode(*args, **kw)

    monkeypatch.setattr(gemm_triton, "blockwise_fp8_gemm", lambda *a, **k: pytest.fail("Triton fallback GEMM"))
    monkeypatch.setattr(gemm_scaled_mm, "_pad_rows", lambda *a, **k: pytest.fail("padded copy of an operand"))
    monkeypatch.setattr(gemm_scaled_mm, "blockwise_scaled_mm", cublas)
    monkeypatch.setattr(gemm_decode_triton, "fp8_decode_gemm", decode)

    def step(layer, x, gy):
        layer(x).backward(gy)
        assert calls["cublas"].count(ACT) == 1  # WGrad
        assert len(calls["cublas"]) + calls["decode"] == 3

    step_matches_reference(m, monkeypatch, step)


@pytest.mark.parametrize("m", [1, 77, 1001])
def test_fp8_linear_without_a_cached_transpose_is_bitwise_the_cached_one(cuda_backend, m):
    """``cache_weight_t`` off: DGrad's W^T is transposed from W's FP8 tiles in each backward; every gradient has the
    bits of the run that caches W^T, and the layer keeps no W^T."""
    runs = {}
    for cache in (True, False):
        torch.manual_seed(m)
        layer = FP8Linear(1536, 896, bias=True, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, 1536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(m, 896, device="cuda", dtype=torch.bfloat16)
        with tuning.override(cache_weight_t=cache):
            layer(x).backward(gy)
        assert (layer._qweight_t is not None) == cache
        runs[cache] = (x.grad, layer.weight.grad, layer.bias.grad)
    for a, b in zip(runs[True], runs[False]):
        assert torch.isfinite(a.float()).all() and torch.equal(a, b)


@pytest.mark.parametrize("m", [1, 77, 13_441])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_bias_bitwise_the_broadcast_add(cuda_backend, m, dtype):
    """A biased linear's output (Qwen's q/k/v, 2,048 wide at 1.5B) gets its bias from the kernel, bitwise ATen's
    ``y + bias``, at unaligned token counts; an operand the kernel does not take (column-strided) adds as ATen."""
    g = torch.Generator(device="cuda").manual_seed(m)
    y = (torch.randn(m, 2048, generator=g, device="cuda") * 30).to(dtype)
    bias = torch.randn(2048, generator=g, device="cuda").to(dtype)
    ref = y + bias
    got = cuda_backend.add_bias(y.clone(), bias)
    assert torch.equal(got, ref)
    strided = y.t().contiguous().t()  # (m, 2048) with column stride m
    assert torch.equal(cuda_backend.add_bias(strided, bias), ref)


def test_fp8_linear_adds_its_bias_with_the_kernel(cuda_backend, monkeypatch):
    """The FP8 linear's forward (training and no-grad) adds its bias through the backend's kernel, and its output
    is bitwise the GEMM's plus ATen's broadcast add."""
    from jetrl.quant.kernels import bias_triton

    calls = []
    real = bias_triton.add_bias_
    monkeypatch.setattr(bias_triton, "add_bias_", lambda y, b: calls.append(y.shape) or real(y, b))
    torch.manual_seed(5)
    layer = FP8Linear(1536, 2048, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1001, 1536, device="cuda", dtype=torch.bfloat16)
    y = layer(x.clone().requires_grad_())
    with torch.no_grad():
        y_nograd = layer(x)
        qx = cuda_backend.quantize(x, ACT)
        expect = cuda_backend.gemm(qx, layer._cached_weights(with_transpose=False)[0], torch.bfloat16) + layer.bias
    assert calls == [(1001, 2048), (1001, 2048)]
    assert torch.equal(y.detach(), expect) and torch.equal(y_nograd, expect)
