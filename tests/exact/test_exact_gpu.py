"""Exact on-policy mode on an H200 (``gpu`` marker): every kernel on, CUDA graphs on.

* the batch-invariant kernels one by one at the 8B shapes: a row's bits for M = 1 .. 8192; the exact GEMMs'
  split-K: rows bitwise across M and both schedules, one split bitwise the kernel before split-K
  (``unsplit_exact_gemm.py``), every split within output rounding of the exact product; the wide schedule's
  tiles and other launches (``ExactTiles``) give the bits of the decode-sized ones;
* the row-wise fused kernels (RMSNorm + residual + FP8, SwiGLU + FP8, RoPE, the exact log-softmax);
* exact attention's swapped decode kernel: a decode row's bits are the packed training forward's;
* the engine's log-probabilities == the trainer's packed forward's, bitwise, on 2-block 8B-shaped models in
  ``bf16``, ``jet`` and ``jet`` with the FP8 KV cache (``kv_fp8``: the FP8 write and attention kernels, captured in
  the decode graphs, against the trainer's fake-quantized K/V), over batches of 1 to 256 sequences (prefix
  sharing, mixed prompt lengths, CUDA graphs, the trainer's micro-batching);
* a one-step RL run with ``mismatch/logp_abs_diff_max == 0.0``.
"""

import math

import pytest
import torch

from jetrl.models import DecoderConfig, build_model
from jetrl.quant import ACT, WEIGHT, quantize_tensor
from jetrl.quant.exact import exact_fp8_gemm, exact_linear
from jetrl.rollout import RolloutEngine, SamplingParams
from trainer_scoring import trainer_logprobs

pytestmark = pytest.mark.gpu

ROWS = (1, 3, 17, 64, 255, 1000, 8192)
# Llama-3.1-8B's block and head shapes (bench/common.py's LLAMA31_8B) with 2 of its 32 blocks
LLAMA8B_2_BLOCKS = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                        max_position_embeddings=1024, rope_theta=500000.0, tie_word_embeddings=False,
                        eos_token_id=128001)


def _rows_of(full: torch.Tensor, fn, x: torch.Tensor) -> None:
    """``fn`` on the first M rows of x gives the first M rows of ``fn(x)``, bitwise, for every M in ROWS."""
    for m in ROWS:
        if m <= x.shape[0]:
            assert torch.equal(fn(x[:m]), full[:m]), m


@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (28672, 4096), (4096, 14336)])
def test_exact_fp8_gemm_is_batch_invariant_at_8b_shapes(n, k):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = quantize_tensor(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16), WEIGHT)
    x = torch.randn(8192, k, device="cuda", generator=g, dtype=torch.bfloat16)
    full = exact_fp8_gemm(quantize_tensor(x, ACT), w)
    _rows_of(full, lambda xs: exact_fp8_gemm(quantize_tensor(xs, ACT), w), x)
    # to output rounding: half a BF16 ulp of the result plus the Hopper FP8 MMA's accumulation error (about 14
    # bits inside each 128-wide K block), bounded by 2^-11 of sum |a||b| as in tests/quant/test_kernels_gpu.py;
    # a wrong scale or block misses by orders of magnitude
    a, b = quantize_tensor(x[:256], ACT).dequantize().double(), w.dequantize().double()
    ref = a @ b.t()
    tol = ref.abs() * 2.0 ** -8 + (a.abs() @ b.abs().t()) * 2.0 ** -11
    out = full[:256].double()
    assert torch.isfinite(out).all() and bool(((out - ref).abs() <= tol).all()), float(((out - ref).abs() - tol).max())


@pytest.mark.parametrize("n,k,dtype", [(128256, 4096, torch.bfloat16), (4096, 4096, torch.bfloat16),
                                       (1024, 512, torch.float32)])
def test_exact_matmul_is_batch_invariant(n, k, dtype):
    g = torch.Generator(device="cuda").manual_seed(n)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=dtype) * 0.02
    x = torch.randn(8192 if n < 100000 else 2048, k, device="cuda", generator=g, dtype=dtype)
    full = exact_linear(x, w)
    _rows_of(full, lambda xs: exact_linear(xs, w), x)
    torch.testing.assert_close(full[:64].float(), x[:64].float() @ w.float().t(), rtol=2e-2, atol=2e-2)


