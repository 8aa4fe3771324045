"""Decoder models of jetrl (Llama 3.x, Qwen2/2.5, Qwen3) and their attention paths."""

from jetrl.models.attention import (PagedAttentionMetadata, PagedKVCache, paged_attention,
                                    paged_attention_reference, varlen_attention, write_kv)

__all__ = ["PagedAttentionMetadata", "PagedKVCache", "write_kv", "paged_attention_reference", "paged_attention",
           "varlen_attention"]
