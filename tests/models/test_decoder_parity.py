"""jetrl decoders against transformers: same logits in fp32 (1e-5 relative), both load directions."""

from __future__ import annotations

import json
import os

import pytest
import torch

import jetrl.models as jm
from conftest import VARIANTS, VOCAB, make_hf_model, rel_err, transformers

# fp32 end to end; the two implementations run the same ops in the same order, so agreement is far
# tighter than 1e-5 in practice; 1e-5 is the bar of the architecture notes.
TOL = 1e-5


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(hf_checkpoints, variant, gen):
    folder, hf = hf_checkpoints[variant]
    model = jm.load_model(folder, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (3, 37), generator=gen)
    with torch.no_grad():
        ours, ref = model(ids), hf(ids).logits
    assert ours.shape == (3, 37, VOCAB)
    assert rel_err(ours, ref) < TOL


def test_config_flags_per_family(hf_checkpoints):
    flags = {v: jm.load_model(hf_checkpoints[v][0], dtype=torch.float32) for v in VARIANTS}
    assert flags["qwen2"].model.layers[0].self_attn.q_proj.bias is not None
    assert flags["qwen2"].model.layers[0].self_attn.o_proj.bias is None
    assert flags["qwen3"].model.layers[0].self_attn.q_norm is not None
    assert flags["llama"].model.layers[0].self_attn.q_norm is None
    assert flags["llama"].config.rope_scaling["rope_type"] == "llama3"
    assert flags["llama_tied_bias"].model.layers[1].mlp.down_proj.bias is not None
    assert flags["llama_tied_bias"].lm_head.weight is flags["llama_tied_bias"].model.embed_tokens.weight
    assert flags["llama"].lm_head.weight is not flags["llama"].model.embed_tokens.weight


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_packed_sequences_match_one_by_one(hf_checkpoints, variant, gen):
    folder, hf = hf_checkpoints[variant]
    model = jm.load_model(folder, dtype=torch.float32)
    lengths = [5, 23, 1, 31]
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    with torch.no_grad():
        logits = model.compute_logits(model.forward_packed(ids, positions, cu, max(lengths)))
        ref = torch.cat([hf(s[None]).logits[0] for s in seqs])
    assert logits.dtype == torch.float32 and logits.shape == (sum(lengths), VOCAB)
    assert rel_err(logits, ref) < TOL


def test_sharded_checkpoint(tmp_path, gen):
    hf = make_hf_model("qwen2", seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="300KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 2
    model = jm.load_model(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 19), generator=gen)
    with torch.no_grad():
        assert rel_err(model(ids), hf(ids).logits) < TOL


@pytest.mark.parametrize("variant,shard", [("llama", False), ("llama_tied_bias", False), ("qwen2", False),
                                           ("qwen3", False), ("llama", True)])
def test_jetrl_save_transformers_load(hf_checkpoints, tmp_path, variant, shard, gen):
    folder, _ = hf_checkpoints[variant]
    model = jm.load_model(folder, dtype=torch.float32)
    jm.save_model(model, tmp_path, max_shard_size=400_000 if shard else jm.checkpoint.DEFAULT_SHARD_BYTES)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == shard
    if shard:
        assert os.path.isfile(tmp_path / "generation_config.json")  # copied from the source folder
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 21), generator=gen)
    with torch.no_grad():
        assert rel_err(model(ids), reloaded(ids).logits) < TOL
    again = jm.load_model(tmp_path, dtype=torch.float32)  # and jetrl reads its own output
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_bf16_master_and_dtype_in_config(hf_checkpoints, tmp_path):
    model = jm.load_model(hf_checkpoints["qwen3"][0])
    assert model.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in model.parameters())
    jm.save_model(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_build_model_from_config_dict_is_seeded():
    cfg = make_hf_model("llama").config.to_dict()
    a = jm.build_model(cfg, dtype=torch.float32, seed=7)
    b = jm.build_model(jm.DecoderConfig.from_hf(cfg), dtype=torch.float32, seed=7)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y) and torch.isfinite(x).all(), name
    assert a.model.layers[0].mlp.up_proj.weight.std() > 0.01


@pytest.mark.parametrize("recipe", ["bf16", "jet"])
def test_activation_checkpointing_same_gradients(hf_checkpoints, gen, recipe):
    """Checkpointing every block, some of them (``blocks``) or none gives identical gradients, and keeps fewer
    activations the more blocks it recomputes."""
    model = jm.load_model(hf_checkpoints["qwen3"][0], dtype=torch.float32, recipe=recipe)
    layers = len(model.model.layers)
    assert layers >= 2
    ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
    grads, num_saved = [], []
    for enabled, blocks in ((False, None), (True, None), (True, 1), (True, 0), (True, layers)):
        model.zero_grad()
        model.set_activation_checkpointing(enabled, blocks=blocks)
        model.train()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            loss = model(ids).float().logsumexp(-1).sum()
        loss.backward()
        num_saved.append(sum(saved))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    none, every, one, zero, all_ = num_saved
    assert every < none / 2  # the blocks' activations were not kept
    assert every < one < none  # one block recomputed: the others' activations kept
    assert zero == none and all_ == every  # 0 blocks: none recomputed; as many as the model has: all
    for name, g in grads[0].items():
        assert torch.isfinite(g).all() and g.abs().sum() > 0, name
        # recomputation replays the same ops on the same inputs: identical gradients
        for other in grads[1:]:
            assert torch.equal(g, other[name]), name


def test_checkpointed_blocks_out_of_range_are_refused(hf_checkpoints):
    model = jm.load_model(hf_checkpoints["qwen3"][0], dtype=torch.float32)
    layers = len(model.model.layers)
    for bad in (-1, layers + 1, True, 1.5):
        with pytest.raises(ValueError, match=f"from 0 to the model's {layers} blocks"):
            model.set_activation_checkpointing(True, blocks=bad)