# Exact mode's split-K at the 8B weight shapes: the default split per (N, K) (S = 1, 1, 4, 1, 1) and forced ones
SPLIT_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096), (4096, 1024)]
SPLIT_ROWS = (1, 2, 3, 17, 64, 100, 128, 129, 200, 256, 257, 511)  # both sides of exact_split_max_m (256)


def _split_operands(path: str, n: int, k: int):
    """(fn(m) -> the first m rows of the exact GEMM under the current tuning, unsplit(), reference (double),
    sum |a||b| (double) on the first 256 rows) for the FP8 path or the bf16 one at (N, K), 512 input rows."""
    from unsplit_exact_gemm import unsplit_gemm

    g = torch.Generator(device="cuda").manual_seed(n * 3 + k)
    x = torch.randn(512, k, device="cuda", generator=g, dtype=torch.bfloat16)
    if path == "fp8":
        w = quantize_tensor(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16), WEIGHT)
        qx = quantize_tensor(x, ACT)
        a, b = qx.dequantize()[:256].double(), w.dequantize().double()
        return (lambda m: exact_fp8_gemm(quantize_tensor(x[:m], ACT), w),
                lambda: unsplit_gemm(qx.data, w.data, qx.scale, w.scale, 128, torch.bfloat16), a @ b.t(),
                a.abs() @ b.abs().t())
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    a, b = x[:256].double(), w.double()
    return lambda m: exact_linear(x[:m], w), lambda: unsplit_gemm(x, w), a @ b.t(), a.abs() @ b.abs().t()


@pytest.mark.parametrize("path", ["fp8", "bf16"])
@pytest.mark.parametrize("n,k", SPLIT_SHAPES)
def test_exact_split_k_at_8b_shapes(path, n, k):
    """Per split count (the default of the shape, and forced S = 2 and 4): a row's bits for M = 1..511 equal the
    rows of M = 512, whichever schedule ran them (M <= exact_split_max_m: the splits as separate programs summed
    through the workspace; above: one program per tile walking its splits; M = 512 is also run the first way);
    S = 1 reproduces the kernel before split-K bit for bit; every split count stays within output rounding of the
    exact product (the bound of test_exact_fp8_gemm_is_batch_invariant_at_8b_shapes: half a BF16 ulp plus the
    FP8 MMA's accumulation error, 2^-11 of sum |a||b|; the bf16 MMA accumulates more precisely)."""
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.gemm_exact_triton import exact_config

    fn, unsplit, ref, mag = _split_operands(path, n, k)
    tol = ref.abs() * 2.0 ** -8 + mag * 2.0 ** -11
    with tuning.override(exact_split_k=1):
        assert exact_config(n, k).split_k == 1
        assert torch.equal(fn(512), unsplit())
    default = exact_config(n, k).split_k  # the heuristic's
    assert default == {(4096, 4096): 1, (14336, 4096): 1, (4096, 14336): 4, (1024, 4096): 1, (4096, 1024): 1}[(n, k)]
    for forced in (0, 2, 4):  # 0: the heuristic's split
        with tuning.override(exact_split_k=forced):
            full = fn(512)
            for m in SPLIT_ROWS:
                assert torch.equal(fn(m), full[:m]), (forced, m)
            with tuning.override(exact_split_max_m=512):
                assert torch.equal(fn(512), full), forced
        out = full[:256].double()
        assert torch.isfinite(out).all() and bool(((out - ref).abs() <= tol).all()), \
            (forced, float(((out - ref).abs() - tol).max()))


def _wide(bm: int, bn: int, warps: int, stages: int) -> dict:
    return dict(wide_block_m=bm, wide_block_n=bn, wide_mm_block_n=bn, wide_num_warps=warps, wide_num_stages=stages)


# Launches of the exact GEMM (ExactTiles' fields) that must not change a bit: the wide schedule's tiles
# (bench/kernels.py --sections exact-gemm times them; the 16-bit path's, as the FP8 path walks the decode-sized
# tiles through TMA there), the defaults' TMA walk (row scales), and other decode-sized tiles (both schedules)
SCHEDULES = [_wide(128, 128, 8, 3), _wide(128, 256, 8, 3), _wide(64, 256, 4, 3), _wide(256, 128, 8, 3),
             dict(), dict(num_stages=4), dict(block_m=128, num_warps=8)]


