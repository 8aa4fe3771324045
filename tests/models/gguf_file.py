"""Small GGUF files written by the tests themselves (with the ``gguf`` package), laid out as llama.cpp's converter
lays out a HuggingFace Llama / Qwen2 checkpoint: its tensor names, and for ``llama`` the q/k rows permuted from
HuggingFace's rotate-half order to llama.cpp's interleaved RoPE order (``convert_hf_to_gguf.py``'s ``permute``)."""

from __future__ import annotations

import numpy as np
import torch

HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of a q or k projection's rows (per head: the two RoPE halves interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: the 256 printable stand-ins of the bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def random_weights(arch: str, *, vocab: int, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int,
                   tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """HuggingFace-named fp32 weights of a decoder of this shape (Qwen2: q/k/v biases)."""
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def rand(*shape, scale=0.05):
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": rand(vocab, hidden, scale=0.5), "model.norm.weight": 1 + rand(hidden)}
    if not tied:
        w["lm_head.weight"] = rand(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                  p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                  p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                  p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                  p + "mlp.gate_proj.weight": rand(ffn, hidden), p + "mlp.up_proj.weight": rand(ffn, hidden),
                  p + "mlp.down_proj.weight": rand(hidden, ffn),
                  p + "input_layernorm.weight": 1 + rand(hidden), p + "post_attention_layernorm.weight": 1 + rand(hidden)})
        if arch == "qwen2":
            for proj, width in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                w[p + f"self_attn.{proj}_proj.bias"] = rand(width * head_dim)
    return w


def write_gguf(path, weights: dict[str, torch.Tensor], *, arch: str = "llama", heads: int, kv_heads: int,
               quantized: dict[str, str] | None = None, rope_theta: float = 10000.0, eps: float = 1e-5,
               context: int = 512, chat_template: str | None = None, raw_tensors: dict | None = None) -> None:
    """Write ``weights`` (HuggingFace names) as a GGUF file of ``arch`` with a byte-level BPE tokenizer.

    ``quantized``: HF name -> GGML type name (``Q8_0``, ``Q4_0``, ...) for tensors stored quantized; the rest
    are F32. ``raw_tensors``: extra GGUF tensors as ``name -> (uint8 bytes, GGML type name)`` (for tensor types
    the writer cannot quantize to)."""
    import gguf

    quantized = quantized or {}
    embed = weights["model.embed_tokens.weight"]
    vocab, hidden = embed.shape
    layers = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("model.layers."))
    ffn = weights["model.layers.0.mlp.gate_proj.weight"].shape[0]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("jetrl test model")
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_rope_dimension_count(hidden // heads)
    tokens = byte_tokens()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = tokens + ["Ġt", "Ġa"] + specials
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    assert len(tokens) == vocab, "the test vocabulary needs at least 261 rows"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 258 + [3] * 3 + [1] * (vocab - 261))
    writer.add_token_merges(["Ġ t", "Ġ a"])
    writer.add_bos_token_id(256 + 2)
    writer.add_eos_token_id(256 + 4)
    writer.add_pad_token_id(256 + 2)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    def gguf_name(hf: str) -> str:
        if hf == "model.embed_tokens.weight":
            return "token_embd.weight"
        if hf == "model.norm.weight":
            return "output_norm.weight"
        if hf == "lm_head.weight":
            return "output.weight"
        _, _, i, rest = hf.split(".", 3)
        module, leaf = rest.rsplit(".", 1)
        return f"blk.{i}.{HF_TO_GGUF[module]}.{leaf}"

    for hf, value in weights.items():
        array = value.float().numpy()
        if arch == "llama" and hf.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, heads)
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, kv_heads)
        qtype = quantized.get(hf)
        if qtype is None:
            writer.add_tensor(gguf_name(hf), np.ascontiguousarray(array, dtype=np.float32))
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name(hf), gguf.quants.quantize(array, kind), raw_dtype=kind)
    for name, (data, qtype) in (raw_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dequantized(value: torch.Tensor, qtype: str) -> torch.Tensor:
    """What a GGUF tensor of ``qtype`` holding ``value`` reads back as (the gguf package's round trip)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    array = value.float().numpy()
    return torch.from_numpy(np.array(gguf.quants.dequantize(gguf.quants.quantize(array, kind), kind))).reshape(value.shape)
