"""Bad checkpoints and configs fail with errors that name the problem."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import jetrl.models as jm
from jetrl.models.config import DecoderConfig


@pytest.fixture
def ckpt(hf_checkpoints, tmp_path):
    """A writable copy of the tiny Llama checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints["llama"][0], dst)
    return dst


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))


def test_truncated_safetensors(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        jm.load_model(ckpt)


def test_garbage_header(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="cannot read safetensors file"):
        jm.load_model(ckpt)


def test_no_weights(ckpt):
    os.remove(ckpt / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        jm.load_model(ckpt)
    (ckpt / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="convert them to safetensors"):
        jm.load_model(ckpt)


def test_missing_config_and_bad_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        jm.load_model(ckpt)
    os.remove(ckpt / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        jm.load_model(ckpt)


def test_missing_shard_and_corrupt_index(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, ckpt / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[half:]}, ckpt / "model-00002-of-00002.safetensors")
    os.remove(ckpt / "model.safetensors")
    index = {"weight_map": {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, n in enumerate(names)}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert jm.load_model(ckpt, dtype=torch.float32) is not None  # the hand-made shards load
    os.remove(ckpt / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        jm.load_model(ckpt)
    (ckpt / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="corrupt checkpoint index"):
        jm.load_model(ckpt)


def test_mismatched_shapes(ckpt):
    edit_config(ckpt, intermediate_size=384)
    with pytest.raises(ValueError, match=r"shape mismatch for 'model.layers.0.mlp.(gate|up|down)_proj.weight'"):
        jm.load_model(ckpt)


def test_missing_and_unexpected_tensors(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 tensors.*layers.1.self_attn.k_proj.weight"):
        jm.load_model(ckpt)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(128, 256)
    tensors["model.layers.7.extra.weight"] = torch.ones(3)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match="does not have.*layers.7.extra.weight"):
        jm.load_model(ckpt)


def test_unknown_config_field(ckpt):
    """One error naming the field, the file, and what a user can do (delete it from config.json)."""
    edit_config(ckpt, some_new_knob=3)
    with pytest.raises(ValueError, match=r"config.json: unknown llama config fields \['some_new_knob'\].*delete them "
                                         r"from config.json"):
        jm.load_model(ckpt)
    assert jm.load_model(ckpt, dtype=torch.float32, strict=False).config.num_hidden_layers == 2


def test_fields_that_change_no_computation_are_accepted(ckpt, tmp_path):
    """What HuggingFace, transformers' GGUF reader, nanotron and transformers.js write into real configs (SmolLM2's
    among them) loads as it is, and a save writes the model's own fields back, not other tools' names."""
    reference = jm.load_model(ckpt, dtype=torch.float32)
    edit_config(ckpt, _name_or_path="x", _model_name_or_path="Smollm2 135M", unk_token_id=0, pad_token_id=2,
                sep_token_id=None, is_llama_config=True, rope_interleaved=False, pretraining_tp=1,
                **{"transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16"}}}, unsloth_version="2025.1",
                max_length=20, do_sample=False, output_attentions=False, id2label={"0": "LABEL_0"},
                final_logit_softcapping=None, pruned_heads={}, use_bfloat16=False)
    model = jm.load_model(ckpt, dtype=torch.float32)
    ids = torch.randint(0, 100, (1, 11))
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))
    jm.save_model(model, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["unk_token_id"] == 0 and saved["pad_token_id"] == 2 and "_model_name_or_path" not in saved
    assert "id2label" not in saved and "output_attentions" not in saved


@pytest.mark.parametrize("field,value", [("rope_interleaved", True), ("final_logit_softcapping", 30.0),
                                         ("attn_logit_softcapping", 50.0), ("hidden_dropout", 0.1),
                                         ("add_cross_attention", True)])
def test_fields_that_would_change_the_computation_are_errors(ckpt, field, value):
    edit_config(ckpt, **{field: value})
    with pytest.raises(ValueError, match=rf"config fields \{{'{field}': {value}\}} change what the model computes"):
        jm.load_model(ckpt, strict=False)  # not a matter of strictness: jetrl would build another model


@pytest.mark.parametrize("changes,message", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "unsupported model_type 'gpt2'"),
    (dict(architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_scaling type 'yarn'"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(vocab_size=None), "vocab_size"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), "unsupported quantization_config"),
])
def test_unsupported_configs(ckpt, changes, message):
    edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=message):
        jm.load_model(ckpt)