def _kernel_operands(path: str, n: int, k: int):
    """fn(m, tiles) -> the first m rows of exact mode's Triton GEMM launched with ``tiles`` (an ``ExactTiles``)
    under the current tuning, for the FP8 path or the bf16 one at (N, K), 512 input rows: the kernel itself, not
    the backend's route (which takes cuBLAS or the decode kernel at some row counts)."""
    from jetrl.quant.kernels import gemm_exact_triton as E

    g = torch.Generator(device="cuda").manual_seed(n * 3 + k)
    x = torch.randn(512, k, device="cuda", generator=g, dtype=torch.bfloat16)
    if path == "fp8":
        w = quantize_tensor(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16), WEIGHT)
        qx = quantize_tensor(x, ACT)
        return lambda m, tiles: E.exact_fp8_gemm(qx.data[:m], qx.scale[:m], w.data, w.scale, 128, tiles=tiles)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    return lambda m, tiles: E.exact_matmul(x[:m], w, tiles=tiles)


@pytest.mark.parametrize("path", ["fp8", "bf16"])
@pytest.mark.parametrize("n,k", [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)])
def test_exact_gemm_schedules_give_the_same_bits(path, n, k):
    """The wide schedule (larger tiles and more warps from ``exact_wide_min_m`` rows on, or the TMA walk) and the
    decode-sized tiles' launch are schedules: every candidate launch gives, for all 512 rows, the bits of the
    default decode-sized tiles, with the shape's default K split and with none (S = 1), and the rows of
    M = 100..511 (below and above the wide threshold) agree with them."""
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.gemm_exact_triton import EXACT_TILES, ExactTiles

    fn = _kernel_operands(path, n, k)
    for split in (0, 1):
        with tuning.override(exact_split_k=split, exact_wide_min_m=0):
            base = fn(512, EXACT_TILES)
        for launch in SCHEDULES:
            tiles = ExactTiles(**launch)
            with tuning.override(exact_split_k=split, exact_wide_min_m=200):
                assert torch.equal(fn(512, tiles), base), (split, launch)
                for m in (100, 200, 257, 511):
                    assert torch.equal(fn(m, tiles), base[:m]), (split, launch, m)


def test_row_wise_kernels_are_batch_invariant():
    from jetrl.models.logprobs import exact_logprobs_from_logits
    from jetrl.models.rope import apply_rope_qk
    from jetrl.quant.norm import rms_norm
    from jetrl.quant.swiglu import swiglu

    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", generator=g, dtype=torch.bfloat16)
    x, r = torch.randn(8192, 4096, **bf), torch.randn(8192, 4096, **bf)
    w = torch.rand(4096, **bf) + 0.5
    full = rms_norm(x, w, 1e-5, r, quantize=True, impl="triton")
    for m in ROWS:
        part = rms_norm(x[:m], w, 1e-5, r[:m], quantize=True, impl="triton")
        assert torch.equal(part.out, full.out[:m]) and torch.equal(part.out_fp8.scale, full.out_fp8.scale[:m]), m
    gate, up = torch.randn(8192, 14336, **bf), torch.randn(8192, 14336, **bf)
    act, fp8 = swiglu(gate, up, quantize=True, impl="triton")
    for m in ROWS:
        a, f = swiglu(gate[:m], up[:m], quantize=True, impl="triton")
        assert torch.equal(a, act[:m]) and torch.equal(f.data.view(torch.uint8), fp8.data[:m].view(torch.uint8)), m
    q, k = torch.randn(8192, 32, 128, **bf), torch.randn(8192, 8, 128, **bf)
    cos, sin = torch.randn(8192, 128, **bf), torch.randn(8192, 128, **bf)
    fq, fk = apply_rope_qk(q, k, cos, sin, impl="triton")
    for m in ROWS:
        pq, pk = apply_rope_qk(q[:m], k[:m], cos[:m], sin[:m], impl="triton")
        assert torch.equal(pq, fq[:m]) and torch.equal(pk, fk[:m]), m
    # exact mode's log-probabilities on CUDA are the Triton kernel's (both the sampler and the trainer dispatch
    # there), not torch's log_softmax: the two differ in the last bits, which is allowed; each is batch-invariant
    from jetrl.models.logprobs import exact_stats_reference
    from jetrl.quant.kernels.logprobs_triton import exact_logprob_stats

    logits = torch.randn(1024, 128256, device="cuda", generator=g) * 3
    targets = torch.randint(0, 128256, (1024,), device="cuda", generator=g)
    temps = torch.rand(1024, device="cuda", generator=g) + 0.5
    full = exact_logprobs_from_logits(logits, targets, temps)
    assert all(torch.equal(a, b) for a, b in zip(full, exact_logprob_stats(logits, targets, temps)))
    ref = exact_stats_reference(logits, targets, temps)
    assert all(torch.allclose(a, b, atol=5e-5, rtol=0) for a, b in zip(full, ref))
    for m in (1, 3, 17, 255, 300):
        for start in (0, 1024 - m):
            got = exact_logprobs_from_logits(logits[start:start + m], targets[start:start + m], temps[start:start + m])
            assert all(torch.equal(a, b[start:start + m]) for a, b in zip(got, full)), (m, start)
    wide = torch.zeros(1024, 128256 + 3, device="cuda")
    wide[:, 1:-2] = logits  # a strided, misaligned view: copied first, the same bits
    assert all(torch.equal(a, b) for a, b in zip(exact_logprobs_from_logits(wide[:, 1:-2], targets, temps), full))
    half = logits.to(torch.bfloat16)  # the trainer's bf16 logits and the sampler's fp32 ones of the same values
    assert all(torch.equal(a, b) for a, b in zip(exact_logprobs_from_logits(half, targets, temps),
                                                 exact_logprobs_from_logits(half.float(), targets, temps)))


