"""DeepGEMM's route for the FP8 GEMMs (:mod:`jetrl.quant.kernels.gemm_deepgemm`) on the GPU, where it is installed.

Its GEMMs against the reference's to output rounding (128x128 weights, at unaligned row counts and the rollout's
decode row counts); the rule's routing of the rollout's decode rows (``gemm="deepgemm"`` and the default ``"auto"``
where DeepGEMM loads); a rollout whose decode
graphs compile DeepGEMM's kernels ahead (:func:`~jetrl.quant.backend.prepare_gemms`); and ahead-of-time compilation
filling the disk cache from worker processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jetrl.quant import ACT, WEIGHT
from jetrl.quant.kernels import tuning

pytestmark = pytest.mark.gpu
# each engine's KV pool, in bytes: the GPU tests run in several processes on one GPU, and a pool of most of the free
# memory (the default) would leave another process's graph capture without any (a capture fails, decoding runs eagerly)
POOL_BYTES = 1 << 30


@pytest.fixture(scope="module")
def dg():
    from jetrl.quant.kernels import gemm_deepgemm

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("DeepGEMM's fp32-scale kernels need an sm_90 GPU")
    if not gemm_deepgemm.installed():
        pytest.skip("DeepGEMM is not installed (github.com/deepseek-ai/DeepGEMM)")
    return gemm_deepgemm


def _tolerance(a, b, ref: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Half an output ulp plus accumulation error, as for cuBLAS (tests/quant/test_kernels_gpu.py: 2^-11 of
    sum |a||b| bounds the FP8 MMAs' accumulation with margin; a wrong scale or block misses by far more)."""
    ulp = 2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -23
    absprod = a.dequantize().double().abs() @ b.dequantize().double().abs().t()
    return ref.abs() * ulp + absprod * 2.0 ** -11


@pytest.mark.parametrize("m,n,k", [(130, 2048, 1536), (1001, 1536, 8960), (4099, 896, 4864), (2048, 1152, 896)])
def test_fprop_and_dgrad_to_output_rounding(dg, m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    from jetrl.quant.kernels.cuda_backend import CudaBackend

    be = CudaBackend()
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    qa = be.quantize(x, ACT)  # the producers' buffers (M rounded up to 4 rows)
    qw, qw_t = be.quantize_weight_pair(torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16))
    dy = be.quantize(torch.randn(m, n, generator=g, device="cuda", dtype=torch.bfloat16), ACT)
    for a, b in ((qa, qw), (dy, qw_t)):
        out = dg.gemm(a, b)
        assert out.dtype == torch.bfloat16 and out.shape == (m, b.shape[0])
        ref = a.dequantize().double() @ b.dequantize().double().t()
        assert torch.isfinite(out).all()
        excess = (out.double() - ref).abs() - _tolerance(a, b, ref, torch.bfloat16)
        assert float(excess.max()) <= 0, f"max excess {float(excess.max()):.3g}"


@pytest.mark.parametrize("m", [1, 3, 16, 100, 256])
@pytest.mark.parametrize("n,k", [(2048, 1536), (1536, 8960), (1152, 896)])
def test_decode_rows_to_output_rounding(dg, m, n, k):
    """Fprop at the rollout's decode row counts (its CUDA graphs' sizes and the rows between them), from the
    1x128 producer's buffers (M rounded up to 4 rows)."""
    from jetrl.quant.kernels.cuda_backend import CudaBackend

    be = CudaBackend()
    g = torch.Generator(device="cuda").manual_seed(7 * m + n + k)
    a = be.quantize(torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16), ACT)
    b = be.quantize(torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16), WEIGHT)
    out = dg.gemm(a, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = a.dequantize().double() @ b.dequantize().double().t()
    assert torch.isfinite(out).all()
    excess = (out.double() - ref).abs() - _tolerance(a, b, ref, torch.bfloat16)
    assert float(excess.max()) <= 0, f"max excess {float(excess.max()):.3g}"


def test_decode_rows_route_by_the_rule(dg):
    """Under ``gemm="deepgemm"`` the rollout's decode-sized rows go to DeepGEMM, except a long-K weight up to the
    split-K bound (on the decode kernel, past that kernel's own per-shape bound) and a grouped launch with biases
    up to the grouped decode kernel's bound (it adds them in its epilogue); a GEMM of the same shape on the training
    side takes the same path, past the rule's rows the default route's."""
    from jetrl.quant import precision_side
    from jetrl.quant.kernels.cuda_backend import CudaBackend, gemm_path

    be = CudaBackend()
    w = {(n, k): be.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), WEIGHT)
         for n, k in ((2048, 1536), (1536, 8960), (256, 1536), (3584, 18944), (512, 3584))}
    with tuning.override(gemm="deepgemm"), precision_side("rollout"):
        for m in (1, 16, 96, 128, 256):
            a = be.quantize(torch.randn(m, 1536, device="cuda", dtype=torch.bfloat16), ACT)
            assert gemm_path(a, w[2048, 1536]) == "deepgemm"
            assert gemm_path(a, w[256, 1536], grouped_n=2048) == "deepgemm"  # the stacked GEMM runs there
            for n, k in ((1536, 8960), (3584, 18944)):  # down projections (7B: no per-shape decode bound)
                a_down = be.quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), ACT)
                assert gemm_path(a_down, w[n, k]) == ("deepgemm" if m > 128 else "decode")
            a7 = be.quantize(torch.randn(m, 3584, device="cuda", dtype=torch.bfloat16), ACT)
            bound = tuning.current().decode_rows(4608, 3584, grouped=True)  # 7B q/k/v: the general grouped bound
            assert bound < 128
            assert gemm_path(a7, w[512, 3584], grouped_n=4608, biased=True) == (
                "decode" if m <= bound else "deepgemm")
        with tuning.override(deepgemm_decode_max_m=0):
            assert gemm_path(a, w[2048, 1536]) != "deepgemm"
    for m in (16, 256, 1024):  # the training side: the rule reads the shape, never the side
        a = be.quantize(torch.randn(m, 1536, device="cuda", dtype=torch.bfloat16), ACT)
        with tuning.override(gemm="deepgemm"):
            got = gemm_path(a, w[2048, 1536])
            with precision_side("rollout"):
                assert gemm_path(a, w[2048, 1536]) == got
        with tuning.override(gemm="auto"):  # the default: the same path wherever DeepGEMM loads
            assert gemm_path(a, w[2048, 1536]) == got
        with tuning.override(gemm="auto", deepgemm_decode_max_m=0):  # the default route without DeepGEMM
            default = gemm_path(a, w[2048, 1536])
        # decode-sized rows (a tiny micro-batch too) DeepGEMM's, larger ones (prefill, micro-batches) the default's
        assert got == ("deepgemm" if m <= tuning.current().deepgemm_rule()["decode_max_m"] else default) != "decode"


