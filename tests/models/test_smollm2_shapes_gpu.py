"""Every GPU path at SmolLM2-135M's shapes, the first pretrained model through jetrl, whose widths are off the
128-grid: in-features 576 (four and a half blocks), k/v 192 wide, 9 query heads and 3 KV heads of 64, FFN 1,536,
tied embeddings, a 49,152-token vocabulary. Quantization bitwise against the reference, the GEMMs to output
rounding, exact mode's rollout equal to its trainer bit for bit (BF16, FP8, FP8 KV cache) with CUDA graphs, and
the FP8 export's round trip."""

from __future__ import annotations

import pytest
import torch

from jetrl.models import DecoderConfig, build_model, load_model, save_model
from jetrl.models.checkpoint import fp8_unaligned_layers
from jetrl.quant import FP8Linear, get_backend
from jetrl.quant import reference as R
from jetrl.quant.formats import ACT, TOKEN, WEIGHT
from jetrl.rollout import RolloutEngine, SamplingParams
from trainer_scoring import trainer_logprobs

pytestmark = pytest.mark.gpu

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
               rope_theta=100000.0, tie_word_embeddings=True, eos_token_id=2)
# (out, in) of its linears: q, k/v, o, gate/up, down
WEIGHTS = [(576, 576), (192, 576), (1536, 576), (576, 1536)]


@pytest.fixture(scope="module")
def models():
    config = DecoderConfig(**SMOLLM2)
    return {recipe: build_model(config, dtype=torch.bfloat16, device="cuda", recipe=recipe, seed=0)
            for recipe in ("bf16", "jet")}


@pytest.mark.parametrize("rows", [1, 37, 300])
@pytest.mark.parametrize("n,k", WEIGHTS)
def test_quantization_bitwise_and_gemms_to_output_rounding(n, k, rows):
    backend = get_backend(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(n * k + rows)
    x = torch.randn(rows, k, generator=g, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) * 0.05
    for t, block in ((x, ACT), (w, WEIGHT), (x, TOKEN)):
        got, ref = backend.quantize(t, block, False), R.quantize_tensor(t, block)
        assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(got.scale, ref.scale)
    qx, qw = R.quantize_tensor(x, ACT), R.quantize_tensor(w, WEIGHT)
    out = backend.gemm(qx, qw, torch.bfloat16)
    exact = qx.dequantize().double() @ qw.dequantize().double().t()
    tol = exact.abs() * 2.0 ** -8 + (qx.dequantize().double().abs() @ qw.dequantize().double().abs().t()) * 2.0 ** -11
    assert torch.isfinite(out).all() and bool(((out.double() - exact).abs() <= tol).all())


@pytest.mark.parametrize("recipe,kv_fp8", [("bf16", False), ("jet", False), ("jet", True)],
                         ids=["bf16", "jet", "jet-kv8"])
def test_exact_mode_engine_equals_trainer_bitwise(models, recipe, kv_fp8):
    model = models[recipe]
    engine = RolloutEngine(model, max_num_seqs=64, max_model_len=512, memory_budget=0.1, progress=False,
                           exact=True, kv_fp8=kv_fp8)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in torch.randint(1, 200, (13,), generator=g)]
    outs = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=40, seed=5, ignore_eos=True))
    assert engine.runner.graphs is not None, "the decode step was not captured"
    for c, lp in zip(outs, trainer_logprobs(model, prompts, outs, kv_fp8=kv_fp8)):
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), lp), (recipe, kv_fp8)


def test_fp8_export_round_trips_bitwise(models, tmp_path):
    """The block-FP8 export at widths off the 128-grid: every block linear is named as one vLLM cannot read (the
    export warns with them), and loading the export back re-quantizes to the same bytes and scales."""
    model = models["jet"]
    assert len(fp8_unaligned_layers(model)) == 7 * SMOLLM2["num_hidden_layers"]
    save_model(model, tmp_path / "fp8", fp8=True)
    back = load_model(tmp_path / "fp8", dtype=torch.bfloat16, device="cuda", recipe="jet")
    for name, layer in model.named_modules():
        if isinstance(layer, FP8Linear):
            a, b = layer.quantized_weight(), back.get_submodule(name).quantized_weight()
            assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