@pytest.mark.parametrize("heads", [32, 40])  # GQA groups 4 (Llama 8B) and 5 (Qwen2.5-32B) over 8 KV heads
def test_swapped_decode_gives_the_training_forwards_bits(heads):
    """A decode step on the swapped kernel (one query row per program, keys as the MMA's rows) gives each row the
    bits the packed training forward (the tile kernel) gives it as the last row of its sequence, at every pipeline
    depth; contexts from one key to 1,280, partial and whole chunks."""
    from jetrl.models.attention import PagedAttentionMetadata, packed_as_paged
    from jetrl.quant.kernels.exact_attention_triton import exact_attention_fwd

    g = torch.Generator(device="cuda").manual_seed(2)
    lengths = [1, 15, 16, 17, 63, 64, 65, 300, 777, 1280]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    bf = dict(device="cuda", generator=g, dtype=torch.bfloat16)
    q, k, v = (torch.randn(cu[-1], heads, 128, **bf), torch.randn(cu[-1], 8, 128, **bf) * 2,
               torch.randn(cu[-1], 8, 128, **bf))
    packed = packed_as_paged(cu, "cuda")
    want = exact_attention_fwd(q, k[:, None], v[:, None], packed, 0.088)  # more rows than sequences: tiles
    last = torch.tensor(cu[1:], device="cuda") - 1
    meta = PagedAttentionMetadata(torch.arange(len(lengths) + 1, dtype=torch.int32, device="cuda"),
                                  packed.context_lens, packed.block_tables,
                                  torch.zeros(len(lengths), dtype=torch.long, device="cuda"), 1, max(lengths))
    assert torch.isfinite(want).all()
    for stages in (1, 2, 3):  # the swapped kernel at its default pipeline stages (1) and two others
        got = exact_attention_fwd(q[last], k[:, None], v[:, None], meta, 0.088, decode_stages=stages)
        assert torch.equal(got, want[last]), (stages, (got.float() - want[last].float()).abs().max())


@pytest.fixture(scope="module")
def models_8b():
    config = DecoderConfig.from_hf(LLAMA8B_2_BLOCKS)
    return {recipe: build_model(config, dtype=torch.bfloat16, device="cuda", recipe=recipe, seed=0)
            for recipe in ("bf16", "jet")}


def _prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 300, (count,), generator=g).tolist()
    return [torch.randint(0, 128000, (n,), generator=g).tolist() for n in lengths]


