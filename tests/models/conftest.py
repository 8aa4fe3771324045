"""Tiny random HuggingFace checkpoints of each supported family, written once per test session."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 1000
BASE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# name -> (config class name, overrides); together they cover GQA, llama3 RoPE scaling, tied and untied
# embeddings, q/k/v(/o/mlp) biases and q/k RMSNorm
VARIANTS = {
    "llama": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "llama_tied_bias": ("LlamaConfig", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(head_dim=64, tie_word_embeddings=False)),
}


def hf_config(variant: str):
    cls_name, overrides = VARIANTS[variant]
    return getattr(transformers, cls_name)(**BASE, **overrides)


def make_hf_model(variant: str, seed: int = 0):
    """A transformers model with every parameter random (norm weights and biases included), fp32, eval."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(variant)).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """variant -> (folder, transformers model); the folder holds config.json + model.safetensors."""
    out = {}
    for variant in VARIANTS:
        model = make_hf_model(variant)
        folder = tmp_path_factory.mktemp(variant)
        model.save_pretrained(folder)
        out[variant] = (str(folder), model)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
