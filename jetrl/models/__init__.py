"""Decoder models of jetrl: Llama 3.x, Qwen2/2.5 and Qwen3 from HuggingFace checkpoints, in any precision recipe.

Public entry points: :func:`load_model`, :func:`load_tokenizer`, :func:`save_model` (``fp8=True`` for the
block-FP8 export vLLM/SGLang serve), :func:`build_model` (random weights from a config), and
:func:`token_logprobs` (chunked fp32 log-probabilities and entropies). The attention paths and the paged
KV-cache interface used by the rollout engine live in :mod:`jetrl.models.attention`.
"""

from jetrl.models.attention import (PagedAttentionMetadata, PagedKVCache, paged_attention,
                                    paged_attention_reference, varlen_attention, write_kv)
from jetrl.models.checkpoint import (check_eos, check_tokenizer, export_model, load_model, load_tokenizer,
                                     resolve_checkpoint, resolve_device, save_model)
from jetrl.models.config import DecoderConfig
from jetrl.models.logprobs import logprobs_from_hidden, token_logprobs
from jetrl.models.transformer import DecoderLM, build_model

__all__ = [
    "DecoderConfig", "DecoderLM", "build_model", "load_model", "load_tokenizer", "save_model", "resolve_checkpoint",
    "export_model", "resolve_device", "check_eos", "check_tokenizer",
    "token_logprobs", "logprobs_from_hidden",
    "PagedAttentionMetadata", "PagedKVCache", "write_kv", "paged_attention_reference", "paged_attention",
    "varlen_attention",
]