def _score(model, prompts, outs, micro: int, kv_fp8: bool = False) -> list[torch.Tensor]:
    return trainer_logprobs(model, prompts, outs, micro=micro, kv_fp8=kv_fp8)


ARMS = [("bf16", False), ("jet", False), ("jet", True)]  # (recipe, FP8 KV cache)
ARM_IDS = ["bf16", "jet", "jet-kv8"]


@pytest.mark.parametrize("recipe,kv_fp8", ARMS, ids=ARM_IDS)
def test_engine_equals_trainer_bitwise_8b_shape_with_cuda_graphs(models_8b, recipe, kv_fp8):
    model = models_8b[recipe]
    engine = RolloutEngine(model, max_num_seqs=256, max_model_len=512, memory_budget=0.2, progress=False,
                           exact=True, kv_fp8=kv_fp8)
    for num_prompts, n in ((1, 1), (3, 1), (17, 1), (8, 8), (64, 4)):  # 1, 3, 17, 64 and 256 sequences
        prompts = _prompts(num_prompts, seed=num_prompts)
        outs = engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=48, seed=5,
                                                       ignore_eos=True))
        assert engine.runner.graphs is not None, "the decode step was not captured"
        assert engine.runner.kv_cache.is_fp8 == kv_fp8
        for c, lp in zip(outs, _score(model, prompts, outs, micro=16, kv_fp8=kv_fp8)):
            engine_lp = torch.tensor(c.logprobs, dtype=torch.float32)
            assert torch.equal(engine_lp, lp), (recipe, num_prompts * n, (engine_lp - lp).abs().max())


class _Prompts:
    def __init__(self, per_step: int) -> None:
        self.per_step = per_step

    def next_batch(self):
        from jetrl.rl.trainer import PromptItem

        return [PromptItem(p, "") for p in _prompts(self.per_step, seed=3)]


@pytest.mark.parametrize("bypass", [False, True], ids=["old-logprob-pass", "rollout-logprobs"])
@pytest.mark.parametrize("recipe,kv_fp8", ARMS, ids=ARM_IDS)
def test_one_rl_step_has_zero_mismatch(models_8b, recipe, kv_fp8, bypass):
    """Zero mismatch in one RL step: against the old_logprob pass, or (``use_rollout_logprobs``, which skips that
    pass in exact mode) against the update's forwards before the optimizer step (one mini-batch: every token)."""
    from jetrl.config import load_config
    from jetrl.rl.trainer import Trainer

    cfg = load_config(None, [f"--recipe={recipe}", "--exact=true", "--data.prompts_per_step=8", "--rollout.n=4",
                             "--rollout.max_tokens=32", "--algorithm.micro_batch_size=8", "--optim.lr=1e-6",
                             f"--kv_fp8={str(kv_fp8).lower()}", f"--algorithm.use_rollout_logprobs={bypass}"])
    model = models_8b[recipe]
    engine = RolloutEngine(model, max_num_seqs=32, max_model_len=512, memory_budget=0.2, progress=False,
                           exact=True, kv_fp8=cfg.kv_fp8)
    trainer = Trainer(cfg, model, engine, _Prompts(8), lambda texts, refs: [float(len(t) % 2) for t in texts],
                      lambda ids: " ".join(map(str, ids)))
    metrics = trainer.step()
    assert metrics["mismatch/logp_abs_diff_max"] == 0.0, metrics["mismatch/logp_abs_diff_max"]
    assert math.isfinite(metrics["actor/pg_loss"])
    assert ("time/old_logprob" in metrics) != bypass
    assert metrics.get("mismatch/checked_frac", 1.0) == 1.0