@pytest.mark.parametrize("gemm", ["auto", "deepgemm"])
def test_rollout_decodes_through_deepgemm_in_graphs(dg, monkeypatch, gemm):
    """A qwen2-type model (q/k/v biases) generates under ``gemm="deepgemm"`` and under the default ``"auto"`` (where
    DeepGEMM loads) with its decode steps in CUDA graphs:
    the first capture compiles every graph size's kernels ahead, the captured steps run DeepGEMM, and the samples
    are those of eager decoding on the same kernels, to BF16 noise (a graph's attention may split the context
    differently: tests/rollout/test_rollout_gpu.py)."""
    from jetrl.models import DecoderConfig, build_model
    from jetrl.rollout import RolloutEngine, SamplingParams

    config = DecoderConfig(model_type="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           qkv_bias=True, max_position_embeddings=512, eos_token_id=0)
    model = build_model(config, dtype=torch.bfloat16, device="cuda", recipe="jet", seed=0)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(3 + 5 * i)] for i in range(16)]
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=24, ignore_eos=True)
    compiled, calls = [], []
    real_compile, real_gemm = dg.compile_kernels, dg.gemm

    def spy_compile(shapes, device, *args, **kw):
        compiled.extend(shapes)
        seconds = real_compile(shapes, device, *args, **kw)
        calls.clear()  # its launches of every planned shape; what follows are the decode steps'
        return seconds

    def spy_gemm(a, b, *args, **kw):
        calls.append((a.shape[0], b.shape[0], b.shape[1]))
        return real_gemm(a, b, *args, **kw)

    with tuning.override(gemm=gemm):
        eager = RolloutEngine(model, memory_budget=POOL_BYTES, cuda_graphs=False, max_num_seqs=32, progress=False,
                              max_model_len=128)
        a = eager.generate(prompts, params)
        monkeypatch.setattr(dg, "compile_kernels", spy_compile)
        monkeypatch.setattr(dg, "gemm", spy_gemm)
        graphs = RolloutEngine(model, memory_budget=POOL_BYTES, cuda_graphs=True, max_num_seqs=32,
                               graph_batch_sizes=[8, 32], progress=False,
                               max_model_len=128)
        b = graphs.generate(prompts, params)
    assert graphs.runner.graphs is not None and 32 in graphs.runner.graphs.graphs
    # o, gate/up stacked and down (K = 512 <= 2N) at both sizes, planned from the model's FP8 weights; the stacked
    # q/k/v with biases keeps the grouped decode kernel at these sizes: neither planned nor called
    for n, k in ((256, 256), (1024, 256), (256, 512)):
        assert {dg.GemmShape(8, n, k), dg.GemmShape(32, n, k)} <= set(compiled), (n, k, sorted(compiled))
        assert (32, n, k) in calls  # the warm-up and the capture of the 32-row step
    assert (32, 512, 256) not in calls and not any((s.n, s.k) == (512, 256) for s in compiled)
    same = 0
    for x, y in zip(a, b):
        assert x.token_ids[0] == y.token_ids[0]
        common = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), len(x.token_ids))
        assert max(abs(p - q) for p, q in zip(x.logprobs[:common], y.logprobs[:common])) < 5e-2
        same += x.token_ids == y.token_ids
    assert same >= len(a) * 3 // 4


def test_compile_kernels_fills_the_disk_cache_from_workers(dg, tmp_path, monkeypatch):
    """compile_kernels' worker processes compile a new shape's kernels into DeepGEMM's disk cache (here an empty
    one of their own: DG_JIT_CACHE_DIR, which this process read when DeepGEMM loaded) without a failure, and the
    GEMM then runs here."""
    import warnings

    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path))
    shapes = [dg.GemmShape(2048, 640, 384), dg.GemmShape(4096, 640, 384)]  # shapes no other test uses
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed worker is a warning
        seconds = dg.compile_kernels(shapes, torch.device("cuda"), processes=2)
    assert seconds > 0 and any(p.is_file() for p in Path(tmp_path).rglob("*"))
    a, b = dg._zeros_operands(shapes[0], torch.device("cuda"))
    assert float(dg.gemm(a, b).abs().max()) == 0.0
