"""The decoder under FP8 recipes, and the block-FP8 export vLLM/SGLang load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import jetrl.models as jm
from jetrl.quant import WEIGHT, FP8Linear, fp8_linears, get_backend, precision_side
from conftest import VOCAB

BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def snr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(x).all()
    ref = ref.double()
    return (10 * torch.log10(ref.pow(2).sum() / (x.double() - ref).pow(2).sum())).item()


def model_layers(model) -> int:
    return model.config.num_hidden_layers


def test_jet_recipe_swaps_block_linears_only(hf_checkpoints):
    model = jm.load_model(hf_checkpoints["llama_tied_bias"][0], recipe="jet")
    swapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert swapped == set(BLOCK_LINEARS)
    assert len(fp8_linears(model)) == 7 * model.config.num_hidden_layers
    assert type(model.lm_head) is torch.nn.Linear
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after the swap


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_jet_logits_close_to_bf16(hf_checkpoints, variant, gen):
    folder = hf_checkpoints[variant][0]
    bf16 = jm.load_model(folder, recipe="bf16")
    jet = jm.load_model(folder, recipe="jet")
    ids = torch.randint(0, VOCAB, (2, 24), generator=gen)
    with torch.no_grad():
        ref = bf16(ids).float()
        train_side = jet(ids).float()
        with precision_side("rollout"):
            rollout_side = jet(ids).float()
    # Unified precision: both sides run the identical FP8 computation.
    assert torch.equal(train_side, rollout_side)
    # Budget: one FP8 linear on this model's own weights and BF16 activations (measured below, ~28.5 dB:
    # E4M3 keeps 3 mantissa bits, so each operand carries ~2^-5 relative rms rounding error). The 7 x L
    # FP8 linears each add an error of about that relative size, roughly independently, so the logits'
    # SNR is near single - 10*log10(7 L) (~17 dB for 2 layers; measured 17.5-19.6 dB across families).
    # 3 dB of margin; a wrong scale, a broken swap or a missing bias gives < 5 dB.
    layer = jet.model.layers[0].mlp.up_proj
    x = torch.randn(64, layer.in_features, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        single = snr_db(layer(x).float(), x.float() @ layer.weight.float().T)
    budget = single - 10 * torch.log10(torch.tensor(7.0 * model_layers(jet))).item() - 3.0
    snr = snr_db(train_side, ref)
    assert 25 < single < 32, single
    assert snr > budget, (snr, budget)


@pytest.mark.parametrize("recipe", ["bf16", "jet"])
def test_fp8_export_layout_and_bitwise_round_trip(hf_checkpoints, tmp_path, recipe):
    model = jm.load_model(hf_checkpoints["qwen2"][0], recipe=recipe)  # tied, q/k/v bias
    jm.save_model(model, tmp_path, fp8=True)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    assert hf["torch_dtype"] == "bfloat16"
    modules = dict(model.named_modules())
    num_fp8 = 0
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names  # tied
        for name in names:
            t = f.get_tensor(name)
            module, _, leaf = name.rpartition(".")
            if module.rsplit(".", 1)[-1] in BLOCK_LINEARS and leaf == "weight":
                layer = modules[module]
                expected = (layer.quantized_weight() if isinstance(layer, FP8Linear)
                            else get_backend("cpu").quantize(layer.weight.detach(), WEIGHT))
                scale = f.get_tensor(name + "_scale_inv")
                assert t.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
                assert scale.shape == (t.shape[0] // 128, t.shape[1] // 128)
                assert torch.equal(t.view(torch.uint8), expected.data.view(torch.uint8)), name
                assert torch.equal(scale, expected.scale), name
                num_fp8 += 1
            elif leaf != "weight_scale_inv":
                assert t.dtype == torch.bfloat16, name  # norms, embedding, biases stay BF16
    assert num_fp8 == 7 * model.config.num_hidden_layers

    # Loading the export: the master is the dequantized FP8 and re-quantizes to the same bytes
    again = jm.load_model(tmp_path, recipe="jet")
    original = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in BLOCK_LINEARS}
    for name, layer in again.named_modules():
        if isinstance(layer, FP8Linear):
            a = layer.quantized_weight()
            src = original[name]
            b = src.quantized_weight() if isinstance(src, FP8Linear) else get_backend("cpu").quantize(
                src.weight.detach(), WEIGHT)
            assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), name
            assert torch.equal(a.scale, b.scale), name
            assert torch.equal(layer.weight, b.dequantize().to(torch.bfloat16)), name
    # everything that is not a block linear weight comes back unchanged
    for (name, p), (_, q) in zip(model.state_dict().items(), again.state_dict().items()):
        if name.rsplit(".", 2)[-2] not in BLOCK_LINEARS or name.endswith("bias"):
            assert torch.equal(p, q), name


def test_fp8_export_then_bf16_export_drops_quantization_config(hf_checkpoints, tmp_path):
    model = jm.load_model(hf_checkpoints["llama"][0], recipe="jet")
    jm.save_model(model, tmp_path / "fp8", fp8=True)
    again = jm.load_model(tmp_path / "fp8")
    jm.save_model(again, tmp_path / "bf16")
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