# The 8B weights (q/k/v fused, o, gate/up fused, down) with K walked in one range: cuBLAS's schedule
CUBLAS_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.parametrize("n,k", CUBLAS_SHAPES)
def test_exact_gemm_on_cublas_gives_the_triton_bits(n, k):
    """``exact_cublas_min_m`` is a schedule: with K unsplit (``exact_split_k=1``), cuBLAS's blockwise GEMM from 65
    rows (the default) on gives, row for row, the bits of the Triton kernel's in-order walk for every M (fresh scales
    that are not powers of two, so the scale products round: the order of the scale application is tested too),
    and the rows of decode-sized M (the decode kernel) agree with it; with the shape's default split it is not used
    where S > 1."""
    from jetrl.quant.kernels import tuning

    g = torch.Generator(device="cuda").manual_seed(n + 7 * k)
    w = quantize_tensor(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02, WEIGHT)
    x = torch.randn(4096, k, device="cuda", generator=g, dtype=torch.bfloat16)
    x = x * torch.rand(4096, 1, device="cuda", generator=g) * 4  # rows of different magnitudes
    qx = quantize_tensor(x, ACT)
    with tuning.override(exact_split_k=1, exact_cublas_min_m=0, exact_decode_max_m=0):
        triton_bits = exact_fp8_gemm(qx, w)
    with tuning.override(exact_split_k=1):
        assert tuning.current().exact_cublas_min_m == 65
        assert tuning.current().exact_on_cublas(65, n, k) and not tuning.current().exact_on_cublas(64, n, k)
        assert torch.equal(exact_fp8_gemm(qx, w), triton_bits)
        for m in (1, 17, 64, 65, 100, 128, 129, 200, 255, 256, 257, 1000):
            assert torch.equal(exact_fp8_gemm(quantize_tensor(x[:m], ACT), w), triton_bits[:m]), m
    split = tuning.current().exact_split(n, k)
    assert tuning.current().exact_on_cublas(4096, n, k) == (split == 1)


# Exact mode's decode schedule (the split-K decode kernel at exact mode's split): the 8B model's weights as the
# model runs them (q/o, k/v, gate/up alone and grouped, q/k/v grouped, down), and two weights sharing an input
# whose default splits differ (4 and 1: no grouped launch)
DECODE_SCHEDULE_CASES = [((4096,), 4096), ((1024,), 4096), ((14336,), 4096), ((14336, 14336), 4096),
                         ((4096,), 14336), ((4096, 1024, 1024), 4096), ((4096, 28672), 14336)]


@pytest.mark.parametrize("split", [dict(), dict(exact_split_k=1), dict(exact_split_k=8)])
@pytest.mark.parametrize("widths,k", DECODE_SCHEDULE_CASES)
def test_exact_decode_schedule_gives_the_triton_bits(widths, k, split):
    """``exact_decode_max_m`` is a schedule: up to 64 rows (the default) exact mode's FP8 GEMM runs on the split-K
    decode kernel, alone or as one grouped launch (where the weights' splits agree), and gives the exact Triton
    kernel's bits for every M, with the shapes' default K split, unsplit, and split in up to 8 (fresh fp32 scales
    that are not powers of two), with the decode configs' K unroll where it keeps the split's boundaries (the 8B
    down projection's 2)."""
    from jetrl.quant import get_backend
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.cuda_backend import exact_gemm_path

    g = torch.Generator(device="cuda").manual_seed(sum(widths) + k + len(split))
    ws = [quantize_tensor(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02, WEIGHT)
          for n in widths]
    x = torch.randn(64, k, device="cuda", generator=g, dtype=torch.bfloat16)
    x = x * torch.rand(64, 1, device="cuda", generator=g) * 4
    be = get_backend(x.device)
    with tuning.override(**split):
        assert tuning.current().exact_decode_max_m == 64
        for m in (1, 2, 3, 16, 17, 31, 33, 48, 64):
            qx = quantize_tensor(x[:m], ACT)
            with tuning.override(exact_decode_max_m=0, exact_cublas_min_m=0):
                ref = torch.cat([be.gemm_exact(qx, w) for w in ws], dim=1)
                assert all(exact_gemm_path(qx, w)[0] == "triton" for w in ws)
            assert all(exact_gemm_path(qx, w)[0] == "decode" for w in ws)
            single = torch.cat([be.gemm_exact(qx, w) for w in ws], dim=1)
            assert torch.equal(single, ref), m
            grouped = be.grouped_gemm_exact(qx, ws)
            splits = {tuning.current().exact_split(n, k) for n in widths}
            assert (grouped is not None) == (len(splits) == 1), splits
            if grouped is not None:
                assert torch.equal(grouped, ref), m
        assert exact_gemm_path(quantize_tensor(torch.cat([x, x]), ACT), ws[0])[0] != "decode"  # 128 rows
        assert be.grouped_gemm_exact(quantize_tensor(torch.cat([x, x]), ACT), ws) is None