def test_legacy_rope_keys_read_like_rope_parameters():
    base = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    legacy = DecoderConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": scaling})
    modern = DecoderConfig.from_hf({**base, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    assert legacy == modern and legacy.rope_theta == 5e5 and legacy.num_key_value_heads == 4
    with pytest.raises(TypeError, match="DecoderConfig"):
        jm.build_model("llama")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_fields_a_config_leaves_out_read_as_transformers_reads_them(model_type):
    """A config.json may leave out head_dim and max_position_embeddings: they mean transformers' defaults for the
    family (Qwen3's head_dim is 128 whatever hidden_size / heads gives; the context 2,048 or 32,768), not jetrl's."""
    transformers = pytest.importorskip("transformers")
    base = dict(model_type=model_type, vocab_size=1000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                num_attention_heads=16, num_key_value_heads=8)
    ours = DecoderConfig.from_hf(dict(base))
    theirs = transformers.AutoConfig.for_model(**base)
    expected_head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert ours.head_dim == expected_head_dim
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    given = DecoderConfig.from_hf({**base, "head_dim": 64, "max_position_embeddings": 4096})
    assert (given.head_dim, given.max_position_embeddings) == (64, 4096)


def test_hub_id_offline_fails_clearly(monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="could not be fetched from the HuggingFace hub"):
        jm.load_model("jetrl-tests/no-such-model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        jm.load_model("/no/such/folder")


def test_tokenizer_loads_from_folder(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    loaded = jm.load_tokenizer(tmp_path)
    assert loaded("hello world")["input_ids"] == [1, 2]


def test_token_ids_outside_the_vocabulary_are_rejected_clearly():
    model = jm.build_model(dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=1, num_attention_heads=4), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 10\)"):
        model(torch.tensor([[1, 2, 10]]))
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        model.forward_packed(torch.tensor([3, -1]), torch.tensor([0, 1]), torch.tensor([0, 2]))
    assert model(torch.tensor([[0, 9]])).shape == (1, 2, 10)


def test_export_model_checks_its_folders(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        jm.export_model(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(ValueError, match="must differ from the source"):
        jm.export_model(ckpt, str(ckpt) + "/")
    out = jm.export_model(ckpt, tmp_path / "bf16")
    assert out == str(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_resolve_device():
    assert jm.resolve_device("cpu") == torch.device("cpu")
    expected = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert jm.resolve_device("auto") == expected and jm.resolve_device(None) == expected
    if torch.cuda.is_available():
        assert jm.resolve_device("cuda:0") == torch.device("cuda", 0)
        with pytest.raises(ValueError, match="CUDA GPUs are visible"):
            jm.resolve_device(f"cuda:{torch.cuda.device_count()}")
    else:  # a CPU-only machine: a clear error instead of torch's "Torch not compiled with CUDA enabled" later
        with pytest.raises(ValueError, match=r"device 'cuda' was asked for but (this torch build has no CUDA "
                                             r"support|no CUDA GPU is visible); use 'cpu' or 'auto'"):
            jm.resolve_device("cuda")


def test_export_refuses_a_non_empty_folder_unless_overwrite(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"someone else's weights")
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"the export destination .*out is not empty; choose a new folder, "
                                              r"or pass --overwrite"):
        jm.export_model(ckpt, out)
    assert (out / "model.safetensors").read_bytes() == b"someone else's weights"  # nothing was touched
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        jm.export_model(ckpt, tmp_path / "file")
    jm.export_model(ckpt, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "keep me"
    jm.load_model(out, dtype=torch.float32)
    jm.export_model(ckpt, tmp_path / "empty")  # an empty or new folder needs no flag
    (tmp_path / "empty2").mkdir()
    jm.export_model(ckpt, tmp_path / "empty2")


def test_exported_weights_get_the_mode_of_the_other_files(ckpt, tmp_path):
    old = os.umask(0o022)
    try:
        jm.export_model(ckpt, tmp_path / "out")
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "out").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes


def test_fp8_export_warns_about_shapes_external_engines_cannot_read(ckpt, tmp_path):
    import warnings

    from jetrl.asset_files import EMBEDDED_MODEL, resolve_asset

    # the embedded tiny model: 128-wide, with a 352-wide MLP
    with pytest.warns(UserWarning, match=r"FP8 layers have weights that are not whole 128x128 blocks .*"
                                         r"mlp.*divisible by 128") as record:
        jm.export_model(resolve_asset(EMBEDDED_MODEL), tmp_path / "tiny", fp8=True)
    assert "(128, 352)" in str(record[0].message) and "(352, 128)" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 256/512-wide: every FP8 weight is whole blocks, no warning
        jm.export_model(ckpt, tmp_path / "aligned", fp8=True)
        jm.export_model(resolve_asset(EMBEDDED_MODEL), tmp_path / "bf16")  # BF16 has no blocks


class _Tokenizer:
    def __init__(self, size, bos, eos):
        self.size, self.bos_token_id, self.eos_token_id = size, bos, eos

    def __len__(self):
        return self.size


def test_check_tokenizer_against_the_model_config():
    config = DecoderConfig(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
                           eos_token_id=[2, 3])
    jm.check_tokenizer(_Tokenizer(100, 1, 2), config, "tok")
    jm.check_tokenizer(_Tokenizer(90, None, 3), config, "tok")  # a padded embedding; any listed EOS
    with pytest.raises(ValueError, match=r"the tokenizer at tok has 101 tokens but the model's config.json has "
                                         r"vocab_size=100: it belongs to another model"):
        jm.check_tokenizer(_Tokenizer(101, 1, 2), config, "tok")
    with pytest.raises(ValueError, match=r"the tokenizer at tok has BOS id 0 but the model's config.json has "
                                         r"bos_token_id=1"):
        jm.check_tokenizer(_Tokenizer(100, 0, 2), config, "tok")
    with pytest.raises(ValueError, match=r"the tokenizer at tok has EOS id 7 but the model's config.json has "
                                         r"eos_token_id=\[2, 3\]"):
        jm.check_tokenizer(_Tokenizer(100, 1, 7), config, "tok")


def test_check_context():
    config = DecoderConfig(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512)
    config.check_context(512, "x")
    with pytest.raises(ValueError, match=r"^a \+ b = 513 tokens exceed the model's context of 512 positions "
                                         r"\(max_position_embeddings in its config.json\); lower them$"):
        config.check_context(513, "a + b")
