"""``DecoderConfig``: one dataclass for the Llama 3.x, Qwen2/2.5 and Qwen3 decoders, read from HF ``config.json``.

The three families share one block (RMSNorm -> GQA attention with RoPE -> RMSNorm -> SwiGLU MLP) and
differ by flags:

==========  ===============================  ==============================================
family      ``model_type`` / architecture     differences
==========  ===============================  ==============================================
Llama 3.x   ``llama`` / LlamaForCausalLM      optional ``attention_bias`` (q/k/v/o), ``mlp_bias``,
                                             ``rope_scaling`` of type ``llama3``
Qwen2/2.5   ``qwen2`` / Qwen2ForCausalLM      q/k/v bias always on, no o_proj bias
Qwen3       ``qwen3`` / Qwen3ForCausalLM      RMSNorm on q and k per head, optional ``attention_bias``
==========  ===============================  ==============================================

Reading is strict about the computation and lenient about everything else. Fields that change nothing the
model computes are accepted wherever HuggingFace or another tool writes them (names, token ids, versions,
cache and output flags, generation defaults, a tool's namespaced metadata: ``is_inert_hf_field``); fields
that would change it are accepted only at the value jetrl builds (``NEUTRAL_HF_FIELDS``: no soft-capping,
no interleaved RoPE, no dropout, ...). A field jetrl does not know, an unknown architecture or an option it
does not implement (another activation, sliding-window attention, an unsupported RoPE type) raises one
``ValueError`` naming it and saying what to do, instead of silently building a different model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")
# transformers' defaults (LlamaConfig, Qwen2Config, Qwen3Config) for the fields whose absence a config.json may rely
# on and where DecoderConfig's own default differs
HF_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768, "head_dim": 128},
}

# Fields that describe a checkpoint without changing the function the model computes: names, token ids,
# versions, switches of other frameworks (caches, outputs, generation defaults, tensor-parallel hints) and
# fields read or checked below. A key that starts with "_", ends in "_token_id(s)" or "_version", or holds a
# "." (a tool's namespace, e.g. "transformers.js_config") is inert too, whatever its name.
IGNORED_HF_FIELDS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "pretraining_tp", "attention_dropout", "max_window_layers", "sliding_window",
    "use_sliding_window", "layer_types", "rope_theta", "rope_scaling", "rope_parameters", "quantization_config",
    "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "torchscript", "is_decoder",
    "chunk_size_feed_forward", "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "prefix",
    "task_specific_params", "tokenizer_class", "hidden_act", "attention_bias", "mlp_bias", "head_dim",
    "tie_word_embeddings", "keys_to_ignore_at_inference", "use_qk_norm", "name_or_path", "model_name",
    "is_llama_config", "tf_legacy_loss", "use_bfloat16",
    # generation defaults that transformers 4 wrote into config.json (jetrl samples by its own settings)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens",
})
# Fields accepted at the value that leaves the decoder as jetrl builds it; any other value would change the
# computation (or says the weights are laid out otherwise) and is an error naming it.
NEUTRAL_HF_FIELDS: dict[str, Any] = {
    "rope_interleaved": False, "is_encoder_decoder": False, "add_cross_attention": False,
    "tie_encoder_decoder": False, "cross_attention_hidden_size": None, "pruned_heads": {},
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "hidden_dropout": 0.0,
    "residual_dropout": 0.0, "embedding_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
}

# accepted fields a save does not write back: jetrl writes them itself, or they are transformers' base-class
# output switches that say nothing about the model
_NOT_WRITTEN_BACK = frozenset({
    "rope_theta", "rope_scaling", "rope_parameters", "quantization_config", "architectures", "model_type",
    "torch_dtype", "dtype", "attention_bias", "hidden_act", "transformers_version", "output_hidden_states",
    "output_attentions", "return_dict", "use_return_dict", "torchscript", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type",
})


def is_inert_hf_field(key: str) -> bool:
    """Whether a config.json field changes nothing the model computes, by name (see ``IGNORED_HF_FIELDS``)."""
    return (key in IGNORED_HF_FIELDS or key.startswith("_") or key.endswith(("_token_id", "_token_ids", "_version"))
            or "." in key)


@dataclass
class DecoderConfig:
    """Shape and options of a decoder; every field has its HuggingFace meaning."""

    model_type: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None
    extra: dict = field(default_factory=dict)  # ignored HF fields, kept so a save writes them back

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; jetrl builds {sorted(FAMILIES)}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                                 f"{self.num_attention_heads}; set head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        self.rope_scaling = _check_rope_scaling(self.rope_scaling)

    @property
    def architecture(self) -> str:
        return FAMILIES[self.model_type]

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids as a list (HF stores an int, a list, or nothing)."""
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    def check_context(self, tokens: int, what: str) -> None:
        """Raise a ValueError unless ``tokens`` positions (``what`` says whose) fit in the model's context,
        ``max_position_embeddings``: positions past it were never trained (and RoPE tables may end there)."""
        if tokens > self.max_position_embeddings:
            raise ValueError(f"{what} = {tokens} tokens exceed the model's context of {self.max_position_embeddings} "
                             f"positions (max_position_embeddings in its config.json); lower them")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], strict: bool = True, source: str | None = None) -> "DecoderConfig":
        """Read a HF ``config.json`` dict; ``strict`` rejects fields jetrl does not know; ``source`` (the file)
        prefixes the errors."""
        if not isinstance(hf, dict):
            raise TypeError(f"a HF config must be a dict, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        if model_type not in FAMILIES:
            raise ValueError(f"unsupported model_type {model_type!r} (architectures {archs}); jetrl builds "
                             f"{', '.join(f'{k} ({v})' for k, v in FAMILIES.items())}")
        unknown_archs = [a for a in archs if a != FAMILIES[model_type]]
        if unknown_archs:
            raise ValueError(f"unsupported architectures {unknown_archs} for model_type {model_type!r}; "
                             f"jetrl builds {FAMILIES[model_type]}")
        known = {f.name for f in fields(cls)} - {"extra", "qkv_bias", "o_proj_bias", "qk_norm", "rope_scaling",
                                                 "rope_theta", "model_type"}
        where = f"{source}: " if source else ""
        changed = {k: hf[k] for k, neutral in NEUTRAL_HF_FIELDS.items() if k in hf and hf[k] not in (neutral, None)}
        if changed:
            raise ValueError(f"{where}config fields {changed} change what the model computes, and jetrl builds this "
                             f"{model_type} model only with {({k: NEUTRAL_HF_FIELDS[k] for k in changed})}: it does "
                             f"not implement these options")
        unknown = sorted(k for k in hf if k not in known and k not in NEUTRAL_HF_FIELDS and not is_inert_hf_field(k))
        if unknown and strict:
            raise ValueError(f"{where}unknown {model_type} config fields {unknown}: jetrl cannot tell whether they "
                             f"change what the model computes. If they do not (a tool's metadata, a name), delete "
                             f"them from config.json; if they do, jetrl does not build this model")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"config.json lacks required fields {missing}")

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; jetrl decoders use SwiGLU with 'silu'")
        if hf.get("use_sliding_window", False):
            raise ValueError("unsupported option use_sliding_window=True: jetrl runs full attention only")
        layer_types = hf.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"unsupported layer_types {sorted(set(layer_types))}: jetrl runs full attention only")
        if float(hf.get("attention_dropout", 0.0) or 0.0) != 0.0:
            raise ValueError("unsupported option attention_dropout > 0")
        if hf.get("quantization_config") and hf["quantization_config"].get("quant_method") != "fp8":
            raise ValueError(f"unsupported quantization_config {hf['quantization_config']}: jetrl reads BF16/fp32 "
                             f"checkpoints and block-FP8 (quant_method 'fp8') ones")

        rope_theta, rope_scaling = _read_rope(hf)
        attention_bias = bool(hf.get("attention_bias", False))
        qkv_bias, o_bias = (True, False) if model_type == "qwen2" else (attention_bias, attention_bias)
        kwargs = {k: hf[k] for k in known if k in hf and k != "torch_dtype"}
        kwargs["torch_dtype"] = hf.get("torch_dtype", hf.get("dtype"))
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = hf["num_attention_heads"]
        # a field left out means what transformers reads
        kwargs.update({key: value for key, value in HF_FAMILY_DEFAULTS[model_type].items() if key not in hf})
        if model_type != "llama":
            kwargs.pop("mlp_bias", None)
        extra = {k: v for k, v in hf.items() if k not in known and k not in _NOT_WRITTEN_BACK and not k.startswith("_")
                 and (k in NEUTRAL_HF_FIELDS or is_inert_hf_field(k))}
        return cls(model_type=model_type, rope_theta=rope_theta, rope_scaling=rope_scaling, qkv_bias=qkv_bias,
                   o_proj_bias=o_bias, qk_norm=model_type == "qwen3", extra=extra, **kwargs)

    @classmethod
    def from_file(cls, path: str | os.PathLike, strict: bool = True) -> "DecoderConfig":
        """Read ``config.json`` (a file, or a folder holding one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            with open(path) as f:
                hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path} is not valid JSON: {e}") from None
        return cls.from_hf(hf, strict=strict, source=path)

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict (legacy ``rope_theta``/``rope_scaling`` keys, which every reader accepts)."""
        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_proj_bias):
            raise ValueError("a qwen2 config has q/k/v bias and no o_proj bias")
        if self.model_type != "qwen2" and self.qkv_bias != self.o_proj_bias:
            raise ValueError(f"{self.model_type} has one attention_bias flag for q/k/v/o; got qkv_bias="
                             f"{self.qkv_bias}, o_proj_bias={self.o_proj_bias}")
        if self.qk_norm != (self.model_type == "qwen3"):
            raise ValueError("q/k RMSNorm is what distinguishes qwen3; it cannot be toggled on another family")
        hf: dict[str, Any] = {
            **self.extra, "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu", "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
        }
        if self.model_type != "qwen2":
            hf["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if self.torch_dtype is not None:
            hf["torch_dtype"] = self.torch_dtype
        return hf


def _read_rope(hf: dict[str, Any]) -> tuple[float, dict | None]:
    """RoPE base and scaling (checked by :func:`_check_rope_scaling`) from either the legacy keys or
    transformers 5's ``rope_parameters``."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    return theta, params if hf.get("rope_parameters") else hf.get("rope_scaling")


def _check_rope_scaling(scaling: dict | None) -> dict | None:
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"rope_scaling must be a dict or None, got {type(scaling).__name__}")
    scaling = dict(scaling)
    kind = scaling.pop("type", None) or scaling.get("rope_type", "default")
    scaling["rope_type"] = kind
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; jetrl implements {list(ROPE_TYPES)}")
    if kind == "default":
        return None
    need = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}[kind]
    missing = [k for k in need if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} lacks {missing}")
    unknown = sorted(set(scaling) - set(need) - {"rope_type"})
    if unknown:
        raise ValueError(f"unsupported rope_scaling fields {unknown} for type {kind!r}")
    return scaling


__all__ = ["DecoderConfig", "FAMILIES", "IGNORED_HF_FIELDS", "NEUTRAL_HF_FIELDS", "is_inert_hf_field"]
